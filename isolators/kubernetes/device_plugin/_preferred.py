"""Preferred allocation: which of the kubelet's available IDs to suggest (R-K8-3, R-K8-7).

Rules:
- ``plan_preferred(offer, available, must_include, size)`` checks one
  container request: every ID must be one the resource offers (else
  ``INVALID_ARGUMENT`` naming them), the must-include IDs must be among
  the available ones, and ``len(must_include) <= size <= len(available)``
  with ``size >= 1`` (else ``INVALID_ARGUMENT`` saying which bound).
- It then asks for units, not IDs: the units of the must-include IDs are
  included; as many other units as the request still needs (at most one
  ID each) are chosen among the units with an available ID left. So a
  request spreads over distinct GPUs first. The choice itself is the
  allocator's (``NvidiaGpuAllocator.preferred``: topology-aware, the same
  choice ``prepare`` makes among those GPUs).
- ``PreferredPlan.finish(chosen)`` turns the chosen units back into IDs:
  the must-include IDs, the lowest available replica of each newly chosen
  unit, and, when the request wants more IDs than there are units, further
  replicas one per unit per round (units in their order). The answer is
  in the offer's ID order. Pure: no I/O.
- MPS shares (``--mps_replicas``): a container gets one share of a unit
  (``Allocate`` refuses two), so a request for more IDs than the distinct
  units of its available IDs, or whose must-include IDs name two shares of
  one unit, is refused (``INVALID_ARGUMENT``) naming the counts or the
  IDs: the kubelet learns at once that the request cannot be met.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from actors.mig import Unit

from ._catalog import ResourceOffer
from .._errors import INVALID_ARGUMENT, PluginRequestError

__all__ = ["PreferredPlan", "plan_preferred"]


class PreferredPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One checked request: what to ask the allocator, and how to answer."""

    candidates: frozenset[Unit]
    include: frozenset[Unit]
    count: int
    """How many units the allocator chooses (``include`` among them)."""
    size: int
    must_include: tuple[str, ...]
    free: dict[Unit, tuple[str, ...]]
    """Per unit, its available IDs that are not must-include, lowest replica first."""
    order: dict[str, int]

    def finish(self, chosen: Iterable[Unit]) -> list[str]:
        """The IDs to suggest for the allocator's ``chosen`` units (see module rules)."""
        chosen = sorted(chosen)
        picked = list(self.must_include)
        left = {unit: list(ids) for unit, ids in self.free.items()}
        for unit in chosen:
            if unit not in self.include and left.get(unit):
                picked.append(left[unit].pop(0))
        rounds = [unit for unit in chosen] + [unit for unit in sorted(left) if unit not in chosen]
        while len(picked) < self.size:
            progressed = False
            for unit in rounds:
                if len(picked) == self.size:
                    break
                if left.get(unit):
                    picked.append(left[unit].pop(0))
                    progressed = True
            if not progressed:  # cannot happen: size <= available was checked
                break
        return sorted(picked, key=self.order.__getitem__)


def plan_preferred(offer: ResourceOffer, available: Iterable[str], must_include: Iterable[str],
                   size: int) -> PreferredPlan:
    """Check one preferred-allocation request (see module rules)."""
    available = list(available)
    must = list(must_include)
    offered = offer.resolve(available, "available device IDs")
    offer.resolve(must, "must-include device IDs")
    outside = [i for i in must if i not in set(available)]
    if outside:
        raise PluginRequestError(INVALID_ARGUMENT, f"Must-include device IDs for {offer.resource} that are not"
                                                   f" available: {', '.join(repr(i) for i in outside)}")
    if not (max(1, len(must)) <= size <= len(available)):
        raise PluginRequestError(
            INVALID_ARGUMENT,
            f"allocation_size {size} for {offer.resource} cannot be met: it must be at least"
            f" {max(1, len(must))} (1, and the {len(must)} must-include IDs) and at most the {len(available)}"
            " available IDs",
        )
    if any(device.share is not None for device in offered):
        units = {device.unit for device in offered}
        doubled = [i for i in must if sum(offer.by_id[j].unit == offer.by_id[i].unit for j in must) > 1]
        if doubled:
            raise PluginRequestError(INVALID_ARGUMENT, f"Must-include device IDs for {offer.resource} name more than"
                                                       f" one MPS share of one GPU: {', '.join(repr(i) for i in doubled)};"
                                                       " a container gets one share of a GPU (--mps_replicas)")
        if size > len(units):
            raise PluginRequestError(
                INVALID_ARGUMENT,
                f"allocation_size {size} for {offer.resource} cannot be met with MPS shares: a container gets one"
                f" share of a GPU (--mps_replicas) and the {len(available)} available IDs are shares of"
                f" {len(units)} GPUs",
            )
    must_set = set(must)
    include = frozenset(offer.by_id[i].unit for i in must)
    free: dict[Unit, list[str]] = {}
    for device in sorted(offered, key=lambda d: _position(offer, d.id)):
        if device.id not in must_set:
            free.setdefault(device.unit, []).append(device.id)
    others = [unit for unit in free if unit not in include]
    extra = min(size - len(must), len(others))
    return PreferredPlan(
        candidates=frozenset(include | set(others)),
        include=include,
        count=len(include) + extra,
        size=size,
        must_include=tuple(must),
        free={unit: tuple(ids) for unit, ids in free.items()},
        order={device.id: _position(offer, device.id) for device in offered},
    )


def _position(offer: ResourceOffer, device_id: str) -> int:
    return offer.order[device_id]
