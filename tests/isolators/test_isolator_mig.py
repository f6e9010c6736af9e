"""R-MG-2..4: MIG devices as units of the isolator, enforced by the kernel.

A node of two H200s: GPU 0 in MIG mode with the balanced layout (GI 3 and
GI 4 of profile 1g.18gb, GI 2 2g.35gb, GI 1 3g.71gb), GPU 1 whole; the
capability facts are written as a driver has them, with a major that is not
the default one (real hosts give nvidia-caps a dynamic major). On the
kernel (root; v1 and v2) a child process moved into a container's cgroup
opens mknod'ed nodes: its MIG device's parent and its two capability nodes
give ENXIO (allowed, no driver), the capability nodes of the GPU's other
MIG devices EPERM -- after prepare, after update and after an agent restart.
"""

from __future__ import annotations

import errno
import os

import pytest

import runtime
from actors.resources import Resources
from isolators import ContainerID, ImageManifest
from tests.support.containers import config, started_with
from tests.support.errors import injected, isolator_failure, raises_isolator_error
from tests.support.mig import EXPECTED, GPU1, HOST, MIG, expect, kernel_scenario, mknod_mig_nodes, sees
from tests.support.mig import write_mig_proc


def mig_node(node_factory, backend: str, strategy: str = "mixed", host: dict = HOST, **extra):
    node = node_factory(backend, host=host, nvidia_mig_strategy=strategy, **extra)
    write_mig_proc(node.proc_dir, host)
    return node


@pytest.fixture
def mig_nodes(tmp_path):
    """mknod'ed GPU, control and capability nodes (``tests.support.mig``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = tmp_path / "mig-nodes"
    directory.mkdir()
    return mknod_mig_nodes(str(directory))


@pytest.mark.asyncio
async def test_a_container_opens_its_mig_device_and_nothing_of_the_others(
        kernel_backend, node_factory, mig_nodes) -> None:
    """Prepare, update, agent restart, update: each container opens exactly its
    units' nodes (the scenario of ``tests.support.mig``; the fake-NVML tests run
    the same one through the real pynvml bindings)."""
    node = mig_node(node_factory, kernel_backend)
    async with runtime.Runtime():
        seen = await kernel_scenario(node.flags(), mig_nodes)
    assert seen == EXPECTED


@pytest.mark.asyncio
async def test_single_strategy_counts_mig_devices_as_gpus(node_factory, backend, mig_nodes, probes) -> None:
    host = {"driver_version": "550.90.07", "gpus": [dict(HOST["gpus"][0])]}
    node = mig_node(node_factory, backend, "single", host=host)
    async with runtime.Runtime():
        _components, isolator = await started_with(node, two="gpus:2")
        assert await isolator.containers() == {"two": ["195:0/gi1/ci0", "195:0/gi2/ci0"]}
        await isolator_failure(isolator.prepare(ContainerID("three"), config("gpus:3")),
                               "Requested 3 gpus but only 2 available")
        await isolator.update(ContainerID("two"), Resources.parse("gpus:1"))
        assert await isolator.containers() == {"two": ["195:0/gi1/ci0"]}  # the highest went back
        if node.kernel:
            probe = probes()
            probe.move_to(isolator.devices.path("two"))
            assert sees(probe, mig_nodes) == expect("3g")
        await isolator.cleanup(ContainerID("two"))


@pytest.mark.asyncio
async def test_mig_requests_are_validated_with_clear_errors(node_factory) -> None:
    node = mig_node(node_factory, "memory")
    async with runtime.Runtime():
        components, isolator = await node.start()
        cases = {
            "mig-1g.18gb:0.5": "The 'mig-1g.18gb' resource must be an unsigned integer",
            "mig-1g.18gb:3": "Requested 3 mig-1g.18gb but only 2 available",
            "mig-2g.20gb:1": "Requested 1 mig-2g.20gb but this node offers no 'mig-2g.20gb' (its resources:"
                             " gpus, mig-1g.18gb, mig-2g.35gb, mig-3g.71gb)",
            "gpus:2": "Requested 2 gpus but only 1 available",
        }
        for resources, message in cases.items():
            await isolator_failure(isolator.prepare(ContainerID("x"), config(resources)), message)
        assert await isolator.containers() == {}
        state = await components.allocator.state()
        assert len(state.mig_available) == 4 and state.available == [GPU1]  # nothing taken


@pytest.mark.asyncio
async def test_a_node_whose_mig_devices_lack_capability_facts_does_not_start(node_factory) -> None:
    node = node_factory("memory", host=HOST, nvidia_mig_strategy="mixed", proc_dir="/nonexistent-proc")
    async with runtime.Runtime():
        missing = "; ".join(
            f"MIG device 195:0/gi{gi}/ci0: no 'nvidia-caps' line in '/nonexistent-proc/devices', no line"
            f" 'gpu0/gi{gi}/access', no line 'gpu0/gi{gi}/ci0/access'" for gi in (1, 2, 3, 4))
        with raises_isolator_error(
                "MIG devices without capability facts in '/nonexistent-proc/driver/nvidia-caps/mig-minors' and"
                f" '/nonexistent-proc/devices' (4): {missing}. Each MIG device needs its GPU- and compute-instance"
                " capability minors and the 'nvidia-caps' major (is the nvidia-caps driver loaded? on a test node,"
                " point '--proc_dir' at files of your own)"):
            await node.start()


@pytest.mark.asyncio
async def test_usage_of_a_mig_device_is_read_on_its_mig_handle(node_factory) -> None:
    node = mig_node(node_factory, "memory")
    async with runtime.Runtime():
        _components, isolator = await started_with(node, u="gpus:1;mig-1g.18gb:1")
        stats = await isolator.usage(ContainerID("u"))
        assert stats.gpus_allocated == 2
        mig, whole = stats.gpus
        assert (mig.minor, mig.mig_profile, mig.gpu_instance_id, mig.compute_instance_id) == (0, "1g.18gb", 3, 0)
        assert mig.uuid.startswith("MIG-")
        assert (mig.memory_used_bytes, mig.memory_total_bytes) == (512 << 20, 16896 << 20)
        assert mig.utilization_gpu_percent is None and mig.power_milliwatts is None
        assert (whole.minor, whole.mig_profile, whole.utilization_gpu_percent) == (1, None, 7)


@pytest.mark.asyncio
async def test_watch_names_the_mig_device_and_its_resource(node_factory) -> None:
    node = mig_node(node_factory, "memory")
    async with runtime.Runtime():
        components, isolator = await started_with(node, h="mig-2g.35gb:1")
        watch = isolator.watch(ContainerID("h"))
        await components.allocator.mark_unhealthy(MIG["2g"], "Xid 79")
        limitation = await watch
        assert limitation.message == "MIG device 195:0/gi2/ci0 of container h became unhealthy: Xid 79"
        assert limitation.resources == Resources.parse("mig-2g.35gb:1")


@pytest.mark.asyncio
async def test_a_rootfs_gets_the_capability_proc_files_read_only(node_factory, tmp_path) -> None:
    node = mig_node(node_factory, "memory")
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    async with runtime.Runtime():
        _components, isolator = await node.start()
        info = await isolator.prepare(ContainerID("r"), config(
            "mig-1g.18gb:1", rootfs=str(rootfs), docker_manifest=ImageManifest(env=[])))
        proc = [m for m in info.mounts if "/capabilities/" in m.source]
        assert [(os.path.relpath(m.source, node.proc_dir), os.path.relpath(m.target, rootfs)) for m in proc][:2] == [
            ("driver/nvidia/capabilities/gpu0/mig/gi1/access", "proc/driver/nvidia/capabilities/gpu0/mig/gi1/access"),
            ("driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access",
             "proc/driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access"),
        ]
        assert len(proc) == 8 and all(m.flags & 1 for m in proc)  # MS_RDONLY, every MIG device of the node
        await isolator.cleanup(ContainerID("r"))


@pytest.mark.asyncio
async def test_a_failed_mig_update_changes_nothing_and_leaks_no_mig_device(backend, node_factory, probes,
                                                                           mig_nodes) -> None:
    """An update whose kernel write fails is an IsolatorError; the MIG device it
    had taken is held back until the kernel matches the record again, then
    goes back: the container keeps exactly what it had, the pool loses nothing."""
    node = mig_node(node_factory, backend)
    async with runtime.Runtime():
        components, isolator = await node.start(fault={})
        await isolator.prepare(ContainerID("a"), config("mig-1g.18gb:1"))
        node.fault.arm(1, errno=errno.EIO)
        path = isolator.devices.path("a")
        operation, target = {"memory": ("apply", path), "cgroups_v1": ("mkdir", path),  # EEXIST: it exists
                             "cgroups_v2": ("open", path)}[backend]
        await isolator_failure(isolator.update(ContainerID("a"), Resources.parse("mig-1g.18gb:1;mig-3g.71gb:1")),
                               injected(operation, target, errno.EIO))
        node.fault.arm(None)
        assert await isolator.containers() == {"a": ["195:0/gi3/ci0"]}
        state = await components.allocator.state()
        assert state.mig_allocated == [MIG["1g-a"]] and len(state.mig_available) == 3
        assert await isolator.reconcile() == []
        if node.kernel:
            probe = probes()
            probe.move_to(isolator.devices.path("a"))
            assert sees(probe, mig_nodes) == expect("1g-a")
            probe.close()
        await isolator.cleanup(ContainerID("a"))
