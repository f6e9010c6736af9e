"""The prepares a service has not answered yet, and the line they wait in.

Rules (first come, first served):
- A prepare ``arrive``s and is admitted in arrival order (``next_arrival``).
- A request's ``demand`` is what it asks for per resource (``_demand``:
  ``{"gpus": 2, "mig-1g.18gb": 1}``); ``free`` the same per resource.
- ``admission(demand, wait, free)`` decides for one being admitted: while
  anybody waits, a request that waits joins the line and one that does not
  is refused (nothing is free for it: ``refusal``); with nobody waiting, a
  request that waits but does not fit joins the line; anything else is
  granted now (and may still fail, with the isolator's own text).
- The line is served from its head only, once enough GPUs are free for
  the head (``fits``): nobody is served before an earlier request.
- A pending request is ``cancel``led by a cleanup of its container, or
  ``drop_sender``ed when its sender goes away; cancelled ones are skipped,
  never answered twice. ``close()`` hands back every one still pending.
  An exec request holds its client's stdio descriptors (``fds``) until
  it is answered, dropped or started (``close_fds``).
- A request's ``sender`` is a ``Channel``: who asked (``caller``) and
  where its answers go -- a user's connection (``_front_door``) or an
  agent, answered to its PID.
- Pure: no I/O, no runtime; the service does the waiting and the talking.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ._demand import GPUS, demand_of, describe, mig_counts
from ._messages import Prepare, WaitingView

if TYPE_CHECKING:
    from ._caller import Caller

__all__ = ["GRANT", "QUEUE", "Channel", "PendingPrepare", "WaitingLine", "fits"]

GRANT = "grant"
QUEUE = "queue"


class Channel(Protocol):
    """Where a request came from, and where its answers go (see module rules)."""

    caller: Caller

    def send(self, verb: str, body: Any) -> None:
        """Answer ``verb`` with ``body``."""

    def detach(self) -> Awaitable[int | None]:
        """Hand the connection on: a duplicate of its descriptor (None: it is gone)."""


class PendingPrepare:
    """A prepare not answered yet: arriving, or waiting in line."""

    __slots__ = ("sender", "body", "demand", "since", "uid", "user", "cancelled", "fds", "withdrawn")

    def __init__(self, sender: Channel, body: Prepare, demand: dict[str, int] | None = None) -> None:
        self.sender = sender
        self.body = body
        self.demand = demand if demand is not None else demand_of(body.gpus)
        self.since = time.time()
        self.uid: int | None = None
        self.user: str | None = None
        self.cancelled = False
        self.fds: tuple[int, ...] = ()
        """An exec request's stdin, stdout and stderr, held until its command starts or it ends."""
        self.withdrawn: int | None = None
        """The signal its client forwarded before the command started (it is then withdrawn)."""

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = ()

    def view(self) -> WaitingView:
        """The request as ``GET /gpu-isolator/state`` shows it."""
        body = self.body
        return WaitingView(container_id=body.container_id, gpus=body.gpus, mig=mig_counts(self.demand),
                           command=body.command, user=self.user, uid=self.uid,
                           client=getattr(getattr(self.sender, "caller", None), "peer", None) or str(self.sender),
                           since=self.since)


def fits(demand: Mapping[str, int], free: Mapping[str, int]) -> bool:
    """Whether ``free`` covers ``demand``, resource by resource."""
    return all(free.get(name, 0) >= count for name, count in demand.items())


class WaitingLine:
    """Arriving prepares and the line of those that wait (see module rules)."""

    def __init__(self) -> None:
        self._arriving: deque[PendingPrepare] = deque()
        self._waiting: deque[PendingPrepare] = deque()

    def arrive(self, pending: PendingPrepare) -> None:
        self._arriving.append(pending)

    def next_arrival(self) -> PendingPrepare | None:
        while self._arriving:
            pending = self._arriving.popleft()
            if not pending.cancelled:
                return pending
        return None

    def admission(self, demand: Mapping[str, int], wait: bool, free: Mapping[str, int]) -> str:
        """``GRANT``, ``QUEUE``, or the refusal's text (see module rules)."""
        if self.waiting():
            return QUEUE if wait else self.refusal(demand)
        if wait and not fits(demand, free):
            return QUEUE
        return GRANT

    def refusal(self, demand: Mapping[str, int]) -> str:
        waiting = self.waiting()
        name, count = next(((n, c) for n, c in demand.items() if c), (GPUS, demand.get(GPUS, 0)))
        held: dict[str, int] = {}
        for pending in waiting:
            for resource, wanted in pending.demand.items():
                held[resource] = held.get(resource, 0) + wanted
        return (f"Requested {count} {name} but only 0 available: the free GPUs are held for {len(waiting)} earlier"
                f" request(s) for {describe(held)} waiting in line")

    def enqueue(self, pending: PendingPrepare) -> int:
        """Join the line; the position (1: next)."""
        self._waiting.append(pending)
        return len(self.waiting())

    def head(self) -> PendingPrepare | None:
        while self._waiting and self._waiting[0].cancelled:
            self._waiting.popleft()
        return self._waiting[0] if self._waiting else None

    def pop_head(self) -> PendingPrepare:
        head = self.head()
        assert head is not None
        return self._waiting.popleft()

    def waiting(self) -> list[PendingPrepare]:
        return [p for p in self._waiting if not p.cancelled]

    def pending(self) -> list[PendingPrepare]:
        """Every request not answered yet, arriving or waiting."""
        return [p for p in [*self._arriving, *self._waiting] if not p.cancelled]

    def holds(self, container_id: str) -> bool:
        return any(p.body.container_id == container_id for p in self.pending())

    def cancel(self, container_id: str) -> list[PendingPrepare]:
        return self._take(lambda p: p.body.container_id == container_id)

    def drop_sender(self, sender: Any) -> list[PendingPrepare]:
        return self._take(lambda p: p.sender == sender)

    def close(self) -> list[PendingPrepare]:
        taken = self._take(lambda p: True)
        self._arriving.clear()
        self._waiting.clear()
        return taken

    def _take(self, match: Any) -> list[PendingPrepare]:
        taken = [p for p in self.pending() if match(p)]
        for pending in taken:
            pending.cancelled = True
        return taken
