"""Health watches (R-IS-9, beyond Mesos): a container learns that a unit it holds
turned unhealthy.

Rules:
- ``watch(id)`` on the isolator returns a Future of a ``ContainerLimitation``
  (reason ``REASON_GPU_UNHEALTHY``, a message naming the GPU -- or the MIG
  device, whose resource the limitation then names -- and the allocator's
  reason), queued behind the container's earlier calls; nested ids -> "Not
  supported for nested containers"; unknown ids -> "Unknown container".
- ``HealthWatches`` keeps, per container, the Promises handed out and the
  allocator's watch of the units it holds NOW: ``rearm(id, units)`` at
  every change of them; the allocator's watch is dropped when nobody
  watches. An event for units since released is stale and ignored.
- A caller that discards its Future stops watching; ``forget(id)`` (at
  cleanup) discards every watch of the container.
- A part the isolator actor owns: its continuations run on the actor
  (``defer`` to its pid, bound at initialize).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from actors.mig import MigDevice, Unit
from actors.resources import Resources
from runtime import PID, Future, Promise, defer

from ._types import ContainerID, ContainerLimitation

__all__ = ["HealthWatches"]

logger = logging.getLogger(__name__)


class _Watch:
    """One container's watchers and the allocator's watch of its units."""

    __slots__ = ("watchers", "health", "units")

    def __init__(self) -> None:
        self.watchers: list[Promise] = []
        self.health: Future | None = None
        self.units: frozenset[Unit] = frozenset()


class HealthWatches:
    """Who watches which container's units (see the module rules)."""

    def __init__(self, allocator: Any, pool_of: Any) -> None:
        self._allocator = allocator
        self._pool_of = pool_of
        """The resource a unit counts under (``UnitCatalog.pool_of``)."""
        self._pid: PID | None = None
        self._watches: dict[ContainerID, _Watch] = {}
        """Containers somebody watches (dropped when nobody does)."""
        self.watched: Mapping[ContainerID, Any] = MappingProxyType(self._watches)
        """``_watches``, read-only: ``id in watched`` says whether anybody watches it."""

    def bind(self, pid: PID) -> None:
        """The actor the continuations run on (at its initialize)."""
        self._pid = pid

    def watch(self, container_id: ContainerID, units: Iterable[Unit]) -> Future:
        """A Future of the container's next ``ContainerLimitation``."""
        watch = self._watches.get(container_id)
        if watch is None:
            watch = self._watches[container_id] = _Watch()
        promise: Promise = Promise()
        watch.watchers.append(promise)
        promise.on_discard(defer(self._pid, lambda: self._unwatch(container_id, watch, promise)))
        if watch.health is None:
            self._arm(container_id, watch, frozenset(units))
        return promise.future

    def rearm(self, container_id: ContainerID, units: Iterable[Unit]) -> None:
        """The container holds ``units`` now: watch those (while anybody watches it)."""
        watch = self._watches.get(container_id)
        if watch is not None:
            self._arm(container_id, watch, frozenset(units))

    def forget(self, container_id: ContainerID) -> None:
        """Cleanup: discard every watch of the container."""
        watch = self._watches.pop(container_id, None)
        if watch is None:
            return
        watchers, watch.watchers = watch.watchers, []
        for watcher in watchers:
            watcher.discard()
        self._arm(container_id, watch, frozenset())

    def _unwatch(self, container_id: ContainerID, watch: _Watch, promise: Promise) -> None:
        if promise in watch.watchers:
            watch.watchers.remove(promise)
            promise.discard()
            if not watch.watchers:
                self._arm(container_id, watch, watch.units)  # nobody watches: stop the allocator's watch

    def _arm(self, container_id: ContainerID, watch: _Watch, units: frozenset[Unit]) -> None:
        """(Re)watch ``units`` for the container, while anybody watches it."""
        old, watch.health = watch.health, None
        if old is not None:
            old.discard()
        watch.units = units
        if not watch.watchers:
            if self._watches.get(container_id) is watch:
                del self._watches[container_id]
            return
        health = self._allocator.watch(set(units))
        watch.health = health
        health.on_ready(defer(self._pid, lambda event: self._unhealthy(container_id, watch, health, event)))

    def _unhealthy(self, container_id: ContainerID, watch: _Watch, health: Future, event: Any) -> None:
        if watch.health is not health:
            return  # re-armed or cleaned up since: stale
        watch.health = None
        unit = event.gpu
        what = f"MIG device {unit}" if isinstance(unit, MigDevice) else f"GPU {unit}"
        message = f"{what} of container {container_id} became unhealthy: {event.reason}"
        logger.warning("Container %s: %s", container_id, message)
        resource = self._pool_of(unit) or "gpus"
        limitation = ContainerLimitation(resources=Resources(scalars={resource: 1.0}), message=message)
        watchers, watch.watchers = watch.watchers, []
        if self._watches.get(container_id) is watch:
            del self._watches[container_id]
        for watcher in watchers:
            watcher.set_value(limitation)
