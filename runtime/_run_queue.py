"""The run queue: how a woken process's drain gets to run on an asyncio loop.

Rules (libprocess' run queue, on asyncio's own loops):
- ``RunQueue.on(loop)`` is a run queue for ``loop`` when it is one of
  asyncio's own event loops (``asyncio.BaseEventLoop``) with its ready
  queue, not in debug mode (there ``call_soon``'s checks stay); otherwise
  None, and the runtime schedules each drain with ``call_soon`` (trio,
  other loops, debug mode).
- ``waker(drain)`` is what a process calls when it gets work while idle:
  its drain joins the queue, run in a context of the process's own (copied
  from the spawner's at spawn), and one ``asyncio.Handle``, the pump, is
  appended to the loop's ready queue when the run queue stops being empty
  (what ``call_soon`` does, without a new Handle and a context copy each
  time).
- The pump runs the drains queued, in order, those they wake included, up
  to ``PUMP_LIMIT`` drains a loop turn; the rest go next turn, after the
  loop's other callbacks and tasks. So a dispatch from one process to
  another costs no loop turn of its own, as libprocess' workers take the
  next runnable process.
- A drain that raises is reported as the loop reports a callback's error
  (``call_exception_handler``) and the pump goes on; ``SystemExit`` and
  ``KeyboardInterrupt`` leave it, as they leave a Handle.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from typing import Callable

PUMP_LIMIT = 256
"""Drains the pump runs in one loop turn at most (see the module rules)."""


class RunQueue:
    """The drains woken on one asyncio loop, and the pump that runs them."""

    __slots__ = ("_loop", "_ready", "_runnable", "_queued", "_handle")

    def __init__(self, loop: asyncio.BaseEventLoop, ready: deque) -> None:
        self._loop = loop
        self._ready = ready
        self._runnable: deque = deque()  # (context.run, drain) of each process woken, in order
        self._queued = False
        self._handle = asyncio.Handle(self._pump, (), loop, contextvars.copy_context())

    @classmethod
    def on(cls, loop: asyncio.AbstractEventLoop) -> "RunQueue | None":
        """A run queue for ``loop``, or None where ``call_soon`` must schedule (see module rules)."""
        ready = getattr(loop, "_ready", None)
        if isinstance(loop, asyncio.BaseEventLoop) and type(ready) is deque and not loop.get_debug():
            return cls(loop, ready)
        return None

    def waker(self, drain: Callable[[], None]) -> Callable[[], None]:
        """What a process calls to have ``drain`` run (in a copy of the current context)."""
        entry = (contextvars.copy_context().run, drain)
        queue = self._runnable.append
        ready = self._ready.append
        handle = self._handle

        def wake() -> None:
            queue(entry)
            if not self._queued:
                self._queued = True
                ready(handle)

        return wake

    def _pump(self) -> None:
        """Run the queued drains, those they wake included, up to ``PUMP_LIMIT``."""
        runnable = self._runnable
        popleft = runnable.popleft
        left = PUMP_LIMIT
        try:
            while runnable and left:
                left -= 1
                run, drain = popleft()
                try:
                    run(drain)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # noqa: BLE001 - as asyncio's Handle does
                    self._loop.call_exception_handler({
                        "message": f"Exception in the drain of {getattr(drain, '__self__', drain)!r}",
                        "exception": exc,
                    })
        finally:
            if runnable:
                self._ready.append(self._handle)  # the rest next turn, after the loop's others
            else:
                self._queued = False
