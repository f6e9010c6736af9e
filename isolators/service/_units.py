"""What a service's node hands out: whole GPUs and MIG devices, counted and shown.

Rules (SPEC R-SV-1/2 with R-MG-3):
- ``NodeUnits`` is built once from the allocator's pools (resource name ->
  units), the inventory and ``--nvidia_mig_strategy``. ``whole`` are the
  whole GPUs handed out as ``gpus``; ``mig_pool`` every MIG device handed
  out, with the resource it counts under (``gpus`` under ``single``,
  ``mig-<profile>`` under ``mixed``); ``mig_mode`` the whole GPUs in MIG
  mode (handed out whole under ``none``).
- ``refusal(demand)``: why a request cannot ever be met on this node, or
  None. MIG devices by profile under another strategy than ``mixed``: the
  isolator's own text (with what to ask instead); more units of a resource
  than the node has: "Requested N gpus but the node has only M" (Mesos'
  form) and, on a MIG node, what to ask for instead -- the MIG profiles it
  offers, or that each MIG device is one of ``gpus`` under ``single``.
- ``free(available)``: free units per resource. ``granted(units)``: what
  ``isolator.containers()`` lists for a container (minors; MIG devices as
  ``195:0/gi3/ci0``) as ``GrantedGpu``s with UUIDs and NVIDIA's indices.
  ``mig_views(holders, unhealthy)``: every MIG device as the state shows it.
- Pure once built: no I/O, no actor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from actors import Gpu
from actors.mig import MigDevice, profile_of_resource, unit_sort_key

from ._demand import GPUS
from ._messages import GrantedGpu, MigDeviceView

__all__ = ["NodeUnits"]


def _minors(minors: Iterable[int]) -> str:
    return ", ".join(str(minor) for minor in minors)


class NodeUnits:
    """The units a service hands out (see module rules)."""

    def __init__(self, pools: Mapping[str, Iterable[Any]], inventory: Any, strategy: str) -> None:
        self.pools = {name: frozenset(units) for name, units in pools.items()}
        self.strategy = strategy
        self._gpu_infos = {info.gpu.minor: info for info in inventory.gpus}
        self._mig_infos = inventory.by_mig()
        self.whole = {unit for unit in self.pools.get(GPUS, ()) if isinstance(unit, Gpu)}
        self.mig_pool = {unit: name for name, units in self.pools.items() for unit in units
                         if isinstance(unit, MigDevice)}
        self.mig_mode = sorted(gpu.minor for gpu in self.whole
                               if (info := self._gpu_infos.get(gpu.minor)) is not None and info.mig)

    # -- requests ---------------------------------------------------------------------------
    def refusal(self, demand: Mapping[str, int]) -> str | None:
        """Why ``demand`` can never be met here; None when it can (see module rules)."""
        for name, count in demand.items():
            if name != GPUS and self.strategy != "mixed":
                return (f"The '{name}' resource is a MIG device resource: it is offered only with"
                        f" '--nvidia_mig_strategy=mixed' (this node runs '{self.strategy}'){self._instead()}")
            total = len(self.pools.get(name, ()))
            if count > total:
                return self._beyond(name, count, total)
        return None

    def offer(self) -> str:
        """The MIG profiles handed out by profile, with how many the node has of each."""
        return ", ".join(f"{profile_of_resource(name)} ({len(units)})" for name, units in sorted(self.pools.items())
                         if name != GPUS)

    def _instead(self) -> str:
        if self.strategy == "single" and self.mig_pool:
            return "; here each MIG device is one of 'gpus': ask for N of them with --gpus N"
        if self.mig_mode:
            return f"; here GPU(s) {_minors(self.mig_mode)} in MIG mode are handed out whole"
        return ""

    def _beyond(self, name: str, count: int, total: int) -> str:
        text = f"Requested {count} {name} but the node has only {total}"
        if name != GPUS:
            return f"{text} (its MIG devices by profile: {self.offer() or 'none'}; ask with --mig PROFILE[:N])"
        if self.strategy == "single" and self.mig_pool:
            return f"{text} (MIG devices: each is one of 'gpus' under --nvidia_mig_strategy=single)"
        if self.strategy == "mixed" and self.mig_pool:
            parents = sorted({device.parent.minor for device in self.mig_pool})
            return (f"{text} whole GPU(s) without MIG; GPU(s) {_minors(parents)} are in MIG mode: ask for their MIG"
                    f" devices by profile with --mig PROFILE[:N] (the node has {self.offer()})")
        return text

    def free(self, available: set[Any]) -> dict[str, int]:
        return {name: len(available & units) for name, units in self.pools.items()}

    # -- what is shown ------------------------------------------------------------------------
    def granted(self, units: Iterable[int | str]) -> list[GrantedGpu]:
        result = []
        for unit in units:
            if isinstance(unit, int):
                info = self._gpu_infos.get(unit)
                result.append(GrantedGpu(minor=unit, uuid=info.uuid if info else None,
                                         index=info.index if info else None, mig_mode=bool(info and info.mig)))
                continue
            device = MigDevice.parse(unit)
            mig = self._mig_infos.get(device)
            result.append(GrantedGpu(minor=device.parent.minor, uuid=mig.uuid if mig else None,
                                     index=mig.parent_index if mig else None, mig_device=str(device),
                                     mig_index=mig.index if mig else None, profile=mig.profile if mig else None))
        return result

    def uuid(self, unit: int | str) -> str | None:
        info = self._gpu_infos.get(unit) if isinstance(unit, int) else self._mig_infos.get(MigDevice.parse(unit))
        return info.uuid if info is not None else None

    def mig_views(self, holders: Mapping[str, str], unhealthy: Mapping[Any, str]) -> list[MigDeviceView]:
        """Every MIG device handed out; ``holders``: identity -> container."""
        views = []
        for device in sorted(self.mig_pool, key=unit_sort_key):
            info = self._mig_infos.get(device)
            views.append(MigDeviceView(
                device=str(device), name=f"{info.parent_index}:{info.index}" if info else str(device),
                gpu=device.parent.minor, profile=info.profile if info else "", uuid=info.uuid if info else None,
                resource=self.mig_pool[device], container=holders.get(str(device)), unhealthy=unhealthy.get(device)))
        return views
