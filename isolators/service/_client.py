"""ServiceClient: a process that asks a gpu-isolator service and matches its answers.

Rules:
- ``ServiceClient(service_pid, id=...)`` runs in a runtime that listens
  (the service answers over the network, to the sender's PID).
  ``ask(name, body)`` (dispatched to it) sends a request and returns a
  Future of the answer carrying the same ``request`` (so every request
  needs a ``request`` of its own); ``queued`` notes go to ``on_queued``.
- The client links to the service on its first request (and again after
  losing it): when the connection breaks or cannot be made, every
  unanswered request fails with ``LostService`` -- nothing waits forever
  on a dead service.
- Answers nobody waits for (a request given up on) are dropped.
"""

from __future__ import annotations

from typing import Any

from runtime import PID, Failure, Future, Process, Promise

from ._messages import CleanedUp, Prepared, Queued, Started, Statistics, Updated

__all__ = ["LostService", "ServiceClient"]

_ANSWERS = {"prepared": Prepared, "started": Started, "updated": Updated, "statistics": Statistics,
            "cleaned_up": CleanedUp}


class LostService(Failure):
    """The connection to the service broke or could not be made."""


class ServiceClient(Process):
    """Asks a gpu-isolator service (see module rules)."""

    def __init__(self, service: PID, id: str = "gpu-isolator-client") -> None:
        super().__init__(id)
        self.service = service
        self._waiting: dict[str, Promise] = {}
        self._linked = False
        self._heard = False  # any answer yet: "lost" the service, else never reached it
        self.on_queued: Any = None

    def initialize(self) -> None:
        self.install("queued", ServiceClient._queued, Queued)
        for name, kind in _ANSWERS.items():
            self.install(name, ServiceClient._answer, kind)

    def ask(self, name: str, body: Any) -> Future:
        """Send request ``name``; a Future of its answer (LostService if the service goes)."""
        if not self._linked:
            self._linked = True
            self.link(self.service)
        promise: Promise = Promise()
        self._waiting[body.request] = promise
        self.send(self.service, name, body)
        return promise.future

    def _answer(self, sender: PID, body: Any) -> None:
        self._heard = True
        promise = self._waiting.pop(body.request, None)
        if promise is not None:
            promise.set_value(body)

    def _queued(self, sender: PID, body: Queued) -> None:
        self._heard = True
        if self.on_queued is not None:
            self.on_queued(body)

    def exited(self, pid: PID) -> None:
        self._linked = False
        waiting, self._waiting = self._waiting, {}
        what = "lost" if self._heard else "cannot reach"
        for promise in waiting.values():
            promise.fail(LostService(f"{what} the gpu-isolator service at {self.service.host}:{self.service.port}"
                                     " (is 'gpu-isolator serve' running there?)"))
