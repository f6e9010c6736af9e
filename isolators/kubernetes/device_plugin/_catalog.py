"""DeviceCatalog: what the plugin offers the kubelet, resource by resource.

Rules (R-K8-2, R-K8-6, R-K8-7):
- Built from the allocator's pools and the node's inventory
  (``node_units``, shared with the DRA driver): the pool
  ``gpus`` is the resource ``nvidia.com/gpu`` (whole GPUs; under the MIG
  strategy ``single``, every MIG device), each pool ``mig-<profile>`` the
  resource ``nvidia.com/mig-<profile>`` (``mixed``). An empty pool offers
  nothing; a node that offers nothing at all is a ``PluginSetupError``.
- A unit is offered as its UUID (``GPU-…``, or ``MIG-…``); with
  ``replicas`` N > 1 (time-slicing) as N IDs ``<UUID>::<i>``, i = 0..N-1,
  each unit's IDs together, units in their order. An ID longer than 63
  characters, or a unit without a UUID, is a ``PluginSetupError``.
- MPS sharing (SPEC R-MP-4, ``mps_replicas`` N > 1): every unit is
  offered as N IDs ``<UUID>::<i>`` as with time-slicing, each carrying its
  share (``MpsShare``): 1/N of the unit's memory in bytes (rounded down to
  whole MiB) and 100/N % of its threads (rounded down). MPS and
  time-slicing of one resource exclude each other: both above 1 is a
  ``PluginSetupError`` (``check_sharing``, the command's usage error).
- Each ID carries its unit's NUMA node (a MIG device's is its parent's),
  None when NVML does not tell.
- ``ResourceOffer.resolve(ids)`` maps IDs to their units, in order, and
  refuses (``PluginRequestError``, ``INVALID_ARGUMENT``) IDs this resource
  does not offer or names twice, naming each; ``listing(unhealthy)`` is
  every ID with its health and NUMA node.
- ``DeviceCatalog`` is a ``UnitCatalog``: ``unit_of_uuid`` finds a unit of
  any resource by its UUID (the operator's route), ``units_of`` the units
  of a resource's IDs (pod repair). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from actors.gpu import Gpu
from actors.mig import MIG_RESOURCE_PREFIX, MigDevice, Unit
from actors.nvml import NodeInventory

from .._catalog import UnitCatalog, node_units
from .._errors import INVALID_ARGUMENT, PluginRequestError, PluginSetupError
from ._names import MAX_ID_LENGTH, socket_name

__all__ = ["DeviceCatalog", "ResourceOffer", "OfferedDevice", "MpsShare", "resource_of_pool", "check_sharing",
           "REPLICA_SEPARATOR"]

VENDOR = "nvidia.com"
REPLICA_SEPARATOR = "::"


def resource_of_pool(pool: str) -> str:
    """``gpus`` -> ``nvidia.com/gpu``; ``mig-1g.18gb`` -> ``nvidia.com/mig-1g.18gb``."""
    if pool == "gpus":
        return f"{VENDOR}/gpu"
    if pool.startswith(MIG_RESOURCE_PREFIX):
        return f"{VENDOR}/{pool}"
    raise PluginSetupError(f"The allocator's pool {pool!r} is no resource this plugin offers")


class MpsShare(msgspec.Struct, frozen=True, kw_only=True):
    """One MPS share of a unit (``--mps_replicas``): which of how many, and its limits."""

    index: int
    replicas: int
    memory_bytes: int
    thread_percent: int


class OfferedDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device ID as the kubelet sees it."""

    id: str
    unit: Gpu | MigDevice
    uuid: str
    numa_node: int | None = None
    share: MpsShare | None = None
    """Its MPS share (``--mps_replicas``), None when the ID is the unit or a time-slicing replica."""


def check_sharing(time_slicing_replicas: object, mps_replicas: object) -> str | None:
    """Why these replica counts cannot be served together (None: they can); see module rules."""
    for value in (time_slicing_replicas, mps_replicas):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"replica counts are whole numbers, got {value!r}"
    if time_slicing_replicas < 1:
        return f"--time_slicing_replicas must be a whole number >= 1, got {time_slicing_replicas}"
    if mps_replicas < 1:
        return f"--mps_replicas must be a whole number >= 2 (1, the default, shares nothing), got {mps_replicas}"
    if mps_replicas > 1 and time_slicing_replicas > 1:
        return (f"--mps_replicas {mps_replicas} and --time_slicing_replicas {time_slicing_replicas} both share every"
                " GPU of nvidia.com/gpu; a resource is shared one way: keep --mps_replicas (each share limited to"
                " its memory and threads) or --time_slicing_replicas (no limits), not both")
    return None


class ResourceOffer:
    """The devices of one resource (see module rules)."""

    def __init__(self, resource: str, pool: str, devices: Iterable[OfferedDevice]) -> None:
        self.resource = resource
        self.pool = pool
        self.devices = tuple(devices)
        self.by_id = {device.id: device for device in self.devices}
        self.order = {device.id: position for position, device in enumerate(self.devices)}
        """ID -> its place in the listing."""
        self.socket_name = socket_name(resource)
        self.units = tuple(dict.fromkeys(device.unit for device in self.devices))

    def resolve(self, ids: Iterable[str], what: str = "device IDs") -> list[OfferedDevice]:
        """The offered devices for ``ids`` (in order); unknown or repeated IDs refused."""
        ids = list(ids)
        unknown = [i for i in ids if i not in self.by_id]
        if unknown:
            raise PluginRequestError(
                INVALID_ARGUMENT,
                f"Unknown {what} for {self.resource}: {_quoted(unknown)}; this plugin offers"
                f" {len(self.devices)} IDs for it ({self._examples()}), as its ListAndWatch lists them",
            )
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise PluginRequestError(INVALID_ARGUMENT, f"{what.capitalize()} for {self.resource} named more than"
                                                       f" once: {_quoted(repeated)}")
        return [self.by_id[i] for i in ids]

    def listing(self, unhealthy: Mapping[Unit, str]) -> list[tuple[str, bool, int | None]]:
        """(ID, healthy, NUMA node) of every device, in order."""
        return [(device.id, device.unit not in unhealthy, device.numa_node) for device in self.devices]

    def _examples(self) -> str:
        shown = ", ".join(repr(device.id) for device in self.devices[:2])
        return shown + (", ..." if len(self.devices) > 2 else "")

    def __repr__(self) -> str:
        return f"ResourceOffer({self.resource!r}, {len(self.devices)} devices)"


class DeviceCatalog(UnitCatalog):
    """Every resource the plugin offers (see module rules)."""

    def __init__(self, offers: Iterable[ResourceOffer], replicas: int, mps_replicas: int = 1) -> None:
        self.offers = tuple(offers)
        self.replicas = replicas
        self.mps_replicas = mps_replicas
        self.by_resource = {offer.resource: offer for offer in self.offers}
        self.units = tuple(dict.fromkeys(device.unit for offer in self.offers for device in offer.devices))
        self.uuids = {device.unit: device.uuid for offer in self.offers for device in offer.devices}
        self._by_uuid = {device.uuid: device.unit for offer in self.offers for device in offer.devices}

    @classmethod
    def build(cls, pools: Mapping[str, Iterable[Unit]], inventory: NodeInventory, replicas: int = 1,
              mps_replicas: int = 1) -> "DeviceCatalog":
        """The offers of ``pools`` on the node ``inventory`` describes."""
        refused = check_sharing(replicas, mps_replicas)
        if refused is not None:
            raise PluginSetupError(refused)
        copies = max(replicas, mps_replicas)
        offers = []
        for pool, units in node_units(pools, inventory, "the kubelet").items():
            devices = []
            for unit in units:
                ids = [unit.uuid] if copies == 1 else [f"{unit.uuid}{REPLICA_SEPARATOR}{i}" for i in range(copies)]
                memory_mib = unit.mig.memory_total_mib if unit.mig is not None else unit.gpu.memory_total_mib
                for index, device_id in enumerate(ids):
                    if len(device_id) > MAX_ID_LENGTH:
                        raise PluginSetupError(
                            f"Device ID {device_id!r} is {len(device_id)} characters long; the kubelet takes at most"
                            f" {MAX_ID_LENGTH} (fewer --time_slicing_replicas or --mps_replicas, or units with"
                            " shorter UUIDs)"
                        )
                    share = MpsShare(index=index, replicas=mps_replicas, memory_bytes=(memory_mib // mps_replicas) << 20,
                                     thread_percent=100 // mps_replicas) if mps_replicas > 1 else None
                    devices.append(OfferedDevice(id=device_id, unit=unit.unit, uuid=unit.uuid,
                                                 numa_node=unit.numa_node, share=share))
            offers.append(ResourceOffer(resource_of_pool(pool), pool, devices))
        if not offers:
            raise PluginSetupError(
                f"The node ({inventory.source}) offers nothing to the kubelet: no GPU and no MIG device is managed"
                " (check --resources, --nvidia_gpu_devices and --nvidia_mig_strategy)"
            )
        return cls(offers, replicas, mps_replicas)

    def units_of(self, resource: str, ids: Iterable[str]) -> list[Unit] | None:
        """The units of ``resource``'s device IDs, in order (None: not a resource of this plugin)."""
        offer = self.by_resource.get(resource)
        if offer is None:
            return None
        return [device.unit for device in offer.resolve(ids)]


def _quoted(ids: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in ids)
