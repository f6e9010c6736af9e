"""DraCatalog: the node's devices as the DRA driver publishes them.

Rules (SPEC section 21):
- Built from the allocator's pools and the inventory (``node_units``, as
  the device plugin's ``DeviceCatalog``): every unit of every pool is one device -- a
  whole GPU named ``gpu-<minor>``, a MIG device (strategies ``single`` and
  ``mixed``) ``mig-<parent minor>-<gi>-<ci>``. A node with no unit is a
  ``PluginSetupError``, as is a unit without a UUID.
- Attributes (``DeviceFacts.attributes``: name -> (type, value), type one
  of ``string``, ``int``, ``bool``, ``version`` as resource.k8s.io/v1's
  ``DeviceAttribute``): ``type`` (``gpu`` / ``mig``), ``uuid``,
  ``productName``, ``driverVersion`` (semver: NVIDIA's ``535.161.08`` is
  ``535.161.8``), ``pciBusID`` (``0000:06:00.0``, the parent's for a MIG
  device), ``minor``, ``numaNode`` and ``nvlinkIsland`` when known, and
  ``architecture`` / ``cudaComputeCapability`` (version ``major.minor.0``)
  where the product family names them (``product_family``: the inventory
  does not read NVML's compute capability). A MIG device adds ``profile``
  and ``parentUUID``. Strings are cut to the API's 64 characters.
- ``nvlinkIsland``: the GPUs joined by NVLink (directly or through other
  GPUs) form one island, numbered 0, 1, ... by their lowest index; a GPU
  without NVLink peers is an island of its own. A MIG device is on its
  parent's island. A ``matchAttribute: gpu.isolator.dev/nvlinkIsland``
  constraint keeps a claim's devices on one island.
- Capacity ``memory`` in MiB (``<n>Mi``). With ``sharing`` ``mps`` (SPEC
  R-MP-5) every unit that can hold two shares (``mps_replicas`` > 1: that
  many shares of a step or more) is ``shared``: published once, for shares
  only, with the consumable capacity of ``_sharing``.
- ``by_name`` / ``by_uuid`` / ``by_unit`` find devices; as a
  ``UnitCatalog``, ``uuids`` / ``unit_of_uuid`` find units and
  ``units_of`` names none (the kubelet's PodResources reports DRA devices
  by claim, not by device ID). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import msgspec

from actors.gpu import Gpu, GpuInfo
from actors.mig import MigDevice, Unit
from actors.nvml import NodeInventory

from .._catalog import UnitCatalog, node_units
from .._errors import PluginSetupError
from ._names import gpu_device_name, mig_device_name
from ._sharing import SHARING_MODES, shareable

__all__ = ["DraCatalog", "DeviceFacts", "nvlink_islands", "product_family", "semver"]

MAX_STRING = 64

# (pattern in the product name, architecture, compute capability): NVIDIA's published tables.
_FAMILIES = (
    (r"\bGB?200\b|\bB[12]00\b", "Blackwell", (10, 0)),
    (r"\bG?H(100|200|800|20)\b", "Hopper", (9, 0)),
    (r"\bL(4|40S?|20)\b|RTX [4-6]0{2,3} Ada|RTX 40\d0", "Ada Lovelace", (8, 9)),
    (r"\bA(100|30|800)\b", "Ampere", (8, 0)),
    (r"\bA(10|16|2|40)\b|RTX A\d{4}|RTX 30\d0", "Ampere", (8, 6)),
    (r"\bT4\b|RTX 20\d0|Quadro RTX", "Turing", (7, 5)),
    (r"\bV100", "Volta", (7, 0)),
    (r"\bP100\b", "Pascal", (6, 0)),
    (r"\bP(4|40|6)\b|GTX 10\d0", "Pascal", (6, 1)),
)


def product_family(name: str) -> tuple[str, tuple[int, int]] | None:
    """(architecture, compute capability) of a product name, None when unknown."""
    for pattern, architecture, capability in _FAMILIES:
        if re.search(pattern, name):
            return architecture, capability
    return None


def semver(version: str) -> str | None:
    """NVIDIA's ``535.161.08`` as semver ``535.161.8`` (None: not numeric)."""
    parts = version.strip().split(".")
    if not parts or not all(part.isdigit() for part in parts) or len(parts) > 3:
        return None
    numbers = [str(int(part)) for part in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


def nvlink_islands(gpus: Iterable[GpuInfo]) -> dict[int, int]:
    """GPU index -> its NVLink island (see module rules)."""
    infos = sorted(gpus, key=lambda info: info.index)
    parent = {info.index: info.index for info in infos}

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    for info in infos:
        for peer, links in info.nvlink.items():
            if links > 0 and peer in parent:
                first, second = sorted((root(info.index), root(peer)))
                parent[second] = first
    numbers: dict[int, int] = {}
    return {info.index: numbers.setdefault(root(info.index), len(numbers)) for info in infos}


def _pci(bus_id: str) -> str:
    """``00000000:06:00.0`` -> ``0000:06:00.0`` (the kernel's form, lower case)."""
    domain, _, rest = bus_id.lower().partition(":")
    return f"{domain[-4:]:0>4}:{rest}" if rest else bus_id.lower()


Attribute = tuple[str, "str | int | bool"]


class DeviceFacts(msgspec.Struct, frozen=True, kw_only=True):
    """One published device: its name, unit, UUID, attributes and memory."""

    name: str
    unit: Gpu | MigDevice
    uuid: str
    attributes: dict[str, tuple[str, str | int | bool]]
    memory_mib: int
    shared: bool = False
    """Published for MPS shares (``allowMultipleAllocations``, consumable capacity), never whole."""


class DraCatalog(UnitCatalog):
    """Every device the driver publishes (see module rules)."""

    def __init__(self, devices: Iterable[DeviceFacts], sharing: str = "none", mps_replicas: int = 1) -> None:
        self.devices = tuple(devices)
        self.sharing = sharing
        """``--sharing``: ``none`` or ``mps``."""
        self.mps_replicas = mps_replicas
        """``--mps_replicas``: equal shares per shareable unit (1: any size)."""
        self.by_name = {device.name: device for device in self.devices}
        self.by_uuid = {device.uuid: device for device in self.devices}
        self.by_unit = {device.unit: device for device in self.devices}
        self.units = tuple(self.by_unit)
        self.uuids = {device.unit: device.uuid for device in self.devices}
        self._by_uuid = {device.uuid: device.unit for device in self.devices}

    @classmethod
    def build(cls, pools: Mapping[str, Iterable[Unit]], inventory: NodeInventory,
              sharing: str = "none", mps_replicas: int = 1) -> "DraCatalog":
        if sharing not in SHARING_MODES:
            raise PluginSetupError(f"Unknown --sharing {sharing!r}: expected one of {', '.join(SHARING_MODES)}")
        islands = nvlink_islands(inventory.gpus)
        driver = semver(inventory.driver_version)
        devices = []
        units = sorted((unit for pool in node_units(pools, inventory, "DRA").values() for unit in pool),
                       key=lambda unit: unit.unit)
        for unit in units:
            info = unit.gpu
            if unit.mig is not None:
                mig = unit.mig
                name = mig_device_name(mig.device.parent.minor, mig.device.gi, mig.device.ci)
                memory = mig.memory_total_mib
                extra = {"type": ("string", "mig"), "profile": ("string", mig.profile),
                         "parentUUID": ("string", info.uuid)}
            else:
                name = gpu_device_name(info.gpu.minor)
                memory = info.memory_total_mib
                extra = {"type": ("string", "gpu")}
            attributes: dict[str, tuple[str, str | int | bool]] = {
                **extra, "uuid": ("string", unit.uuid), "productName": ("string", info.name[:MAX_STRING]),
                "pciBusID": ("string", _pci(info.pci_bus_id)), "minor": ("int", info.minor),
                "nvlinkIsland": ("int", islands[info.index]),
            }
            if driver is not None:
                attributes["driverVersion"] = ("version", driver)
            if info.numa_node is not None:
                attributes["numaNode"] = ("int", info.numa_node)
            family = product_family(info.name)
            if family is not None:
                architecture, (major, minor) = family
                attributes["architecture"] = ("string", architecture)
                attributes["cudaComputeCapability"] = ("version", f"{major}.{minor}.0")
            devices.append(DeviceFacts(name=name, unit=unit.unit, uuid=unit.uuid, attributes=attributes,
                                       memory_mib=memory,
                                       shared=sharing == "mps" and shareable(memory, mps_replicas)))
        if not devices:
            raise PluginSetupError(
                f"The node ({inventory.source}) has nothing to publish: no GPU and no MIG device is managed"
                " (check --resources, --nvidia_gpu_devices and --nvidia_mig_strategy)")
        return cls(devices, sharing, mps_replicas)

    def units_of(self, resource: str, ids: Iterable[str]) -> list[Unit] | None:
        """None: the kubelet names no device-plugin resource of a DRA driver (see module rules)."""
        return None
