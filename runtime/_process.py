"""Process: an actor with a mailbox, run one event at a time.

Rules (libprocess ``process/process.hpp``):
- Subclass ``Process``. ``initialize()`` runs before any dispatched event (an
  async ``initialize`` holds the mailbox until it returns); ``finalize()``
  runs once at termination; ``exited(pid)`` runs when a linked process
  terminates. ``self.pid`` is the PID once spawned.
- Events start in arrival order, one at a time. A sync method runs to the end
  inside the drain. An async method holds the process only until its first
  ``await``: its code up to there never interleaves with another event of
  this process; while it waits, later events run (re-check state after an
  ``await``).
- A method's exception fails its Future and the process keeps serving.
- At termination, queued events fail with ``ProcessTerminated`` and async
  methods still suspended are cancelled, their Futures failed the same way;
  queued named messages (which have no Future) are dropped, logged and
  counted in the runtime's ``runtime/messages/dropped``.
- The mailbox is a deque drained by one scheduled callback while the process
  has work (no queue object, no task per idle message). Under asyncio an
  async method's first step (up to its first suspension) runs inside the
  drain: no task for a method that never suspends, and the next event is
  served in the same loop turn. While such a method awaits runtime Futures
  only, each later step is a mailbox event too, queued when the awaited
  Future completes (libprocess runs continuations so; such a step runs in
  the drain, where ``asyncio.current_task()`` is None); awaiting anything
  else hands it to an asyncio task for the rest of the method.
- Named messages: ``install(name, handler, type)`` registers a handler called
  ``handler(from_pid, body)`` for bodies decoding (msgspec) to ``type`` (a
  function of the process's class is called ``handler(process, from_pid,
  body)``, like a dispatched method; so is a method of this very process).
  A message is an event in the mailbox: its body is decoded and its handler
  looked up when it is delivered. A body that does not decode is logged and
  counted, never raised here; a handler that raises is logged and counted
  as a failure. Every delivered message counts as an event handled.
- A message costs one mailbox entry, ``(_message_event, name, body,
  from)``: no Future, no argument tuple; a handler installed with no body
  type (``Any``) is called by the drain itself (a tell: about a deque
  append, plus one scheduled drain when the process was idle).
- Over the network (``Runtime(listen=...)``) the same holds: a message from
  another runtime is the same mailbox event with its sender's PID, and
  ``link`` to a PID at another address gives ``exited(pid)`` when the
  connection to that address breaks or cannot be made. ``type=bytes``
  handlers get the body's bytes as they travel on the wire, locally too
  (``str`` as UTF-8, a Struct or dict as its JSON, ``None`` as ``b""``);
  ``type=Any`` gets a local body as sent and a remote one as bytes.
- ``admit(check)``: every request from another runtime for this process
  (message or route) is first given to ``check(request)`` in the network;
  a ``Response`` it returns is the answer, and the message is not
  delivered nor the route run (a credential check: nothing changes, no
  reply goes anywhere).
- ``route(path, handler, help="")`` serves HTTP requests for
  ``/<id><path>`` (and paths below it without a longer route):
  ``handler(request)`` -- or ``handler(process, request)`` for a function
  of the class -- runs as an event of this process and returns a
  ``Response`` (see ``_http``).
- A process stays registered (its id in use, ``wait`` pending) until its
  ``finalize`` has returned, an async ``finalize`` included; linked
  processes get ``exited`` then.
- What most processes never need costs a live one nothing until it does:
  the set of linked processes, the routes and the Future ``wait`` returns
  are made on first use.
"""

from __future__ import annotations

import inspect
import types
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from ._errors import ProcessTerminated
from ._future import FAILED, PENDING, READY, Future
from ._pid import PID, generate_id
from ._run_queue import TaskWait

if TYPE_CHECKING:
    from ._runtime import Runtime

logger = logging.getLogger(__name__)

_CoroutineType = types.CoroutineType

RUNNING = "running"
TERMINATING = "terminating"
TERMINATED = "terminated"

DROPPED = "runtime/messages/dropped"  # the counter of messages that reached no process
DROPPED_HELP = "messages dropped: their process is not running, or their peer could not be reached or broke"


_FINALIZED: Future[None] = Future.ready(None)  # ``_termination()`` of a process nobody waited for


def _terminate_marker(process: "Process") -> None:  # identity only
    raise AssertionError("unreachable")


def _initialize_event(process: "Process") -> Any:
    return process.initialize()


def _exited_event(process: "Process", pid: PID) -> Any:
    return process.exited(pid)


def _message_event(process: "Process", name: str, body: Any, from_: PID | None) -> Any:
    """Deliver a named message: decode its body, call its handler. In the
    mailbox a message is ``(_message_event, name, body, from_)``: one tuple,
    no argument tuple, no Future (see ``Process._drain``)."""
    decoded = process._decode(name, body)
    if decoded is None:
        return None  # rejected: logged and counted
    handler, value = decoded
    try:
        return handler(process, from_, value)
    except Exception:
        _handler_raised(process, name, from_)
        return None


def _handler_raised(process: "Process", name: str, from_: PID | None) -> None:
    process._failures += 1
    logger.exception("Process %s: handler of message %r from %s raised", process._pid, name, from_)


def wire_bytes(body: Any) -> bytes:
    """A message body as it travels between runtimes: bytes unchanged, str
    as UTF-8, None empty, anything else (a Struct, a dict...) as msgspec
    JSON."""
    if type(body) is bytes:
        return body
    if body is None:
        return b""
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode()
    return msgspec.json.encode(body)


def is_class_function(cls: type, fn: Any) -> bool:
    """True when ``fn`` is a plain function defined on ``cls`` or a base
    (so it is called with the process as its first argument)."""
    name = getattr(fn, "__name__", None)
    if name is None:
        return False
    for klass in cls.__mro__:
        if vars(klass).get(name) is fn:
            return True
    return False


def complete(future: Future, value: Any) -> None:
    """Complete ``future`` with ``value`` (following it when it is a Future)."""
    if isinstance(value, Future):
        if value._state is PENDING:
            value.on_any(lambda f: future._complete(f._state, f._value))
            future.on_discard(value.discard)
        else:
            future._complete(value._state, value._value)
    else:
        future._complete(READY, value)


class Process:
    """Base class of every actor (see module rules)."""

    def __init__(self, id: str | None = None) -> None:
        self._pid = PID(id if id is not None else generate_id(type(self).__name__))
        self._explicit_id = id is not None
        self._mailbox: deque = deque()
        self._scheduled = False
        # the runtime's scheduler, called with this process when it gets work
        # while idle (set at spawn: ``Runtime._schedule``; it holds no process)
        self._wake: Callable[["Process"], None] | None = None
        self._held = False  # an async initialize is suspended, holding the mailbox
        self._state = RUNNING
        self._runtime: "Runtime | None" = None
        self._tasks: dict[Any, tuple[Future, Any]] = {}
        self._handlers: dict[str, tuple[Callable, type]] = {}
        self._remote_check: Callable[[Any], Any] | None = None
        self._handled = 0
        self._failures = 0
        self._rejected = 0
        self._terminated: Future[None] | None = None  # made when first waited for (``_termination``)

    # What most processes never get, shared empty until one does (a live
    # actor costs less memory): linked processes, HTTP routes.
    _linkers: "set[PID] | frozenset[PID]" = frozenset()
    _context: Any = None  # the context its drain runs in on a run queue (set at spawn)
    _routes: "dict[str, tuple[Callable, str]] | types.MappingProxyType" = types.MappingProxyType({})

    # -- hooks ------------------------------------------------------------
    @property
    def pid(self) -> PID:
        return self._pid

    def initialize(self) -> Any:
        """Runs first, before any dispatched event."""

    def finalize(self) -> Any:
        """Runs once at termination."""

    def exited(self, pid: PID) -> Any:
        """Runs when a linked process terminates."""

    # -- links and messages ----------------------------------------------
    def link(self, pid: PID) -> None:
        """Have ``exited(pid)`` dispatched here when ``pid`` terminates
        (at once when it is already gone)."""
        rt = self._runtime
        if rt is None:
            raise RuntimeError(f"Process {self._pid} is not spawned: link from initialize() or a method, not __init__")
        target = rt._lookup(pid)
        if target is None and rt._remote(pid, "link to"):
            rt._network.link(self._pid, pid)  # exited when the connection breaks
            return
        if target is None:  # already gone (or never existed): exited at once
            rt._enqueue(self, _exited_event, (pid,), None, None)
            return
        if type(target._linkers) is frozenset:
            target._linkers = {self._pid}  # notified once it has finalized
        else:
            target._linkers.add(self._pid)

    def install(self, name: str, handler: Callable[..., Any], type: Any = Any) -> None:
        """Handle messages called ``name``; bodies decode to ``type``.

        ``handler(from_pid, body)``, or ``handler(process, from_pid, body)``
        when it is a function of the process's class."""
        if is_class_function(self.__class__, handler):
            fn = handler
        elif isinstance(handler, types.MethodType) and handler.__self__ is self:
            fn = handler.__func__  # a method of this process: called as one, no wrapper
        else:
            def fn(_process: "Process", from_: Any, body: Any) -> Any:
                return handler(from_, body)
            fn.__name__ = getattr(handler, "__name__", name)
        self._handlers[name] = (fn, type)

    def route(self, path: str, handler: Callable[..., Any], help: str = "") -> None:
        """Serve HTTP requests for ``/<id><path>`` with ``handler(request)``
        (``handler(process, request)`` for a function of the class)."""
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"Route path must start with '/', got {path!r}")
        if is_class_function(self.__class__, handler):
            fn = handler
        else:
            def fn(_process: "Process", request: Any) -> Any:
                return handler(request)
            fn.__name__ = getattr(handler, "__name__", "route")
        if type(self._routes) is types.MappingProxyType:
            self._routes = {}
        self._routes[path.rstrip("/") or "/"] = (fn, help)

    def admit(self, check: Callable[[Any], Any] | None) -> None:
        """Give every request from another runtime addressed to this process
        (its messages and its routes) to ``check(request)`` first; a
        ``Response`` it returns is the answer and nothing is delivered (None:
        go on). ``check`` runs in the network, outside the mailbox: it must
        not block or touch the process's state. None removes it."""
        self._remote_check = check

    def send(self, to: PID, name: str, body: Any = None) -> None:
        """Send a named message from this process."""
        self._runtime.send(to, name, body, self._pid)

    # -- the drain --------------------------------------------------------
    def _drain(self) -> None:
        mailbox = self._mailbox
        while mailbox:
            fn, args, kwargs, future = mailbox.popleft()
            if fn is _message_event:  # (_message_event, name, body, from_): a named message
                self._handled += 1
                entry = self._handlers.get(args)
                if entry is not None and entry[1] is Any:  # nothing to decode: call it here
                    try:
                        result = entry[0](self, future, kwargs)
                    except Exception:
                        _handler_raised(self, args, future)
                        continue
                else:
                    result = _message_event(self, args, kwargs, future)
                if type(result) is _CoroutineType:
                    if self._runtime._start_async(self, result, None, hold=False):
                        continue
                    return
                continue
            if fn is _terminate_marker:
                self._terminate_now()
                return
            try:
                if kwargs:
                    result = fn(self, *args, **kwargs)
                elif len(args) == 1:  # a plain call: no argument list built
                    result = fn(self, args[0])
                else:
                    result = fn(self, *args)
            except Exception as e:
                self._handled += 1
                self._failures += 1
                if future is not None:
                    future._complete(FAILED, e)
                else:
                    logger.exception("Process %s: event %s failed", self._pid, getattr(fn, "__name__", fn))
                if fn is _initialize_event:
                    logger.error("Process %s: initialize failed; terminating it", self._pid)
                    self._terminate_now()
                    return
                continue
            self._handled += 1
            if type(result) is _CoroutineType:
                if self._runtime._start_async(self, result, future, hold=fn is _initialize_event):
                    continue  # its first step ran here (asyncio): serve the next event
                return  # the task resumes the drain after its first step
            if future is not None:
                if future._callbacks is None and not isinstance(result, Future):
                    # Future._complete(READY, result) inlined for the common
                    # case (a dispatch's Future is pending until its event
                    # ran): nothing registered but (maybe) one awaiting task;
                    # on_discard callbacks, if any, can no longer run and go
                    # with the Future.
                    future._state = READY
                    future._value = result
                    waiter = future._waiter
                    if waiter is not None:
                        future._waiter = None
                        if type(waiter) is TaskWait:
                            waiter.wake()
                        elif not waiter.done():
                            waiter.set_result(result)
                else:
                    complete(future, result)
        self._scheduled = False

    def _terminate_now(self) -> None:
        if self._state is TERMINATED:
            return
        self._state = TERMINATED
        self._scheduled = False
        rt = self._runtime
        error = None
        dropped = 0
        while self._mailbox:
            fn, _args, _kwargs, future = self._mailbox.popleft()
            if fn is _message_event:  # its last slot is the sender, not a Future
                dropped += 1
            elif future is not None:
                if error is None:
                    error = ProcessTerminated(f"Process {self._pid} terminated before the event ran")
                future._complete(FAILED, error)
        if dropped:
            rt._count_dropped(dropped)
            logger.warning("Process %s terminated: %d queued message(s) dropped", self._pid, dropped)
        tasks = self._tasks
        if tasks:
            self._tasks = {}
        for handle, (future, coro) in tasks.items():
            rt._cancel_task(handle)
            if future is not None:
                future._complete(FAILED, ProcessTerminated(f"Process {self._pid} terminated while the event was waiting"))
            if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()
        try:
            result = self.finalize()
        except Exception:
            logger.exception("Process %s: finalize raised", self._pid)
            result = None
        if type(result) is _CoroutineType:
            rt._start_finalize(self, result)  # calls _finalized when done
        else:
            self._finalized()

    def _finalized(self) -> None:
        """After finalize: unregister, tell linked processes, wake waiters."""
        rt = self._runtime
        if rt._processes.get(self._pid) is self:
            del rt._processes[self._pid]
        linkers = self._linkers
        if linkers:
            self._linkers = frozenset()
            for linker in sorted(linkers):
                proc = rt._processes.get(linker)
                if proc is not None and proc._state is not TERMINATED:
                    rt._enqueue(proc, _exited_event, (self._pid,), None, None)
        if self._terminated is None:
            self._terminated = _FINALIZED  # nobody waited: no Future of its own
        else:
            self._terminated._complete(READY, None)

    def _termination(self) -> Future[None]:
        """READY once this process has finalized (``runtime.wait``)."""
        if self._terminated is None:
            self._terminated = Future()
        return self._terminated

    def _decode(self, name: str, body: Any) -> tuple[Callable, Any] | None:
        entry = self._handlers.get(name)
        if entry is None:
            self._rejected += 1
            logger.error("Process %s: no handler installed for message %r; dropped", self._pid, name)
            return None
        handler, kind = entry
        try:
            if kind is Any:
                value = body
            elif kind is bytes:
                value = wire_bytes(body)
            elif isinstance(body, (bytes, bytearray, memoryview, str)):
                value = msgspec.json.decode(body, type=kind)
            elif isinstance(kind, type) and isinstance(body, kind):
                value = body
            else:
                value = msgspec.convert(body, kind)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, RecursionError) as e:
            self._rejected += 1
            logger.error("Process %s: message %r rejected: body does not decode: %s", self._pid, name, e)
            return None
        return handler, value

    def stats(self) -> dict[str, Any]:
        """Queue depth, events handled, failures and rejected messages."""
        return {
            "state": self._state,
            "queue_depth": len(self._mailbox),
            "events_handled": self._handled,
            "failures": self._failures,
            "messages_rejected": self._rejected,
            "suspended": len(self._tasks),
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._pid}>"
