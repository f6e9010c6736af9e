"""Health watch (R-IS-9, beyond Mesos): a container learns that a GPU it holds
turned unhealthy.

Rules:
- ``watch(id)`` returns a Future of a ``ContainerLimitation`` (reason
  ``REASON_GPU_UNHEALTHY``, a message naming the GPU -- or the MIG device,
  whose resource the limitation then names -- and the allocator's reason),
  queued behind the container's earlier calls; nested ids -> "Not
  supported for nested containers"; unknown ids -> "Unknown container".
- The allocator watches the GPUs the container holds NOW: the watch is
  re-armed at every change of them (``_arm``) and dropped when nobody
  watches. An event for GPUs since released is stale and ignored.
- A caller that discards its Future stops watching; cleanup discards every
  watch of the container.
- Mixed into the isolator actor: continuations run on it (``defer``).
"""

from __future__ import annotations

import logging
from typing import Any

from actors.mig import MigDevice
from actors.resources import Resources
from runtime import Future, Promise, defer

from ._errors import IsolatorError
from ._grant import ContainerRecord
from ._types import ContainerID, ContainerLimitation, check_container_id

logger = logging.getLogger(__name__)


class HealthWatch:
    """The isolator actor's ``watch`` verb and its bookkeeping (see the module rules)."""

    pid: Any
    infos: dict
    allocator: Any
    catalog: Any
    _in_order: Any
    _units_of: Any

    def watch(self, container_id: ContainerID) -> Any:
        """R-IS-9: a Future of a ContainerLimitation, raised when one of the
        GPUs the container holds (now, after any update) turns unhealthy;
        discarded at cleanup, or when the caller discards it."""
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        return self._unboxed(self._in_order(container_id, self._watch, container_id))

    @staticmethod
    async def _unboxed(call: Any) -> Future:
        """The watch Future travels boxed: the sequence must not wait for it."""
        (future,) = await call
        return future

    async def _watch(self, container_id: ContainerID) -> tuple[Future]:
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        promise: Promise = Promise()
        info.watchers.append(promise)
        promise.on_discard(defer(self.pid, lambda: self._unwatch(info, promise)))
        if info.health is None:
            self._arm(info)
        return (promise.future,)

    def _unwatch(self, info: ContainerRecord, promise: Promise) -> None:
        if promise in info.watchers:
            info.watchers.remove(promise)
            promise.discard()
            if not info.watchers:
                self._arm(info)  # nobody watches: stop the allocator's watch

    def _arm(self, info: ContainerRecord) -> None:
        """(Re)watch the GPUs ``info`` holds now, while anybody watches it."""
        old, info.health = info.health, None
        if old is not None:
            old.discard()
        if not info.watchers:
            return
        health = self.allocator.watch(set(self._units_of(info.container_id)))
        info.health = health
        health.on_ready(defer(self.pid, lambda event: self._unhealthy(info, health, event)))

    def _stop_watching(self, info: ContainerRecord) -> None:
        """Cleanup: discard every watch of the container."""
        watchers, info.watchers = info.watchers, []
        for watcher in watchers:
            watcher.discard()
        self._arm(info)

    def _unhealthy(self, info: ContainerRecord, health: Future, event: Any) -> None:
        if info.health is not health:
            return  # re-armed or cleaned up since: stale
        info.health = None
        cid = info.container_id
        unit = event.gpu
        what = f"MIG device {unit}" if isinstance(unit, MigDevice) else f"GPU {unit}"
        message = f"{what} of container {cid} became unhealthy: {event.reason}"
        logger.warning("Container %s: %s", cid, message)
        resource = self.catalog.pool_of(unit) or "gpus"
        limitation = ContainerLimitation(resources=Resources(scalars={resource: 1.0}), message=message)
        watchers, info.watchers = info.watchers, []
        for watcher in watchers:
            watcher.set_value(limitation)

