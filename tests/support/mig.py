"""A MIG node for tests, and one kernel scenario run in-process and through
the real pynvml bindings over the fake NVML.

Rules:
- ``HOST``: two H200s; GPU 0 in MIG mode with the balanced layout (GI 3
  and GI 4 of 1g.18gb, GI 2 2g.35gb, GI 1 3g.71gb), GPU 1 whole.
  ``CAPS_MAJOR`` is not the default 239: the isolator must read the
  ``nvidia-caps`` major from ``<proc_dir>/devices``, as on real hosts where
  it is dynamic. ``write_mig_proc(proc_dir)`` writes those facts.
- ``mknod_mig_nodes(directory)``: a dev dir as a driver makes it --
  ``nvidia0``, ``nvidia1``, ``nvidiactl``, ``nvidia-uvm`` and
  ``nvidia-caps/nvidia-cap<minor>`` of GPU 0's MIG devices (root) -- so it
  serves as ``--dev_dir`` of a node on the real NVML too;
  ``mig_nodes_in(directory)`` names the same nodes without making them.
- ``sees(probe, nodes)``: the verdict (``probes.verdict``) on opening each node from inside a
  cgroup -- GPU nodes read-write, capability nodes read-only (real ones are
  0444) -- and ``expect(*names, whole=...)`` what a container holding those
  MIG devices (and GPU 1) must see: GRANTED or DENIED.
- ``kernel_scenario(flags, nodes)`` starts components and an isolator from
  ``flags``, prepares ``a`` and ``b`` (one 1g.18gb each) and ``w`` (GPU 1),
  probes from inside each cgroup, updates ``a`` twice, restarts the agent
  (drops every actor, starts again, recovers), probes again, updates once
  more, cleans everything up; it returns what it saw at each stage (plain
  data: the fake-NVML child sends it back as JSON). Probes are always
  closed; a failure cleans up what it can and raises.
"""

from __future__ import annotations

import os
from typing import Any

from actors.flags import Flags
from actors.gpu import Gpu
from actors.mig import MigDevice
from actors.mig.testing import cap_minor, write_proc_dir
from actors.nvml import host_spec_from_dict
from actors.resources import Resources

from .probes import DENIED, GRANTED, DeviceProbe, DeviceNodes, mknod_nodes

CAPS_MAJOR = 508
GPU0, GPU1 = Gpu(195, 0), Gpu(195, 1)
MIG = {"1g-a": MigDevice(GPU0, 3, 0), "1g-b": MigDevice(GPU0, 4, 0), "2g": MigDevice(GPU0, 2, 0),
       "3g": MigDevice(GPU0, 1, 0)}
HOST: dict[str, Any] = {
    "driver_version": "550.90.07",
    "gpus": [
        {"name": "NVIDIA H200", "memory_total_mib": 143771, "mig": True, "mig_devices": [
            {"gi": 3, "ci": 0, "profile": "1g.18gb", "memory_total_mib": 16896, "memory_used_mib": 512},
            {"gi": 4, "ci": 0, "profile": "1g.18gb", "memory_total_mib": 16896},
            {"gi": 2, "ci": 0, "profile": "2g.35gb", "memory_total_mib": 33792},
            {"gi": 1, "ci": 0, "profile": "3g.71gb", "memory_total_mib": 71424},
        ]},
        {"name": "NVIDIA H200", "memory_total_mib": 143771, "memory_used_mib": 100, "utilization_gpu": 7},
    ],
}


def write_mig_proc(proc_dir: str, host: dict[str, Any] = HOST) -> str:
    return write_proc_dir(proc_dir, host_spec_from_dict(host), caps_major=CAPS_MAJOR)


def caps_of(device: MigDevice) -> tuple[int, int]:
    return cap_minor(device.parent.minor, device.gi), cap_minor(device.parent.minor, device.gi, device.ci)


def _dev_names() -> dict[tuple[str, int, int], str]:
    names = {("c", 195, 0): "nvidia0", ("c", 195, 1): "nvidia1", ("c", 195, 255): "nvidiactl",
             ("c", 235, 0): "nvidia-uvm"}
    for device in MIG.values():
        for minor in caps_of(device):
            names["c", CAPS_MAJOR, minor] = f"nvidia-caps/nvidia-cap{minor}"
    return names


def mig_nodes_in(directory: str) -> DeviceNodes:
    return DeviceNodes(directory, {key: os.path.join(directory, name) for key, name in _dev_names().items()})


def mknod_mig_nodes(directory: str) -> DeviceNodes:
    os.makedirs(os.path.join(directory, "nvidia-caps"), exist_ok=True)
    for (kind, major, minor), name in _dev_names().items():
        mknod_nodes(os.path.dirname(os.path.join(directory, name)), [(kind, major, minor)],
                    name=os.path.basename(name))
    return mig_nodes_in(directory)


def sees(probe: DeviceProbe, nodes: DeviceNodes) -> dict[str, str]:
    seen = {"nvidia0": probe.access(nodes["c", 195, 0]), "nvidia1": probe.access(nodes["c", 195, 1]),
            "nvidiactl": probe.access(nodes["c", 195, 255])}
    for name, device in MIG.items():
        gi, ci = caps_of(device)
        seen[f"{name}:gi"] = probe.access(nodes["c", CAPS_MAJOR, gi], os.O_RDONLY)
        seen[f"{name}:ci"] = probe.access(nodes["c", CAPS_MAJOR, ci], os.O_RDONLY)
    return seen


def expect(*granted: str, whole: bool = False) -> dict[str, str]:
    seen = {"nvidia0": GRANTED if granted else DENIED,
            "nvidia1": GRANTED if whole else DENIED, "nvidiactl": GRANTED}
    for name in MIG:
        for part in ("gi", "ci"):
            seen[f"{name}:{part}"] = GRANTED if name in granted else DENIED
    return seen


EXPECTED = {
    "held": {"a": ["195:0/gi3/ci0"], "b": ["195:0/gi4/ci0"], "w": [1]},
    "prepared": {"a": expect("1g-a"), "b": expect("1g-b"), "w": expect(whole=True)},
    "write_cap": DENIED,
    "updated": {"a": expect("2g")},
    "grown": {"a": expect("2g", "1g-a", whole=True), "b": expect("1g-b")},
    "recovered_held": {"a": ["195:0/gi2/ci0", "195:0/gi3/ci0", 1], "b": ["195:0/gi4/ci0"]},
    "recovery_report": [],
    "restarted": {"a": expect("2g", "1g-a", whole=True), "b": expect("1g-b")},
    "repairs": 0,
    "after_restart_update": {"a": expect("3g")},
    "left": [],
}
"""What ``kernel_scenario`` must see on the kernel."""


async def _start(flags: Flags) -> tuple[Any, Any]:
    from isolators import NvidiaComponents, NvidiaGpuIsolatorProcess

    components = await NvidiaComponents.create(flags)
    try:
        return components, await NvidiaGpuIsolatorProcess.create(flags, components)
    except BaseException:
        await components.close()
        raise


async def kernel_scenario(flags: Flags, nodes: DeviceNodes) -> dict[str, Any]:
    """Run the scenario (see module rules); what it saw, by stage."""
    from isolators import ContainerConfig, ContainerID, ContainerState

    def cid(name: str) -> Any:
        return ContainerID(name)

    seen: dict[str, Any] = {}
    probes: dict[str, DeviceProbe] = {}
    components, isolator = await _start(flags)
    try:
        for name, resources in (("a", "mig-1g.18gb:1"), ("b", "mig-1g.18gb:1"), ("w", "gpus:1")):
            await isolator.prepare(cid(name), ContainerConfig(resources=Resources.parse(resources)))
            probes[name] = DeviceProbe()
            probes[name].move_to(isolator.devices.path(name))
        seen["held"] = await isolator.containers()
        seen["prepared"] = {name: sees(probe, nodes) for name, probe in probes.items()}
        seen["write_cap"] = probes["a"].access(nodes["c", CAPS_MAJOR, caps_of(MIG["1g-a"])[0]], os.O_RDWR)
        await isolator.update(cid("a"), Resources.parse("mig-2g.35gb:1"))
        seen["updated"] = {"a": sees(probes["a"], nodes)}
        probes.pop("w").close()
        await isolator.cleanup(cid("w"))
        await isolator.update(cid("a"), Resources.parse("gpus:1;mig-2g.35gb:1;mig-1g.18gb:1"))
        seen["grown"] = {name: sees(probe, nodes) for name, probe in probes.items()}
        await isolator.close()
        await components.close()
        components = isolator = None
        components, isolator = await _start(flags)
        await isolator.recover([ContainerState(cid("a")), ContainerState(cid("b"))], set())
        seen["recovered_held"] = await isolator.containers()
        seen["recovery_report"] = isolator.recovery_report
        seen["restarted"] = {name: sees(probe, nodes) for name, probe in probes.items()}
        seen["repairs"] = len(await isolator.reconcile())
        await isolator.update(cid("a"), Resources.parse("mig-3g.71gb:1"))
        seen["after_restart_update"] = {"a": sees(probes["a"], nodes)}
    finally:
        for probe in probes.values():
            probe.close()
        if isolator is not None:
            for name in sorted(await isolator.containers()):
                await isolator.cleanup(cid(name))
            seen["left"] = await isolator.devices.list_cgroups()
            await isolator.close()
        if components is not None:
            await components.close()
    return seen
