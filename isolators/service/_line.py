"""The prepares a service has not answered yet, and the line they wait in.

Rules (first come, first served):
- A prepare ``arrive``s and is admitted in arrival order (``next_arrival``).
- ``admission(gpus, wait, free)`` decides for one being admitted: while
  anybody waits, a request that waits joins the line and one that does not
  is refused (nothing is free for it: ``refusal``); with nobody waiting, a
  request that waits but does not fit joins the line; anything else is
  granted now (and may still fail, with the isolator's own text).
- The line is served from its head only, once enough GPUs are free for
  the head: nobody is served before an earlier request.
- A pending request is ``cancel``led by a cleanup of its container, or
  ``drop_sender``ed when its sender goes away; cancelled ones are skipped,
  never answered twice. ``close()`` hands back every one still pending.
- Pure: no I/O, no runtime; the service does the waiting and the talking.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ._messages import Prepare, WaitingView

__all__ = ["GRANT", "QUEUE", "PendingPrepare", "WaitingLine"]

GRANT = "grant"
QUEUE = "queue"


class PendingPrepare:
    """A prepare not answered yet: arriving, or waiting in line."""

    __slots__ = ("sender", "body", "since", "uid", "user", "cancelled")

    def __init__(self, sender: Any, body: Prepare) -> None:
        self.sender = sender
        self.body = body
        self.since = time.time()
        self.uid: int | None = None
        self.user: str | None = None
        self.cancelled = False

    def view(self) -> WaitingView:
        """The request as ``GET /gpu-isolator/state`` shows it."""
        body = self.body
        return WaitingView(container_id=body.container_id, gpus=body.gpus, command=body.command, user=self.user,
                           client=str(self.sender), since=self.since)


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

    def admission(self, gpus: int, wait: bool, free: int) -> str:
        """``GRANT``, ``QUEUE``, or the refusal's text (see module rules)."""
        if self.waiting():
            return QUEUE if wait else self.refusal(gpus)
        if wait and free < gpus:
            return QUEUE
        return GRANT

    def refusal(self, gpus: int) -> str:
        waiting = self.waiting()
        return (f"Requested {gpus} gpus but only 0 available: the free GPUs are held for {len(waiting)} earlier"
                f" request(s) for {sum(p.body.gpus for p in waiting)} GPU(s) waiting in line")

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
