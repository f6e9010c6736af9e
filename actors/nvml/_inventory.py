"""NodeInventory: one snapshot of what a node's NVML says about its GPUs.

Rules:
- ``read_inventory(nvml)`` asks the port everything the allocator and the
  CLI need, in one blocking pass (run it as ONE executor job): driver
  version, and per GPU index, minor, UUID, name, bus id, memory, NUMA node,
  MIG mode and NVLink peers, plus the topology level of every pair.
- A fact the device cannot tell (``NvmlNotSupported``) is recorded as
  unknown (None / no links); any other NVML failure propagates, naming the
  function and the GPU index.
- NVLink peers are found by matching each active link's remote bus id to a
  GPU of the node; links to other devices (NVSwitches, CPUs) do not count
  as GPU peers.
- ``GpuInfo.pcie_switch`` is derived from the topology alike for both
  implementations: the lowest index of the GPUs sharing its PCIe switch
  (level SINGLE or closer), None when it shares a switch with no other GPU.
- ``topology[i][j]`` is the ``TOPOLOGY_*`` level between GPUs i and j
  (None: unknown); the diagonal is ``TOPOLOGY_INTERNAL``.
- MIG (R-MG-1): for every GPU with MIG mode on, the MIG devices in each
  slot ``0..max_mig_device_count-1`` (an empty slot, NVML_ERROR_NOT_FOUND,
  is skipped): GPU- and compute-instance ids, UUID, profile and memory, as
  ``NodeInventory.mig_devices`` (parent index, then MIG index order).
- ``read_usage(nvml, indices)`` reads memory, utilisation, power and
  temperature for several GPUs in one pass; unsupported readings are None.
  MIG devices (``(parent index, MIG index, device)`` targets) are read the
  same way on their MIG handles: memory answers, the rest where NVML
  answers (today's drivers: not supported, so None).
"""

from __future__ import annotations

import collections

import msgspec

from actors.gpu import NVIDIA_MAJOR, Gpu, GpuInfo
from actors.mig import MigDevice, MigDeviceInfo

from ._errors import NVML_ERROR_NOT_FOUND, NvmlError, NvmlNotSupported
from ._port import TOPOLOGY_INTERNAL, TOPOLOGY_SINGLE, Nvml

__all__ = [
    "NodeInventory",
    "GpuUsage",
    "MigDeviceUsage",
    "read_inventory",
    "read_mig_devices",
    "read_usage",
    "read_mig_usage",
]

_MIB = 1024 * 1024


class NodeInventory(msgspec.Struct, frozen=True, kw_only=True):
    """The GPUs of a node, their facts and the topology between them."""

    kind: str
    """``"nvml"`` or ``"simulated"``."""
    source: str
    driver_version: str
    gpus: list[GpuInfo]
    topology: list[list[int | None]]
    """``topology[i][j]``: the NVML topology level between indices i and j."""
    control_devices: dict[str, str] = {}
    mig_devices: list[MigDeviceInfo] = []
    """Every MIG device of the GPUs with MIG mode on (parent index, then MIG index)."""

    def by_index(self, index: int) -> GpuInfo:
        """The GPU at NVML index ``index`` (IndexError if none)."""
        for info in self.gpus:
            if info.index == index:
                return info
        raise IndexError(f"No GPU with index {index} on this node ({len(self.gpus)} GPUs)")

    def by_gpu(self) -> dict[Gpu, GpuInfo]:
        """Inventory records keyed by the GPU identity."""
        return {info.gpu: info for info in self.gpus}

    def mig_devices_of(self, index: int) -> list[MigDeviceInfo]:
        """The MIG devices of the GPU at NVML index ``index``."""
        return [mig for mig in self.mig_devices if mig.parent_index == index]

    def by_mig(self) -> dict[MigDevice, MigDeviceInfo]:
        """MIG device records keyed by their identity."""
        return {mig.device: mig for mig in self.mig_devices}

    def level(self, first: int, second: int) -> int | None:
        """The topology level between two NVML indices (None: unknown)."""
        return self.topology[first][second]


class Readings(msgspec.Struct, frozen=True, kw_only=True):
    """A unit's current readings; None where NVML cannot tell."""

    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_gpu_percent: int | None = None
    utilization_memory_percent: int | None = None
    power_mw: int | None = None
    temperature_c: int | None = None


class GpuUsage(Readings, frozen=True, kw_only=True):
    """One GPU's current readings."""

    gpu: Gpu
    index: int


class MigDeviceUsage(Readings, frozen=True, kw_only=True):
    """One MIG device's current readings (on its MIG handle)."""

    device: MigDevice
    parent_index: int
    index: int


def _optional(call, *args):
    try:
        return call(*args)
    except NvmlNotSupported:
        return None


def _at(index: int, error: NvmlError) -> NvmlError:
    # Keep the type and facts, add which GPU.
    detail = f"GPU index {index}" + (f"; {error.detail}" if error.detail else "")
    return type(error)(error.function, error.code, error.text, detail)


def read_inventory(nvml: Nvml) -> NodeInventory:
    """Read a whole node (blocking; see module rules)."""
    driver = nvml.driver_version()
    count = nvml.device_count()
    handles = []
    records = []
    for index in range(count):
        try:
            handle = nvml.handle(index)
            handles.append(handle)
            memory = nvml.memory(handle)
            records.append(
                dict(
                    index=index,
                    gpu=Gpu(NVIDIA_MAJOR, nvml.minor(handle)),
                    uuid=nvml.uuid(handle),
                    name=nvml.name(handle),
                    pci_bus_id=nvml.pci_bus_id(handle),
                    memory_total_mib=memory.total // _MIB,
                    numa_node=_optional(nvml.numa_node, handle),
                    mig=bool(_optional(nvml.mig_mode, handle)),
                    remote=_optional(nvml.nvlink_remote_bus_ids, handle) or [],
                )
            )
        except NvmlError as exc:
            raise _at(index, exc) from None
    by_bus = {record["pci_bus_id"].upper(): record["index"] for record in records}
    gpus = []
    for record in records:
        remote = record.pop("remote")
        peers = collections.Counter(by_bus[bus.upper()] for bus in remote if bus.upper() in by_bus)
        peers.pop(record["index"], None)
        gpus.append(GpuInfo(**record, nvlink=dict(sorted(peers.items()))))
    topology: list[list[int | None]] = [[None] * count for _ in range(count)]
    for i in range(count):
        topology[i][i] = TOPOLOGY_INTERNAL
        for j in range(i + 1, count):
            try:
                level = _optional(nvml.topology_level, handles[i], handles[j])
            except NvmlError as exc:
                raise _at(i, exc) from None
            topology[i][j] = topology[j][i] = level
    switches = _switch_groups(topology)
    gpus = [msgspec.structs.replace(info, pcie_switch=switches[info.index]) for info in gpus]
    mig_devices = []
    for info, handle in zip(gpus, handles):
        if info.mig:
            try:
                mig_devices += _read_mig_devices(nvml, info.index, info.gpu, handle)
            except NvmlError as exc:
                raise _at(info.index, exc) from None
    return NodeInventory(
        kind=nvml.kind,
        source=nvml.source,
        driver_version=driver,
        gpus=gpus,
        topology=topology,
        control_devices=nvml.control_devices(),
        mig_devices=mig_devices,
    )


def read_mig_devices(nvml: Nvml, index: int) -> list[MigDeviceInfo] | None:
    """The MIG devices of the GPU at ``index``; None when its MIG mode is off
    or unknown (blocking; a start-up check asks this without a whole inventory)."""
    try:
        handle = nvml.handle(index)
        if not _optional(nvml.mig_mode, handle):
            return None
        return _read_mig_devices(nvml, index, Gpu(NVIDIA_MAJOR, nvml.minor(handle)), handle)
    except NvmlError as exc:
        raise _at(index, exc) from None


def _read_mig_devices(nvml: Nvml, parent_index: int, parent: Gpu, handle) -> list[MigDeviceInfo]:
    """The MIG devices of one GPU with MIG mode on (blocking)."""
    devices = []
    for slot in range(nvml.max_mig_device_count(handle)):
        try:
            mig = nvml.mig_device_handle(handle, slot)
        except NvmlError as exc:
            if exc.code == NVML_ERROR_NOT_FOUND:
                continue  # an empty slot
            raise
        identity = MigDevice(parent, nvml.gpu_instance_id(mig), nvml.compute_instance_id(mig))
        devices.append(
            MigDeviceInfo(
                device=identity,
                parent_index=parent_index,
                index=slot,
                uuid=nvml.uuid(mig),
                profile=nvml.mig_profile(mig),
                memory_total_mib=nvml.memory(mig).total // _MIB,
            )
        )
    return devices


def _switch_groups(topology: list[list[int | None]]) -> list[int | None]:
    """Per index: the lowest index sharing its PCIe switch (level SINGLE or
    closer), None when it shares one with no other GPU."""
    count = len(topology)
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(count):
        for j in range(i + 1, count):
            level = topology[i][j]
            if level is not None and level <= TOPOLOGY_SINGLE:
                a, b = root(i), root(j)
                parent[max(a, b)] = min(a, b)
    groups = [root(i) for i in range(count)]
    sizes = collections.Counter(groups)
    return [group if sizes[group] > 1 else None for group in groups]


def _readings(nvml: Nvml, handle: object) -> dict[str, int | None]:
    """One device's usage fields (a GPU's or a MIG device's handle); None where NVML has none."""
    memory = _optional(nvml.memory, handle)
    rates = _optional(nvml.utilization, handle)
    return {
        "memory_used_bytes": memory.used if memory else None,
        "memory_total_bytes": memory.total if memory else None,
        "utilization_gpu_percent": rates.gpu if rates else None,
        "utilization_memory_percent": rates.memory if rates else None,
        "power_mw": _optional(nvml.power_mw, handle),
        "temperature_c": _optional(nvml.temperature_c, handle),
    }


def read_usage(nvml: Nvml, targets: list[tuple[int, Gpu]]) -> list[GpuUsage]:
    """Readings for ``(index, gpu)`` pairs in one blocking pass."""
    usages = []
    for index, gpu in targets:
        try:
            usages.append(GpuUsage(gpu=gpu, index=index, **_readings(nvml, nvml.handle(index))))
        except NvmlError as exc:
            raise _at(index, exc) from None
    return usages


def read_mig_usage(nvml: Nvml, targets: list[tuple[int, int, MigDevice]]) -> list[MigDeviceUsage]:
    """Readings for ``(parent index, MIG index, device)`` targets in one blocking pass."""
    usages = []
    for parent_index, index, device in targets:
        try:
            handle = nvml.mig_device_handle(nvml.handle(parent_index), index)
            usages.append(MigDeviceUsage(device=device, parent_index=parent_index, index=index,
                                         **_readings(nvml, handle)))
        except NvmlError as exc:
            raise _at(parent_index, exc) from None
    return usages
