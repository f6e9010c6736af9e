"""Runtime: the scope that hosts processes inside a running event loop.

Rules (libprocess's process manager, scoped):
- ``async with Runtime():`` binds a runtime to the running loop (asyncio or
  trio), so it embeds in someone else's program. Module functions
  (``spawn``, ``dispatch``, ``terminate``, ``wait``, ``defer``, ``delay``,
  ``send``) use the current runtime. One runtime is current at a time; a
  nested scope is current until it exits.
- On exit every process is terminated (queued events fail with
  ``ProcessTerminated``) and awaited; the clock resumes and forgets timers.
- ``spawn(process)`` registers and starts it: ``initialize`` runs before any
  event. A second live process with an explicit id already in use is an error.
- ``dispatch(pid, method, *args, **kwargs)`` queues ``method(process, *args)``
  and returns its Future; an unknown or terminated target gives a Future
  failed with ``ProcessTerminated``. Every Future completes.
- ``terminate(pid, inject=True)``: with ``inject`` termination is delivered
  before events already queued, otherwise after them. Unknown PID: no-op.
  ``wait(pid)`` is READY once the process has finalized (at once if unknown).
- ``defer(pid, fn)`` returns a callable that dispatches ``fn(*args)`` onto
  ``pid`` (as a method when ``fn`` belongs to its class).
- ``delay(seconds, pid, method, *args)`` dispatches when the Clock says so
  and returns a cancellable ``Timer``.
- Test filters (``runtime.testing``) see every dispatch and message as it is
  queued; the newest matching filter wins and matches once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import anyio
import sniffio

from . import _clock
from ._clock import Clock, Timer
from ._errors import Failure, ProcessTerminated
from ._executor import in_flight
from ._future import FAILED, READY, Future
from ._pid import PID
from ._process import RUNNING, TERMINATED, Process, _terminate_marker, complete

logger = logging.getLogger(__name__)

_current: "Runtime | None" = None


def current_runtime() -> "Runtime":
    """The runtime of the enclosing ``async with Runtime():`` scope."""
    if _current is None:
        raise RuntimeError("No runtime is running: wrap the code in `async with runtime.Runtime():`")
    return _current


class Runtime:
    """Hosts processes in the running event loop (see module rules)."""

    def __init__(self) -> None:
        self._processes: dict[PID, Process] = {}
        self._filters: list[Any] = []
        self._call_soon: Callable[..., Any] | None = None
        self._backend = ""
        self._previous: Runtime | None = None
        self._timer_scope: anyio.CancelScope | None = None
        self._timer_wake: anyio.Event | None = None
        self._task_group: Any = None

    # -- scope ------------------------------------------------------------
    async def __aenter__(self) -> "Runtime":
        global _current
        self._backend = sniffio.current_async_library()
        if self._backend == "asyncio":
            loop = asyncio.get_running_loop()
            self._call_soon = loop.call_soon
            self._loop = loop
        elif self._backend == "trio":
            import trio

            self._call_soon = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            raise RuntimeError(f"Unsupported async library {self._backend!r}: use asyncio or trio")
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._previous, _current = _current, self
        _clock._state.wakeup = self._wake_timers
        self._timer_wake = anyio.Event()
        self._task_group.start_soon(self._timer_loop)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        global _current
        try:
            for pid in list(self._processes):
                self.terminate(pid, inject=True)
            for proc in list(self._processes.values()):
                await proc._terminated
        finally:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(None, None, None)
            _current = self._previous
            _clock._state.reset()
            if _current is not None:
                _clock._state.wakeup = _current._wake_timers

    # -- timers -----------------------------------------------------------
    def _wake_timers(self) -> None:
        if self._timer_wake is not None:
            self._timer_wake.set()

    async def _timer_loop(self) -> None:
        state = _clock._state
        while True:
            delay = state.next_delay()
            event = self._timer_wake
            if delay is None:
                await event.wait()
            elif delay > 0:
                with anyio.move_on_after(delay):
                    await event.wait()
            if event.is_set():
                self._timer_wake = anyio.Event()
            if not state.paused:
                state.fire_due()

    # -- processes --------------------------------------------------------
    def spawn(self, process: Process) -> PID:
        if process._runtime is not None:
            raise Failure(f"Process {process.pid} was already spawned")
        pid = process.pid
        existing = self._processes.get(pid)
        if existing is not None:
            raise Failure(f"A process with id {pid} is already running: give each live process a unique id")
        process._runtime = self
        self._processes[pid] = process
        from ._process import _initialize_event

        process._mailbox.appendleft((_initialize_event, (), None, None))
        process._scheduled = True
        self._call_soon(process._drain)
        return pid

    def _enqueue(self, proc: Process, fn: Any, args: tuple, kwargs: dict | None, future: Future | None) -> None:
        proc._mailbox.append((fn, args, kwargs, future))
        if not proc._scheduled:
            proc._scheduled = True
            self._call_soon(proc._drain)

    def dispatch(self, pid: PID, method: Callable[..., Any], args: tuple, kwargs: dict) -> Future:
        proc = self._processes.get(pid)
        if proc is None or proc._state is not RUNNING:
            return Future.failed(ProcessTerminated(f"Process {pid} is not running; cannot dispatch {_name(method)}"))
        future = Future()
        if self._filters and self._filter_dispatch(pid, method, args, kwargs, future):
            return future
        proc._mailbox.append((method, args, kwargs, future))
        if not proc._scheduled:
            proc._scheduled = True
            self._call_soon(proc._drain)
        return future

    def terminate(self, pid: PID, inject: bool = True) -> None:
        proc = self._processes.get(pid)
        if proc is None or proc._state is not RUNNING:
            return
        proc._state = "terminating"
        event = (_terminate_marker, (), None, None)
        if inject:
            proc._mailbox.appendleft(event)
        else:
            proc._mailbox.append(event)
        if not proc._scheduled:
            proc._scheduled = True
            self._call_soon(proc._drain)

    def wait(self, pid: PID) -> Future[None]:
        proc = self._processes.get(pid)
        if proc is None:
            return Future.ready(None)
        return proc._terminated

    def send(self, to: PID, name: str, body: Any, from_: PID | None = None) -> None:
        proc = self._processes.get(to)
        if proc is None or proc._state is not RUNNING:
            logger.warning("Message %r to %s dropped: process is not running", name, to)
            return
        if self._filters and self._filter_message(to, name, body, from_):
            return
        decoded = proc._decode(name, body)
        if decoded is None:
            return
        handler, value = decoded
        if getattr(handler, "__self__", None) is proc:
            fn = lambda _p, f, v: handler(f, v)  # noqa: E731 - bound handler
        else:
            fn = handler
        self._enqueue(proc, fn, (from_, value), None, Future())

    # -- async methods ----------------------------------------------------
    def _start_async(self, proc: Process, coro: Any, future: Future | None, hold: bool) -> None:
        if self._backend == "asyncio":
            task = self._loop.create_task(self._run_async(proc, coro, future, hold, None))
            proc._tasks[task] = (future, coro)
        else:
            handle = _TrioHandle()
            proc._tasks[handle] = (future, coro)
            self._task_group.start_soon(self._run_async, proc, coro, future, hold, handle)

    async def _run_async(self, proc: Process, coro: Any, future: Future | None, hold: bool, handle: Any) -> None:
        if not hold:
            self._call_soon(proc._drain)
        key = handle if handle is not None else asyncio.current_task()
        scope = None
        try:
            if handle is not None:
                if handle.cancelled:
                    coro.close()
                    return
                scope = handle.scope = anyio.CancelScope()
                with scope:
                    result = await coro
                if scope.cancelled_caught:
                    return
            else:
                result = await coro
        except asyncio.CancelledError:
            return
        except Exception as e:
            proc._failures += 1
            if future is not None:
                future._complete(FAILED, e)
            else:
                logger.exception("Process %s: async event failed", proc.pid)
            if hold:
                logger.error("Process %s: initialize failed; terminating it", proc.pid)
                proc._tasks.pop(key, None)
                proc._terminate_now()
                return
        else:
            if future is not None:
                complete(future, result)
        finally:
            proc._tasks.pop(key, None)
        if hold and proc._state is not TERMINATED:
            self._call_soon(proc._drain)

    def _cancel_task(self, handle: Any) -> None:
        if isinstance(handle, _TrioHandle):
            handle.cancelled = True
            if handle.scope is not None:
                handle.scope.cancel()
        else:
            handle.cancel()

    def _start_finalize(self, proc: Process, coro: Any) -> None:
        async def _run() -> None:
            try:
                await coro
            except Exception:
                logger.exception("Process %s: finalize raised", proc.pid)
            finally:
                proc._terminated._complete(READY, None)

        self._task_group.start_soon(_run)

    # -- testing and introspection ----------------------------------------
    def _filter_dispatch(self, pid: PID, method: Any, args: tuple, kwargs: dict, future: Future) -> bool:
        from .testing import _match_dispatch

        return _match_dispatch(self, pid, method, args, kwargs, future)

    def _filter_message(self, to: PID, name: str, body: Any, from_: PID | None) -> bool:
        from .testing import _match_message

        return _match_message(self, to, name, body, from_)

    def _idle(self) -> bool:
        if in_flight():
            return False
        for proc in self._processes.values():
            if proc._scheduled or proc._mailbox:
                return False
        return True

    async def settle(self) -> None:
        quiet = 0
        while quiet < 4:
            await anyio.sleep(0)
            quiet = quiet + 1 if self._idle() else 0

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per process: state, queue depth, events handled, failures."""
        return {str(pid): proc.stats() for pid, proc in self._processes.items()}

    def processes(self) -> list[PID]:
        return list(self._processes)


class _TrioHandle:
    __slots__ = ("scope", "cancelled")

    def __init__(self) -> None:
        self.scope: Any = None
        self.cancelled = False


def _name(method: Any) -> str:
    return getattr(method, "__qualname__", None) or getattr(method, "__name__", None) or repr(method)


# -- module functions (the libprocess free functions) -----------------------
def spawn(process: Process) -> PID:
    """Register and start ``process``; returns its PID."""
    return current_runtime().spawn(process)


def dispatch(pid: PID, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Queue ``method(process, *args, **kwargs)`` on ``pid``; a Future of its result."""
    rt = _current
    if rt is None:
        return Future.failed(ProcessTerminated(f"No runtime is running; cannot dispatch {_name(method)} to {pid}"))
    return rt.dispatch(pid, method, args, kwargs)


def terminate(pid: PID, inject: bool = True) -> None:
    """Stop ``pid``: before queued events with ``inject``, else after them."""
    if _current is not None:
        _current.terminate(pid, inject)


def wait(pid: PID) -> Future[None]:
    """READY once ``pid`` has finalized (at once when unknown)."""
    if _current is None:
        return Future.ready(None)
    return _current.wait(pid)


def send(to: PID, name: str, body: Any = None, from_: PID | None = None) -> None:
    """Deliver the named message ``name`` with ``body`` to ``to``."""
    current_runtime().send(to, name, body, from_)


def defer(pid: PID, fn: Callable[..., Any]) -> Callable[..., Future]:
    """A callable that dispatches ``fn(*args)`` onto ``pid`` when called."""

    def deferred(*args: Any) -> Future:
        rt = _current
        proc = rt._processes.get(pid) if rt is not None else None
        if proc is not None and getattr(type(proc), getattr(fn, "__name__", ""), None) is fn:
            return dispatch(pid, fn, *args)
        return dispatch(pid, lambda _proc, *a: fn(*a), *args)

    return deferred


def delay(seconds: float, pid: PID, method: Callable[..., Any], *args: Any) -> Timer:
    """Dispatch ``method(*args)`` to ``pid`` after ``seconds`` on the Clock."""
    return Clock.timer(seconds, lambda: dispatch(pid, method, *args))


def snapshot() -> dict[str, dict[str, Any]]:
    """Introspection of the current runtime's processes as a plain dict."""
    return current_runtime().snapshot()
