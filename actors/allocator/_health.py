"""AllocatorHealth: which units the allocator withholds as unhealthy, and who hears of it.

Rules (part of ``GpuAllocatorProcess``, which mixes this in; ``_process``
holds the state it reads: ``total``, ``unhealthy``, the watchers and
waiters, the units of each GPU):
- Health (R-AL-3, R-HE-3/4): ``mark_unhealthy`` withholds a unit from
  allocation (one already allocated stays with its holder until
  deallocated, then stays out of the pool); ``mark_healthy`` (the
  operator's call) brings it back. ``watch(units)`` is a Future that
  completes with a ``GpuHealth`` when any of them turns unhealthy.
  ``health_event(event)`` is an NVML event handed over by the health
  monitor: an Xid in ``ignored_xids`` is logged and changes nothing; any
  other Xid, or a double-bit ECC error, marks the units of that GPU
  unhealthy (the whole GPU, or its MIG devices -- only those of the event's
  GPU instance when it names one) with the reason ``Xid 79`` /
  ``double-bit ECC error``; an event on a GPU this allocator does not
  manage is logged. ``health_unknown(reason)`` marks every managed unit
  unhealthy (NVML events failed: the node's health is unknown).
  ``unwatched`` lists units whose health nobody watches.
- Health generations (the kubelet plugin's ``ListAndWatch``): every call
  that changes which units are unhealthy (or why) adds one to
  ``health_generation``, once per call however many units it changed.
  ``health_since(generation)`` is a Future of a ``HealthSnapshot``
  (generation and the unhealthy units with their reasons): ready at once
  when ``generation`` is None or not the current one, else when the next
  change comes (discarding it stops waiting). Recovery (``mark_healthy``)
  is a change like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from runtime import Future, Promise

from actors.gpu import Gpu
from actors.mig import MigDevice, Unit
from actors.nvml import HealthEvent

from ._errors import AllocatorError, unit_set

__all__ = ["AllocatorHealth", "GpuHealth", "HealthSnapshot"]

logger = logging.getLogger(__name__)


class GpuHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU's health changed (``healthy=False``: withheld from allocation)."""

    gpu: Gpu
    healthy: bool
    reason: str = ""


class HealthSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Which units are unhealthy, as of one health generation."""

    generation: int
    unhealthy: dict[Unit, str]
    """Unit -> reason (``Xid 79``, ``marked unhealthy by the operator``, ...)."""


class AllocatorHealth:
    """The allocator's health calls (see module rules); state lives on the process."""

    unhealthy: dict[Unit, str]
    total: frozenset[Unit]
    health_generation: int
    ignored_xids: frozenset[int]
    ledger_link: Any
    _watchers: list[tuple[frozenset[Unit], Promise]]
    _health_waiters: list[Promise]
    _health_dirty: bool
    _by_index: dict[int, Gpu]
    _units_of: dict[Gpu, list[Unit]]

    def mark_unhealthy(self, gpu: Gpu, reason: str = "marked unhealthy by the operator") -> GpuHealth:
        self._check_managed(gpu)
        change = self._withhold(gpu, reason)
        self._health_changed()
        return change

    def _withhold(self, gpu: Unit, reason: str) -> GpuHealth:
        """Mark one unit unhealthy and resolve its watchers (health waiters
        are told by ``_health_changed``, once per call)."""
        change = GpuHealth(gpu=gpu, healthy=False, reason=reason)
        if gpu not in self.unhealthy:
            logger.warning("GPU %s is unhealthy: %s; it is withheld from allocation", gpu, reason)
        if self.unhealthy.get(gpu) != reason:
            self.unhealthy[gpu] = reason
            self._health_dirty = True
        keep = []
        for gpus, promise in self._watchers:
            if gpu in gpus:
                promise.set_value(change)
            else:
                keep.append((gpus, promise))
        self._watchers = keep
        return change

    def mark_healthy(self, gpu: Gpu) -> GpuHealth:
        self._check_managed(gpu)
        if self.unhealthy.pop(gpu, None) is not None:
            logger.info("GPU %s is healthy again", gpu)
            self._health_dirty = True
        self._health_changed()
        return GpuHealth(gpu=gpu, healthy=True)

    def _health_changed(self) -> None:
        """One new generation if this call changed the unhealthy set; its waiters get the snapshot."""
        if not self._health_dirty:
            return
        self._health_dirty = False
        self.health_generation += 1
        if self.ledger_link is not None:
            self.ledger_link.report_health(self.unhealthy)
        waiters, self._health_waiters = self._health_waiters, []
        if waiters:
            snapshot = self._health_snapshot()
            for promise in waiters:
                promise.set_value(snapshot)

    def _health_snapshot(self) -> HealthSnapshot:
        return HealthSnapshot(generation=self.health_generation, unhealthy=dict(self.unhealthy))

    def health_since(self, generation: int | None) -> Future:
        """A ``HealthSnapshot`` once the generation differs from ``generation`` (see module rules)."""
        if generation is None or generation != self.health_generation:
            return Future.ready(self._health_snapshot())
        promise: Promise = Promise()
        return _queued(lambda: self._health_waiters, promise, promise)

    def watch(self, gpus: Iterable[Gpu]) -> Future:
        watched = unit_set(gpus)
        for gpu in sorted(watched):
            if gpu in self.unhealthy:
                return Future.ready(GpuHealth(gpu=gpu, healthy=False, reason=self.unhealthy[gpu]))
        promise: Promise = Promise()
        return _queued(lambda: self._watchers, (frozenset(watched), promise), promise)

    def health_event(self, event: HealthEvent) -> list[GpuHealth]:
        """An NVML health event (from the health monitor); the changes it made."""
        gpu = self._by_index.get(event.index)
        units = self._units_of.get(gpu, []) if gpu is not None else []
        if event.gpu_instance is not None:
            units = [u for u in units if not isinstance(u, MigDevice) or u.gi == event.gpu_instance]
        where = f"GPU {gpu}" if gpu is not None else f"GPU index {event.index}"
        if event.gpu_instance is not None:
            where += f" (GPU instance {event.gpu_instance})"
        if not units:
            logger.info("NVML reported %s on %s, which this allocator does not manage", event.describe(), where)
            return []
        if event.kind == "xid" and event.code in self.ignored_xids:
            logger.info("%s reported %s (caused by an application; kept)", where, event.describe())
            return []
        changes = [self._withhold(unit, event.describe()) for unit in units]
        self._health_changed()
        return changes

    def health_unknown(self, reason: str) -> list[GpuHealth]:
        """NVML cannot tell any GPU's health: withhold every managed unit."""
        logger.error("The health of this node's GPUs is unknown (%s): every GPU is withheld until"
                     " mark_healthy", reason)
        changes = [self._withhold(unit, reason) for unit in sorted(self.total)]
        self._health_changed()
        return changes

    def _check_managed(self, gpu: Unit) -> None:
        if not isinstance(gpu, (Gpu, MigDevice)):
            raise AllocatorError(f"Expected a Gpu or a MigDevice, got {gpu!r}")
        if gpu not in self.total:
            raise AllocatorError(f"GPU {gpu} is not managed by this allocator")


def _queued(waiting: Callable[[], list[Any]], entry: Any, promise: Promise) -> Future:
    """``promise``'s Future, with ``entry`` queued on the list ``waiting()``
    gives until it is answered; discarding the Future takes ``entry`` off the
    list ``waiting()`` gives then (the process replaces its lists when it
    answers them)."""
    waiting().append(entry)

    def _discarded() -> None:
        current = waiting()
        if entry in current:
            current.remove(entry)
        promise.discard()

    promise.on_discard(_discarded)
    return promise.future
