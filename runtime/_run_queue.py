"""The run queue: how a woken process's drain gets to run on an asyncio loop.

Rules (libprocess' run queue, on asyncio's own loops):
- ``RunQueue.on(loop)`` is a run queue for ``loop`` when it is one of
  asyncio's own event loops (``asyncio.BaseEventLoop``) with its ready
  queue, not in debug mode (there ``call_soon``'s checks stay); otherwise
  None, and the runtime schedules each drain with ``call_soon`` (trio,
  other loops, debug mode).
- ``schedule(process)`` is what a process calls when it gets work while
  idle: the process joins the queue, its drain run in its context
  (``process._context``, copied from the spawner's at spawn), and one
  ``asyncio.Handle``, the pump, is appended to the loop's ready queue when
  the run queue stops being empty (what ``call_soon`` does, without a new
  Handle and a context copy each time).
- Nothing here holds a process once its drain has run: ``schedule`` is one
  function for the whole runtime (no closure per process, so no reference
  cycle through the process; a terminated process is freed by reference
  counting alone), and the queue holds a process only while it is queued.
- The pump runs the drains queued, in order, those they wake included, up
  to ``PUMP_LIMIT`` drains a loop turn; the rest go next turn, after the
  loop's other callbacks and tasks. So a dispatch from one process to
  another costs no loop turn of its own, as libprocess' workers take the
  next runnable process.
- A drain that raises is reported as the loop reports a callback's error
  (``call_exception_handler``) and the pump goes on; ``SystemExit`` and
  ``KeyboardInterrupt`` leave it, as they leave a Handle.
- An asyncio task awaiting a pending runtime Future waits on a
  ``TaskWait``: a Future-compatible object the task
  registers its wake-up on (``add_done_callback``), as it does on a loop
  future. When the runtime Future completes, ``wake`` puts the task's
  wake-up in this queue, so the pump resumes the task in order with the
  drains, with no ``call_soon``, no Handle and no loop turn of its own
  (libprocess resumes a waiter in the completing worker's turn).
- A cancelled task is not left waiting: ``TaskWait.cancel`` (what
  ``Task.cancel`` calls) unhooks it from the Future, which stays pending
  for its other awaiters and its producer, and resumes the task with
  ``CancelledError``; once the wake-up is queued, ``cancel`` answers False
  and the task cancels itself at that wake-up, as on a done loop future.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from typing import Any, Callable

PUMP_LIMIT = 256
"""Drains the pump runs in one loop turn at most (see the module rules)."""


class RunQueue:
    """The drains woken on one asyncio loop, and the pump that runs them."""

    __slots__ = ("_loop", "_ready", "_runnable", "_queued", "_handle", "_done")

    def __init__(self, loop: asyncio.BaseEventLoop, ready: deque) -> None:
        self._loop = loop
        self._ready = ready
        # each process woken and the TaskWait of each task resumed, in order
        self._runnable: deque = deque()
        self._queued = False
        self._handle = asyncio.Handle(self._pump, (), loop, contextvars.copy_context())
        self._done = loop.create_future()  # what a resumed task's wake-up reads: done, no value
        self._done.set_result(None)

    @classmethod
    def on(cls, loop: asyncio.AbstractEventLoop) -> "RunQueue | None":
        """A run queue for ``loop``, or None where ``call_soon`` must schedule (see module rules)."""
        ready = getattr(loop, "_ready", None)
        if isinstance(loop, asyncio.BaseEventLoop) and type(ready) is deque and not loop.get_debug():
            return cls(loop, ready)
        return None

    def scheduler(self) -> Callable[[Any], None]:
        """The function a process calls, with itself, to have its drain run
        (one for the runtime: see the module rules)."""
        queue = self._runnable.append
        ready = self._ready.append
        handle = self._handle

        def schedule(process: Any) -> None:
            queue(process)
            if not self._queued:
                self._queued = True
                ready(handle)

        return schedule

    def _pump(self) -> None:
        """Run the queued drains, those they wake included, up to ``PUMP_LIMIT``."""
        runnable = self._runnable
        popleft = runnable.popleft
        left = PUMP_LIMIT
        try:
            while runnable and left:
                left -= 1
                item = popleft()
                try:
                    if type(item) is TaskWait:  # a task's wake-up
                        item._context.run(item._wakeup, item._outcome)
                    else:  # a process
                        item._context.run(item._drain)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # noqa: BLE001 - as asyncio's Handle does
                    self._loop.call_exception_handler({
                        "message": f"Exception in the drain of {item!r}",
                        "exception": exc,
                    })
        finally:
            if runnable:
                self._ready.append(self._handle)  # the rest next turn, after the loop's others
            else:
                self._queued = False


class TaskWait:
    """What an asyncio task awaiting a pending runtime Future waits on (see
    the module rules): the task's side of asyncio's Future protocol
    (``_asyncio_future_blocking``, ``_loop``, ``add_done_callback``,
    ``cancel``), resumed through the run queue."""

    __slots__ = ("_asyncio_future_blocking", "_loop", "_queue", "_wakeup", "_context", "_outcome", "_future")

    def __init__(self, queue: RunQueue, future: Any) -> None:
        self._asyncio_future_blocking = True  # the task waits on it (asyncio's mark)
        self._loop = queue._loop
        self._queue = queue
        self._future = future  # None once the wake-up is queued
        self._wakeup: Callable[[Any], Any] | None = None
        self._context: contextvars.Context | None = None
        self._outcome: asyncio.Future = queue._done

    def add_done_callback(self, fn: Callable[[Any], Any], *, context: contextvars.Context | None = None) -> None:
        """The task registers its wake-up (once, when it starts waiting), run
        in ``context`` (a copy of the current one without it, as asyncio's)."""
        self._wakeup = fn
        self._context = context if context is not None else contextvars.copy_context()

    def wake(self) -> None:
        """The Future completed: queue the task's wake-up (once; none before
        a task registered one)."""
        if self._future is not None and self._wakeup is not None:
            self._future = None
            queue = self._queue
            queue._runnable.append(self)
            if not queue._queued:
                queue._queued = True
                queue._ready.append(queue._handle)

    def cancel(self, msg: Any = None) -> bool:
        """The task is cancelled: unhook it and resume it with CancelledError;
        False once its wake-up is queued (see the module rules)."""
        future = self._future
        if future is None:
            return False
        if future._waiter is self:
            future._waiter = None
        cancelled = self._loop.create_future()
        cancelled.cancel(msg)
        self._outcome = cancelled
        self.wake()
        return True

    def __repr__(self) -> str:
        return f"<TaskWait on {self._future!r}>"
