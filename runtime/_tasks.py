"""Tasks behind async methods: the asyncio continuation and trio's plumbing.

Rules:
- ``_Continuation`` is what an asyncio task runs for an async method whose
  first step already ran inside the drain: it hands the task what that step
  yielded, drives the coroutine on and completes the method's Future (an
  ending method never raises out of the task). ``_Detached`` stands in for
  a terminated process while a cancelled method finishes.
- ``_async_failed`` completes an async method's Future with its failure: a
  cancellation from inside becomes a ``Failure``; one by termination was
  already reported.
- ``_TrioSoon`` is the runtime's ``call_soon`` under trio: callbacks run in
  the order they were queued, in one runtime task, in batches, yielding to
  other tasks between batches. ``_TrioHandle`` is an async method's trio
  task: its cancel scope, and whether it was cancelled before it started.
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ._errors import Failure
from ._future import FAILED, Future
from ._process import TERMINATED, complete

if TYPE_CHECKING:
    from ._process import Process

logger = logging.getLogger("runtime._runtime")


class _Detached:
    """Stands in for a terminated process while a cancelled method finishes."""

    _state = TERMINATED
    pid = None

    def __init__(self) -> None:
        self._tasks: dict[Any, Any] = {}
        self._failures = 0


def _async_failed(proc: Process, coro: Any, future: Future | None, error: BaseException) -> None:
    """An async method (asyncio) ended with ``error``: fail its Future (a
    cancellation from inside becomes a ``Failure``; one by termination is
    already reported)."""
    if isinstance(error, asyncio.CancelledError):
        if proc._state is TERMINATED:
            return
        error = Failure(f"Process {proc.pid}: {_name(coro)} was cancelled")
    proc._failures += 1
    if future is not None:
        future._complete(FAILED, error)
    else:
        logger.error("Process %s: async event %s failed", proc.pid, _name(coro), exc_info=error)


class _Continuation(collections.abc.Coroutine):
    """What an asyncio task runs for an async method whose first step already
    ran inside the drain (``Runtime._start_async``): it hands the task what
    that step yielded, then drives the coroutine on (a cancellation is
    thrown into it, even before the task's first step), and completes the
    method's Future."""

    __slots__ = ("_proc", "_coro", "_yielded", "_future", "_started")

    def __init__(self, proc: Process, coro: Any, yielded: Any, future: Future | None) -> None:
        self._proc = proc
        self._coro = coro
        self._yielded = yielded
        self._future = future
        self._started = False

    def send(self, value: Any) -> Any:
        if not self._started:
            self._started = True
            if self._yielded is not None:  # wait on what the first step waits on
                yielded, self._yielded = self._yielded, None
                return yielded
            # a bare yield: the task's first step is the loop turn it asked for
        try:
            return self._coro.send(value)
        except BaseException as e:  # noqa: BLE001
            self._finish(e)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._started = True
        self._yielded = None
        try:
            if val is None and tb is None:
                return self._coro.throw(typ)
            return self._coro.throw(typ, val, tb)
        except BaseException as e:  # noqa: BLE001
            self._finish(e)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:  # the task drives send/throw; never awaited
        raise TypeError("_Continuation is driven by its task, not awaited")

    def _finish(self, outcome: BaseException) -> None:
        """The coroutine ended: complete the Future, end the task quietly."""
        proc = self._proc
        proc._tasks.pop(asyncio.current_task(), None)
        if isinstance(outcome, StopIteration):
            if self._future is not None:
                complete(self._future, outcome.value)
            raise StopIteration
        if isinstance(outcome, (KeyboardInterrupt, SystemExit)):
            raise outcome
        _async_failed(proc, self._coro, self._future, outcome)
        raise StopIteration


class _TrioHandle:
    __slots__ = ("scope", "cancelled")

    def __init__(self) -> None:
        self.scope: Any = None
        self.cancelled = False


class _TrioSoon:
    """``call_soon`` for trio: callbacks run in order in one runtime task,
    in batches, yielding to other tasks between batches. Unlike
    ``TrioToken.run_sync_soon`` it is loop-thread only and needs no wakeup
    write (a syscall) per call."""

    def __init__(self) -> None:
        try:
            import trio

            trio.lowlevel.current_trio_token()
        except (ImportError, RuntimeError):
            raise RuntimeError(
                "Runtime needs a running asyncio or trio event loop: use `async with Runtime():` inside async code"
            ) from None
        self._lowlevel = trio.lowlevel
        self._queue: deque[Callable[[], Any]] = deque()
        self._parked: Any = None

    def __call__(self, fn: Callable[[], Any]) -> None:
        self._queue.append(fn)
        task = self._parked
        if task is not None:
            self._parked = None
            self._lowlevel.reschedule(task)

    def _abort(self, _raise_cancel: Any) -> Any:
        self._parked = None
        return self._lowlevel.Abort.SUCCEEDED

    async def run(self) -> None:
        lowlevel = self._lowlevel
        queue = self._queue
        while True:
            if not queue:
                self._parked = lowlevel.current_task()
                await lowlevel.wait_task_rescheduled(self._abort)
                continue
            for _ in range(len(queue)):  # what is queued now; later calls wait a turn
                fn = queue.popleft()
                try:
                    fn()
                except Exception:
                    logger.exception("Runtime callback %r raised", fn)
            fn = None  # hold no drain (and so no process) while parked
            if queue:  # more came meanwhile: let other tasks run first
                await lowlevel.checkpoint()


def _name(method: Any) -> str:
    return getattr(method, "__qualname__", None) or getattr(method, "__name__", None) or repr(method)
