"""A simulated node for one test, and the kernel as judge of it.

Rules:
- ``Node`` is ``isolators.simulated_node.SimulatedNode`` with what tests add: its
  files are made at once in the test's directory, ``gpus`` GPUs with usage
  readings per GPU (``usage_host``), lowest-first allocation (tests name the
  GPUs they expect), a cgroups root ``gpu-isolator-test-<pid>-<hex>`` (or
  the caller's prefix), fault injection on ``start``, and ``teardown()``
  that removes the whole root whatever state it is in: test probes inside
  are killed, v2 programs detached, the cgroups removed deepest first; the
  in-memory table is dropped.
- ``judge(node)`` reads the KERNEL, not the isolator: v1 ``devices.list`` of
  every cgroup under the root; v2 the programs attached to each cgroup
  (``BPF_PROG_QUERY``: none attached = every device allowed; else exactly
  one, ours, whose policy is read back from its instructions and proven by
  its tag, else a failure); in-memory the shared table. Then it checks that every GPU
  is either free in the allocator or granted to exactly one container, never
  both, never two; that the isolator's records, the allocator and the kernel
  agree; that no cgroup exists for a container the isolator does not know.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from actors.devices import PROGRAM_NAME, Policy, CgroupsV1Backend, CgroupsV2Backend, DeviceControl
from actors.devices import MemoryBackend
from actors.devices.testing import FaultInjectingBackend
from isolators import NvidiaComponents
from isolators.simulated_node import DRIVER_VERSION, SimulatedNode

from .kernel import NVIDIA, hierarchy_of, program_infos, program_policy, remove_test_cgroups

TEST_ROOT_PREFIX = f"gpu-isolator-test-{os.getpid()}-"


def usage_host(gpus: int = 4) -> dict[str, Any]:
    """A host document whose GPUs have usage readings (values derived from the index)."""
    return {
        "driver_version": DRIVER_VERSION,
        "gpus": [
            {
                "minor": i,
                "memory_total_mib": 16384,
                "memory_used_mib": 100 * (i + 1),
                "utilization_gpu": 10 + i,
                "utilization_memory": 20 + i,
                "power_mw": 50000 + i,
                "temperature_c": 40 + i,
            }
            for i in range(gpus)
        ],
    }


class Node(SimulatedNode):
    """A simulated node for one test (see the module rules)."""

    def __init__(self, directory: str | os.PathLike[str], backend: str, gpus: int = 4, *,
                 host: dict[str, Any] | None = None, root_prefix: str = TEST_ROOT_PREFIX, **extra: Any) -> None:
        super().__init__(directory, backend, host=host if host is not None else usage_host(gpus),
                         root_prefix=root_prefix, hierarchy=hierarchy_of(backend),
                         extra={"gpu_allocation": "lowest", **extra})
        self.gpus = gpus
        self.fault: FaultInjectingBackend | None = None
        self.create_files()

    @property
    def kernel(self) -> bool:
        return self.backend != "memory"

    def cgroup_dir(self, name: str) -> str:
        assert self.kernel, "in-memory cgroups have no directory"
        return os.path.join(self.root, name)

    def inner_backend(self) -> Any:
        """A fresh device backend for this node's root (to wrap in a fault injector)."""
        if self.backend == "memory":
            return MemoryBackend(self.root, shared=True)
        if self.backend == "cgroups_v1":
            return CgroupsV1Backend(self.hierarchy, self.cgroups_root)
        return CgroupsV2Backend(self.hierarchy, self.cgroups_root)

    async def start(self, changes: dict[str, Any] | None = None, /, *, fault: dict[str, Any] | None = None,
                    **more: Any) -> tuple[NvidiaComponents, Any]:
        """Components and an isolator (inside a Runtime). ``fault``: wrap the device
        backend in ``FaultInjectingBackend(**fault)`` (kept as ``self.fault``)."""
        devices = None
        self.fault = None
        if fault is not None:
            self.fault = FaultInjectingBackend(self.inner_backend(), **fault)
            devices = await DeviceControl.create(backend_impl=self.fault)
        return await super().start(changes, devices=devices, **more)

    @staticmethod
    async def crash(components: NvidiaComponents, isolator: Any) -> None:
        """Drop these actors without cleaning anything up (an agent crash)."""
        await isolator.close()
        await components.close()

    async def clean_all(self) -> bool:
        """Clean up every container the isolator knows; the root must be gone."""
        if self.isolator is None:
            return False
        removed = await super().clean_all()
        assert removed is True, "the root still has cgroups"
        return removed

    def teardown(self) -> None:
        """Remove the root and everything below it, whatever state it is in."""
        MemoryBackend.drop_shared(self.root)
        if self.kernel:
            remove_test_cgroups(self.root, v2=self.backend == "cgroups_v2")

    # -- what the kernel grants -------------------------------------------------------

    def kernel_policy(self, name: str) -> Policy | None:
        """v2: the policy of the one device program attached to cgroup ``name``,
        read back from the kernel (None when none is attached); a failure when
        there are several, or one that is not ours."""
        path = os.path.join(self.root, name)
        infos = program_infos(path)
        if not infos:
            return None
        assert len(infos) == 1 and infos[0].name == PROGRAM_NAME, f"{path}: device programs {infos}"
        access = program_policy(infos[0].id)
        assert access is not None, f"{path}: device program {infos[0].id} cannot be read back as one of ours"
        return access

    def kernel_grants(self) -> dict[str, set[int]]:
        """cgroup -> the minors of this node's GPUs the kernel lets it read and write."""
        minors = range(self.gpus)
        grants: dict[str, set[int]] = {}
        if self.backend == "memory":
            for name, access in (MemoryBackend.shared_table(self.root) or {}).items():
                grants[name] = {m for m in minors if access.is_granted("c", NVIDIA, m, "rw")}
            return grants
        if self.backend == "cgroups_v1":
            for name in self.cgroups():
                with open(os.path.join(self.root, name, "devices.list")) as handle:
                    lines = handle.read().split()
                grants[name] = {m for m in minors if _v1_grants(lines, m)}
            return grants
        for name in self.cgroups():
            access = self.kernel_policy(name)
            if access is None:
                grants[name] = set(minors)  # no program: the kernel allows every device
                continue
            grants[name] = {m for m in minors if access.is_granted("c", NVIDIA, m, "rw")}
        return grants


def _v1_grants(words: list[str], minor: int) -> bool:
    """Whether a devices.list (split in words) lets a process read and write 195:minor."""
    for i in range(0, len(words) - 2, 3):
        kind, numbers, access = words[i : i + 3]
        major_text, minor_text = numbers.split(":")
        if (
            kind in ("a", "c")
            and major_text in ("*", str(NVIDIA))
            and minor_text in ("*", str(minor))
            and "r" in access
            and "w" in access
        ):
            return True
    return False


async def judge(node: Node, model: dict[str, int] | None = None, *,
                extra_cgroups: Iterable[str] = ()) -> dict[str, list[int]]:
    """Check the invariants with the kernel as judge (see module rules); the
    minors each container holds. ``model``: container -> expected GPU count.
    ``extra_cgroups``: cgroups the isolator may have forgotten on purpose
    (kept because processes were inside): they must grant no GPU."""
    isolator, allocator = node.isolator, node.components.allocator
    grants = node.kernel_grants()
    records = await isolator.containers()
    free = {g.minor for g in await allocator.available()}
    allocated = {g.minor for g in await allocator.allocated()}
    extra = set(extra_cgroups)
    where = (f"[{node.backend}] kernel {sorted((k, sorted(v)) for k, v in grants.items())}, records {records},"
             f" free {sorted(free)}")
    for minor in range(node.gpus):
        holders = [name for name, minors in grants.items() if minor in minors]
        assert len(holders) <= 1, f"GPU {minor} is granted to {holders}: {where}"
        assert (minor in free) != (minor in allocated), f"GPU {minor} free and allocated: {where}"
        if minor in free:
            assert not holders, f"GPU {minor} is free but granted to {holders}: {where}"
        else:
            assert holders, f"GPU {minor} is allocated but no cgroup is granted it: {where}"
    assert set(grants) - extra == set(records), f"cgroups and records differ: {where}"
    for name in extra & set(grants):
        assert not grants[name], f"forgotten cgroup {name} still grants GPUs: {where}"
    for name, minors in records.items():
        assert set(minors) == grants[name], f"container {name}: record {minors} != kernel: {where}"
    assert allocated == {m for minors in records.values() for m in minors}, f"allocator != records: {where}"
    if node.backend == "cgroups_v2":
        for name in records:
            state = await isolator.devices.state(name)
            assert state == node.kernel_policy(name), f"{name}: device state {state} != the kernel's program"
    if model is not None:
        assert {k: len(v) for k, v in records.items()} == model, f"model {model}: {where}"
    return records
