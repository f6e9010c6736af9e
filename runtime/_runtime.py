"""Runtime: the scope that hosts processes inside a running event loop.

Rules (libprocess's process manager, scoped):
- ``async with Runtime():`` binds a runtime to the running loop (asyncio or
  trio), so it embeds in someone else's program. Module functions
  (``spawn``, ``dispatch``, ``terminate``, ``wait``, ``defer``, ``delay``,
  ``send``) use the current runtime. One runtime is current at a time; a
  nested scope is current until it exits.
- On exit every process is terminated (queued events fail with
  ``ProcessTerminated``) and awaited, async ``finalize`` included (and any
  process spawned meanwhile); the clock resumes and forgets timers.
- ``spawn(process)`` registers and starts it: ``initialize`` runs before any
  event. A second live process with an explicit id already in use is an error.
- ``dispatch(pid, method, *args, **kwargs)`` queues ``method(process, *args)``
  and returns its Future; an unknown or terminated target gives a Future
  failed with ``ProcessTerminated``. Every Future completes.
- ``terminate(pid, inject=True)``: with ``inject`` termination is delivered
  before events already queued, otherwise after them; either way after a
  pending ``initialize`` (``finalize`` never runs without it). Unknown PID:
  no-op.
  ``wait(pid)`` is READY once the process has finalized (at once if unknown).
- ``defer(pid, fn)`` returns a callable that dispatches ``fn(*args)`` onto
  ``pid`` (as a method when ``fn`` belongs to its class).
- ``delay(seconds, pid, method, *args)`` dispatches when the Clock says so
  and returns a cancellable ``Timer``.
- ``send(to, name, body)``: a message to a local running process is one
  mailbox entry; to a process that is not running (or unknown) it is
  dropped, logged and counted in ``runtime/messages/dropped`` (a counter
  registered on the first drop).
- Test filters (``runtime.testing``) see every dispatch and message as it is
  queued (a message to another runtime too); the newest matching filter
  wins and matches once. With no filter set, a local dispatch or send takes
  the short path (no filter lookup); with one set, every one is matched.
- A process's drain is scheduled once when it gets work while idle: on
  asyncio's own loops through the runtime's run queue (``_run_queue``: a
  dispatch from one process to another costs no loop turn of its own),
  elsewhere (trio, other loops, asyncio's debug mode) with ``call_soon``.
  A process's events run in a context of its own, copied from the
  spawner's.
- ``Runtime(listen="host:port")`` puts it on the network (``_network``):
  PIDs carry ``address``; a PID without one names a local process. Without
  ``listen`` local paths pay nothing for it, and a remote PID is an error.
  ``metrics`` is the runtime's registry (``_metrics``), listening or not.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Callable

import anyio

from . import _clock, _future
from ._clock import Clock, Timer
from ._errors import Failure, ProcessTerminated
from ._executor import in_flight
from ._future import FAILED, Future, _Park
from ._http import Limits
from ._metrics import Metrics
from ._network import Network
from ._pid import PID
from ._run_queue import RunQueue
from ._tasks import _async_failed, _Continuation, _Detached, _name, _TrioHandle, _TrioSoon
from ._process import (
    DROPPED,
    DROPPED_HELP,
    RUNNING,
    TERMINATED,
    TERMINATING,
    Process,
    _CoroutineType,
    _initialize_event,
    _message_event,
    _terminate_marker,
    complete,
    is_class_function,
)

logger = logging.getLogger(__name__)

_current: "Runtime | None" = None

def current_runtime() -> "Runtime":
    """The runtime of the enclosing ``async with Runtime():`` scope."""
    if _current is None:
        raise RuntimeError("No runtime is running: wrap the code in `async with runtime.Runtime():`")
    return _current


class Runtime:
    """Hosts processes in the running event loop (see module rules).
    ``listen``: ``"host:port"`` to serve (port 0: any free one); ``limits``:
    what one client may cost the server."""

    def __init__(self, listen: str | None = None, limits: Limits | None = None) -> None:
        self._listen = listen
        self._limits = Network.check(listen, limits)  # bad settings fail here, not in the loop
        self._network: Network | None = None
        self.metrics = Metrics()
        self._processes: dict[PID, Process] = {}
        self._filters: list[Any] = []
        self._call_soon: Callable[..., Any] | None = None
        self._run_queue: RunQueue | None = None  # on asyncio's own loops
        # what a process calls with itself when it gets work while idle: one
        # function for the runtime, holding no process (see ``_run_queue``)
        self._schedule: Callable[[Process], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._backend = ""
        self._previous: Runtime | None = None
        self._timer_scope: anyio.CancelScope | None = None
        self._timer_wake: anyio.Event | None = None
        self._task_group: Any = None
        self._finalizers: set[Any] = set()  # asyncio tasks of async finalize

    # -- scope ------------------------------------------------------------
    async def __aenter__(self) -> "Runtime":
        global _current
        loop = asyncio._get_running_loop()
        if loop is not None:
            self._backend = "asyncio"
            self._call_soon = loop.call_soon
            self._loop = loop
            self._run_queue = RunQueue.on(loop)
            self._schedule = self._run_queue.scheduler() if self._run_queue is not None else _call_soon_drain(loop.call_soon)
        else:
            self._loop = None
            self._backend = "trio"
            self._call_soon = soon = _TrioSoon()
            self._schedule = _call_soon_drain(soon)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        if self._backend == "trio":
            self._task_group.start_soon(soon.run)
        self._previous, _current = _current, self
        _future.bind_loop(self._loop, self._run_queue)
        _clock._state.wakeup = self._wake_timers
        self._timer_wake = anyio.Event()
        self._task_group.start_soon(self._timer_loop)
        self.metrics.gauge("runtime/processes", lambda: len(self._processes), "processes in this runtime")
        if self._listen is not None:
            try:
                self._network = await Network.start(self, self._listen, self._limits, self._task_group)
            except BaseException:
                await self.__aexit__(None, None, None)
                raise
        return self

    @property
    def address(self) -> str | None:
        """The bound ``"host:port"`` (port 0 resolved to the one bound); None when not listening."""
        return self._network.address if self._network is not None else None

    async def __aexit__(self, *exc: Any) -> None:
        global _current
        try:
            while self._processes:  # finalize may spawn or still be running
                for pid in list(self._processes):
                    self.terminate(pid, inject=True)
                for proc in list(self._processes.values()):
                    await proc._termination()
            if self._network is not None:
                await self._network.aclose()
        finally:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(None, None, None)
            _current = self._previous
            if _current is not None:
                _future.bind_loop(_current._loop, _current._run_queue)
            else:
                _future.bind_loop(None)
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
        """``runtime.spawn`` on this runtime: register and start ``process``."""
        if process._runtime is not None:
            raise Failure(f"Process {process.pid} was already spawned")
        pid = process._pid
        if self._network is not None and pid.host is None:
            pid = self._network.local(pid)
        existing = self._processes.get(pid)
        if existing is not None:
            raise Failure(f"A process with id {pid} is already running: give each live process a unique id")
        process._pid = pid
        process._runtime = self
        process._wake = wake = self._schedule
        if self._run_queue is not None:
            process._context = contextvars.copy_context()
        self._processes[pid] = process
        process._mailbox.appendleft((_initialize_event, (), None, None))
        process._scheduled = True
        wake(process)
        return pid

    def _enqueue(self, proc: Process, fn: Any, args: tuple, kwargs: dict | None, future: Future | None) -> None:
        proc._mailbox.append((fn, args, kwargs, future))
        if not proc._scheduled:
            proc._scheduled = True
            proc._wake(proc)

    def dispatch(self, pid: PID, method: Callable[..., Any], args: tuple, kwargs: dict) -> Future:
        """``runtime.dispatch`` on this runtime (``args`` and ``kwargs`` as given)."""
        proc = self._processes.get(pid)
        if proc is None and self._network is not None:
            proc = self._lookup(pid)
        if proc is None or proc._state is not RUNNING:
            return Future.failed(ProcessTerminated(f"Process {pid} is not running; cannot dispatch {_name(method)}"))
        future = Future()
        if self._filters and self._filter_dispatch(pid, method, args, kwargs, future):
            return future
        proc._mailbox.append((method, args, kwargs, future))
        if not proc._scheduled:
            proc._scheduled = True
            proc._wake(proc)
        return future

    def terminate(self, pid: PID, inject: bool = True) -> None:
        """``runtime.terminate`` on this runtime."""
        proc = self._processes.get(pid)
        if proc is None:
            proc = self._lookup(pid)
        if proc is None or proc._state is not RUNNING:
            return
        proc._state = TERMINATING
        event = (_terminate_marker, (), None, None)
        if inject:
            mailbox = proc._mailbox
            if mailbox and mailbox[0][0] is _initialize_event:
                mailbox.insert(1, event)  # initialize still runs first
            else:
                mailbox.appendleft(event)
        else:
            proc._mailbox.append(event)
        if not proc._scheduled:
            proc._scheduled = True
            proc._wake(proc)

    def wait(self, pid: PID) -> Future[None]:
        """READY once ``pid`` has finalized; at once when it is unknown."""
        proc = self._processes.get(pid)
        if proc is None:
            proc = self._lookup(pid)
            if proc is None:
                return Future.ready(None)
        return proc._termination()

    def send(self, to: PID, name: str, body: Any, from_: PID | None = None) -> None:
        """``runtime.send`` on this runtime; ``from_`` is the sender the receiver sees."""
        proc = self._processes.get(to)
        if proc is not None and proc._state is RUNNING and not self._filters:
            # the common case, a tell to a local running process: one mailbox
            # entry (decoded on delivery, in the mailbox's order: handlers
            # installed by initialize() see messages sent right after spawn)
            proc._mailbox.append((_message_event, name, body, from_))
            if not proc._scheduled:
                proc._scheduled = True
                proc._wake(proc)
            return
        if proc is None:
            if self._remote(to, "send to"):
                self._network.send(to, name, body, from_)
                return
            proc = self._lookup(to)
        if proc is None or proc._state is not RUNNING:
            self._count_dropped(1)
            logger.warning("Message %r to %s dropped: process is not running", name, to)
            return
        if self._filters and self._filter_message(to, name, body, from_):
            return
        proc._mailbox.append((_message_event, name, body, from_))
        if not proc._scheduled:
            proc._scheduled = True
            proc._wake(proc)

    def _count_dropped(self, n: int) -> None:
        """``n`` messages dropped (their process is not running): counted in
        ``runtime/messages/dropped`` (registered on the first drop)."""
        self.metrics.counter(DROPPED, DROPPED_HELP).inc(n)

    def _lookup(self, pid: PID) -> Process | None:
        """The local process ``pid`` names (with or without our address)."""
        proc = self._processes.get(pid)
        if proc is None and self._network is not None and pid.host is None:
            proc = self._processes.get(self._network.local(pid))
        return proc

    def _remote(self, pid: PID, what: str) -> bool:
        """True when ``pid`` is at another address (an error off the network)."""
        if pid.host is None:
            return False
        if self._network is None:
            raise Failure(f"Cannot {what} {pid}: this runtime is not on the network; create it with Runtime(listen='host:port')")
        return self._network.is_remote(pid)

    # -- async methods ----------------------------------------------------
    def _start_async(self, proc: Process, coro: Any, future: Future | None, hold: bool) -> bool:
        """Start an async method; True when the drain may go on at once.

        Under asyncio (not for an async ``initialize``) the process steps
        the method itself (``_step``) and serves its next event in the same
        loop turn. Otherwise a task runs it and resumes the drain after its
        first step."""
        proc._held = hold  # an async initialize holds the mailbox (settle: idle)
        if self._backend == "asyncio" and not hold:
            self._step(proc, coro, future)
            return True
        if self._backend == "asyncio":
            task = self._loop.create_task(self._run_async(proc, coro, future, hold, None))
            proc._tasks[task] = (future, coro)
        else:
            handle = _TrioHandle()
            proc._tasks[handle] = (future, coro)
            self._task_group.start_soon(self._run_async, proc, coro, future, hold, handle)
        return False

    def _step(self, proc: Process, coro: Any, future: Future | None) -> None:
        """Run an async method (asyncio) on its process up to its next
        suspension, inside the drain. Awaiting a pending runtime Future
        parks it: once that Future completes, a mailbox event
        (``_resume_event``) steps it again -- the libprocess continuation,
        with no task, no loop future and no extra loop turn. Awaiting
        anything else hands it to a task (``_Continuation``) that drives it
        to the end. A method that ends completes its Future here."""
        parking = _future._parking
        parking[0] = True
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            if future is not None:
                complete(future, stop.value)
            return
        except (KeyboardInterrupt, SystemExit):
            proc._wake(proc)  # the rest of the mailbox still runs
            raise
        except BaseException as e:  # noqa: BLE001 - every Future completes
            _async_failed(proc, coro, future, e)
            return
        finally:
            parking[0] = False
        if type(yielded) is _Park:
            proc._tasks[coro] = (future, coro)
            yielded.future.on_any(_resumer(self, proc, coro))
            return
        task = self._loop.create_task(_Continuation(proc, coro, yielded, future))
        proc._tasks[task] = (future, coro)

    async def _run_async(self, proc: Process, coro: Any, future: Future | None, hold: bool, handle: Any) -> None:
        if handle is not None and handle.cancelled:  # trio: terminated before it started
            coro.close()
            return
        if not hold:
            proc._wake(proc)
        key = handle if handle is not None else asyncio.current_task()
        try:
            if handle is None:
                try:
                    result = await coro
                except asyncio.CancelledError:
                    if proc._state is TERMINATED:
                        return  # cancelled by termination: its Future already failed
                    # cancelled from inside (it awaited something cancelled):
                    # its Future must still complete.
                    raise Failure(f"Process {proc.pid}: {_name(coro)} was cancelled") from None
            else:
                scope = handle.scope = anyio.CancelScope()
                with scope:
                    result = await coro
                if scope.cancelled_caught:
                    return
        except Exception as e:
            proc._failures += 1
            if future is not None:
                future._complete(FAILED, e)
            else:
                logger.error("Process %s: async event %s failed", proc.pid, _name(coro), exc_info=e)
            if hold:
                logger.error("Process %s: initialize failed; terminating it", proc.pid)
                proc._held = False
                proc._tasks.pop(key, None)
                proc._terminate_now()
                return
        except BaseException as e:  # e.g. KeyboardInterrupt: still, every Future completes
            if future is not None:
                future._complete(FAILED, Failure(f"Process {proc.pid}: {_name(coro)} was interrupted by {type(e).__name__}"))
            raise
        else:
            if future is not None:
                complete(future, result)
        finally:
            proc._tasks.pop(key, None)
        if hold:
            proc._held = False
            if proc._state is not TERMINATED:
                proc._wake(proc)

    def _cancel_task(self, handle: Any) -> None:
        if type(handle) is _CoroutineType:  # parked by ``_step``: cancel it now
            _cancel_parked(self, handle)
            return
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
                proc._finalized()

        if self._backend == "asyncio":
            # called from the drain (a loop callback, no current task), where
            # anyio's task group cannot start tasks
            task = self._loop.create_task(_run())
            self._finalizers.add(task)
            task.add_done_callback(self._finalizers.discard)
        else:
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
            if (proc._scheduled or proc._mailbox) and not proc._held:
                return False
        return True

    async def settle(self) -> None:
        """Return once every process is idle (``Clock.settle`` on this runtime)."""
        quiet = 0
        while quiet < 4:
            await anyio.sleep(0)
            quiet = quiet + 1 if self._idle() else 0

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per process: state, queue depth, events handled, failures."""
        return {str(pid): proc.stats() for pid, proc in self._processes.items()}

    def processes(self) -> list[PID]:
        """The PIDs of the processes running now."""
        return list(self._processes)


def _call_soon_drain(call_soon: Callable[..., Any]) -> Callable[[Process], None]:
    """The scheduler where there is no run queue: ``call_soon`` the drain."""

    def schedule(proc: Process) -> None:
        call_soon(proc._drain)

    return schedule


def _resumer(rt: Runtime, proc: Process, coro: Any) -> Callable[[Future], None]:
    """The callback that queues the resumption of a parked async method."""

    def resume(_future: Future) -> None:
        if proc._state is not TERMINATED and coro in proc._tasks:
            rt._enqueue(proc, _resume_event, (coro,), None, None)

    return resume


def _resume_event(proc: Process, coro: Any) -> None:
    """A mailbox event: step a parked async method again (see ``Runtime._step``)."""
    entry = proc._tasks.pop(coro, None)
    if entry is not None:
        proc._runtime._step(proc, coro, entry[0])


def _cancel_parked(rt: Runtime, coro: Any) -> None:
    """Termination: throw ``CancelledError`` into a parked async method (its
    Future is failed by the caller); one that awaits again while handling it
    is driven on by a task, as a cancelled task would be."""
    try:
        yielded = coro.throw(asyncio.CancelledError())
    except BaseException:  # noqa: BLE001 - it ended: nothing more to do
        return
    rt._loop.create_task(_Continuation(_Detached(), coro, yielded, None))


# -- module functions (the libprocess free functions) -----------------------
def spawn(process: Process) -> PID:
    """Register and start ``process``; returns its PID."""
    return current_runtime().spawn(process)


def dispatch(pid: PID, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Queue ``method(process, *args, **kwargs)`` on ``pid``; a Future of its result."""
    rt = _current
    if rt is None:
        return Future.failed(ProcessTerminated(f"No runtime is running; cannot dispatch {_name(method)} to {pid}"))
    proc = rt._processes.get(pid)
    if proc is not None and proc._state is RUNNING and not rt._filters:
        # Runtime.dispatch's common case, here without a second call
        future = Future()
        proc._mailbox.append((method, args, kwargs, future))
        if not proc._scheduled:
            proc._scheduled = True
            proc._wake(proc)
        return future
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
    rt = _current
    if rt is None:
        current_runtime()  # raises: no runtime is running
    rt.send(to, name, body, from_)


def defer(pid: PID, fn: Callable[..., Any]) -> Callable[..., Future]:
    """A callable that dispatches ``fn(*args)`` onto ``pid`` when called."""

    def call(_process: Process, *args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "deferred")  # what filters see

    def deferred(*args: Any) -> Future:
        rt = _current
        proc = rt._lookup(pid) if rt is not None else None
        if proc is not None and is_class_function(type(proc), fn):
            return dispatch(pid, fn, *args)
        return dispatch(pid, call, *args)

    return deferred


def delay(seconds: float, pid: PID, method: Callable[..., Any], *args: Any) -> Timer:
    """Dispatch ``method(*args)`` to ``pid`` after ``seconds`` on the Clock."""
    return Clock.timer(seconds, lambda: dispatch(pid, method, *args))


def snapshot() -> dict[str, dict[str, Any]]:
    """Introspection of the current runtime's processes as a plain dict."""
    return current_runtime().snapshot()
