"""The node's units as Kubernetes sees them: every GPU and MIG device a front door offers, by UUID.

Rules (R-K8-2, R-K8-6; SPEC section 21):
- ``node_units(pools, inventory, who)``: the units of the allocator's
  pools, pool by pool (``gpus`` first, then the others by name; units in
  their order within a pool), each a ``NodeUnit``: the unit, its UUID
  (``GPU-…``, or ``MIG-…``), the GPU's inventory facts (a MIG device's
  parent's), the MIG device's facts (None for a whole GPU) and its NUMA
  node (a MIG device's is its parent's; None when NVML does not tell).
  A unit without a UUID is a ``PluginSetupError`` naming it and ``who``
  needs one (every front door hands devices out by UUID). Empty pools
  are left out.
- ``UnitCatalog`` is what every front door's catalog is (the device
  plugin's ``DeviceCatalog``, the DRA driver's ``DraCatalog``): ``units``
  (in order), ``uuids`` (unit -> UUID), ``unit_of_uuid`` (the operator's
  route: None when not offered here) and ``units_of(resource, ids)``, the
  units that a list of the kubelet's device IDs of one resource names
  (what PodResources reports: pod repair's join): None when the resource
  is none of this front door's, ``PluginRequestError`` (INVALID_ARGUMENT)
  naming IDs it never offered.
- Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from actors.gpu import Gpu, GpuInfo
from actors.mig import MigDevice, MigDeviceInfo, Unit
from actors.nvml import NodeInventory

from ._errors import PluginSetupError

__all__ = ["NodeUnit", "UnitCatalog", "node_units"]


class NodeUnit(msgspec.Struct, frozen=True, kw_only=True):
    """One unit of the node with what Kubernetes is told of it (see module rules)."""

    unit: Gpu | MigDevice
    uuid: str
    gpu: GpuInfo
    """The GPU's inventory facts; a MIG device's parent's."""
    mig: MigDeviceInfo | None = None
    numa_node: int | None = None


def node_units(pools: Mapping[str, Iterable[Unit]], inventory: NodeInventory,
               who: str = "the kubelet") -> dict[str, list[NodeUnit]]:
    """Pool -> its units with their facts (see module rules)."""
    gpus = inventory.by_gpu()
    migs = inventory.by_mig()
    by_index = {info.index: info for info in inventory.gpus}
    found: dict[str, list[NodeUnit]] = {}
    for pool in sorted(pools, key=lambda name: (name != "gpus", name)):
        units = []
        for unit in sorted(pools[pool]):
            if isinstance(unit, MigDevice):
                mig = migs.get(unit)
                info = by_index.get(mig.parent_index) if mig is not None else None
                uuid = mig.uuid if mig is not None and info is not None else ""
            else:
                mig, info = None, gpus.get(unit)
                uuid = info.uuid if info is not None else ""
            if not uuid or info is None:
                raise PluginSetupError(f"Unit {unit} has no UUID in the inventory: {who} needs one each")
            units.append(NodeUnit(unit=unit, uuid=uuid, gpu=info, mig=mig, numa_node=info.numa_node))
        if units:
            found[pool] = units
    return found


class UnitCatalog:
    """The units a front door offers, by UUID (see module rules)."""

    def __init__(self, units: Iterable[NodeUnit]) -> None:
        units = tuple(units)
        self.units: tuple[Unit, ...] = tuple(dict.fromkeys(unit.unit for unit in units))
        self.uuids: dict[Unit, str] = {unit.unit: unit.uuid for unit in units}
        self._by_uuid: dict[str, Unit] = {unit.uuid: unit.unit for unit in units}

    def unit_of_uuid(self, uuid: str) -> Unit | None:
        """The unit with this GPU or MIG UUID (None: not offered here)."""
        return self._by_uuid.get(uuid)

    def units_of(self, resource: str, ids: Iterable[str]) -> list[Unit] | None:
        """The units ``ids`` of ``resource`` name, in order (see module rules)."""
        raise NotImplementedError
