"""Future and Promise: a value that will be ready, failed or discarded.

Rules (libprocess ``process/future.hpp``):
- A Future starts PENDING and moves once to READY (a value), FAILED (an
  exception) or DISCARDED. Later attempts to complete it are ignored and
  return False.
- Callbacks (``on_ready``, ``on_failed``, ``on_discarded``, ``on_any``) run
  synchronously, in registration order, in whatever code completes the
  Future; one registered on a completed Future runs at once. An exception in
  a callback is logged, never propagated into the completer.
- ``then(fn)``: when READY, ``fn(value)``; a returned Future is followed.
  Failure and discard pass through unchanged. ``recover(fn)``: when FAILED or
  DISCARDED, ``fn(exception)`` supplies the value (or a Future of it).
  ``after(seconds, fn)``: if still pending after ``seconds`` on the runtime
  ``Clock``, ``fn(self)`` supplies the result instead.
- ``discard()`` is a request, not a state change: it marks the Future and
  runs the producer's ``on_discard`` callbacks (``Promise.on_discard``); the
  producer decides whether to call ``Promise.discard()``. Futures derived with
  ``then``/``recover``/``after`` pass a discard request to their source.
- A Future is awaitable under asyncio and trio. Awaiting a READY Future returns
  the value without suspending; FAILED raises the original exception;
  DISCARDED raises ``Discarded``. Cancelling the awaiting task does not discard
  the Future. Under asyncio with the runtime's run queue (``_run_queue``),
  the first task awaiting a PENDING Future waits on the queue's
  ``TaskWait`` and the Future's completion resumes it from the run queue,
  in order with the drains and with no loop turn of its own; a second
  awaiter, and every awaiter where there is no run queue (asyncio's debug
  mode, other loops), first gives the loop one turn (a dispatch to a free
  process is usually done by then) and only then parks on a plain loop
  future. Inside an async method that its
  process steps itself (asyncio), awaiting a PENDING Future suspends the
  method instead, and the process resumes it (a mailbox event) once the
  Future completes. While an asyncio ``Runtime`` is
  current, its Futures are awaited in that runtime's loop (the loop is not
  looked up per await).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Generic, Iterable, TypeVar

from ._errors import Discarded
from ._run_queue import TaskWait

logger = logging.getLogger(__name__)

T = TypeVar("T")

PENDING = "pending"
READY = "ready"
FAILED = "failed"
DISCARDED = "discarded"

_get_running_loop = asyncio._get_running_loop  # None under trio; ~0.2 µs a call
# ``loop.create_future`` of the current asyncio Runtime's loop, set by
# Runtime (bind_loop) so that awaiting skips the running-loop lookup.
_create_waiter: Callable[[], asyncio.Future] | None = None
# The current asyncio Runtime's run queue (None without one): it resumes a
# task awaiting a pending Future (``TaskWait``).
_run_queue: Any = None


_parking = [False]
"""True while a process steps one of its async methods (``Runtime._step``):
awaiting a pending Future then yields a ``_Park`` to that process instead
of parking an asyncio task."""


class _Park:
    """What an async method stepped by its process yields to wait on a Future."""

    __slots__ = ("future",)

    def __init__(self, future: "Future[Any]") -> None:
        self.future = future


def bind_loop(loop: asyncio.AbstractEventLoop | None, run_queue: Any = None) -> None:
    """Awaits use ``loop`` (the current runtime's) without looking it up,
    and its ``run_queue`` (``_run_queue.RunQueue``) when it has one."""
    global _create_waiter, _run_queue
    _create_waiter = loop.create_future if loop is not None else None
    _run_queue = run_queue


class Future(Generic[T]):
    """The result of an asynchronous operation (see the module rules)."""

    __slots__ = ("_state", "_value", "_callbacks", "_waiter", "_discard")

    def __init__(self) -> None:
        self._state = PENDING
        self._value: Any = None
        self._callbacks: list | None = None
        self._waiter: Any = None  # the first asyncio awaiter's loop future
        self._discard: list | bool | None = None
        """None: no discard asked for, no producer callback; a list: the
        producer's ``on_discard`` callbacks, no discard asked for yet; True:
        a discard was asked for."""

    # -- construction ----------------------------------------------------
    @classmethod
    def ready(cls, value: T = None) -> "Future[T]":
        """A Future that is already READY with ``value``."""
        f = cls()
        f._state = READY
        f._value = value
        return f

    @classmethod
    def failed(cls, error: BaseException | str) -> "Future[T]":
        """A Future that already FAILED with ``error`` (a str becomes Failure)."""
        from ._errors import Failure

        f = cls()
        f._state = FAILED
        f._value = Failure(error) if isinstance(error, str) else error
        return f

    # -- state -----------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    def is_pending(self) -> bool:
        return self._state is PENDING

    def is_ready(self) -> bool:
        return self._state is READY

    def is_failed(self) -> bool:
        return self._state is FAILED

    def is_discarded(self) -> bool:
        return self._state is DISCARDED

    def has_discard(self) -> bool:
        """True once somebody asked to discard this Future."""
        return self._discard is True

    def get(self) -> T:
        """The value of a READY Future; raises the failure otherwise."""
        return self._outcome("Future is still pending: await it instead of calling get()")

    result = get

    def failure(self) -> BaseException | None:
        """The exception of a FAILED Future, else None."""
        return self._value if self._state is FAILED else None

    exception = failure

    # -- completion (used by Promise) -------------------------------------
    def _complete(self, state: str, value: Any) -> bool:
        if self._state is not PENDING:
            return False
        self._state = state
        self._value = value
        callbacks = self._callbacks
        if callbacks:
            self._callbacks = None
            for cb in callbacks:
                try:
                    cb(self)
                except Exception:  # a callback never breaks the completer
                    logger.exception("Future callback %r raised", cb)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if type(waiter) is TaskWait:
                waiter.wake()
            elif state is READY and not waiter.done():
                waiter.set_result(value)
            else:
                _wake(waiter, state, value)
        if self._discard is not True:
            self._discard = None  # no discard can reach the producer now
        return True

    # -- callbacks -------------------------------------------------------
    def on_any(self, callback: Callable[["Future[T]"], Any]) -> "Future[T]":
        """Run ``callback(self)`` once this Future leaves PENDING."""
        if self._state is PENDING:
            if self._callbacks is None:
                self._callbacks = [callback]
            else:
                self._callbacks.append(callback)
        else:
            try:
                callback(self)
            except Exception:
                logger.exception("Future callback %r raised", callback)
        return self

    def on_ready(self, callback: Callable[[T], Any]) -> "Future[T]":
        """Run ``callback(value)`` when READY."""
        return self.on_any(lambda f: callback(f._value) if f._state is READY else None)

    def on_failed(self, callback: Callable[[BaseException], Any]) -> "Future[T]":
        """Run ``callback(exception)`` when FAILED."""
        return self.on_any(lambda f: callback(f._value) if f._state is FAILED else None)

    def on_discarded(self, callback: Callable[[], Any]) -> "Future[T]":
        """Run ``callback()`` when DISCARDED."""
        return self.on_any(lambda f: callback() if f._state is DISCARDED else None)

    def on_discard(self, callback: Callable[[], Any]) -> "Future[T]":
        """Run ``callback()`` when a discard is requested (for producers)."""
        discard = self._discard
        if discard is True:
            callback()
        elif self._state is PENDING:
            if discard is None:
                self._discard = [callback]
            else:
                discard.append(callback)
        return self

    def discard(self) -> bool:
        """Request that the producer stop; True if the request was recorded."""
        callbacks = self._discard
        if self._state is not PENDING or callbacks is True:
            return False
        self._discard = True
        for cb in callbacks or ():
            try:
                cb()
            except Exception:
                logger.exception("on_discard callback %r raised", cb)
        return True

    # -- composition -----------------------------------------------------
    def then(self, fn: Callable[[T], Any]) -> "Future[Any]":
        """A Future of ``fn(value)`` once this one is READY (see rules)."""
        promise: Promise[Any] = Promise()

        def _next(f: Future) -> None:
            if f._state is READY:
                try:
                    promise.set_value(fn(f._value))
                except Exception as e:
                    promise.fail(e)
            elif f._state is FAILED:
                promise.fail(f._value)
            else:
                promise.discard()

        promise.future.on_discard(self.discard)
        self.on_any(_next)
        return promise.future

    def recover(self, fn: Callable[[BaseException], Any]) -> "Future[Any]":
        """A Future that is this one's value, or ``fn(exception)`` on failure/discard."""
        promise: Promise[Any] = Promise()

        def _next(f: Future) -> None:
            if f._state is READY:
                promise.set_value(f._value)
                return
            error = f._value if f._state is FAILED else Discarded("Future was discarded")
            try:
                promise.set_value(fn(error))
            except Exception as e:
                promise.fail(e)

        promise.future.on_discard(self.discard)
        self.on_any(_next)
        return promise.future

    def after(self, seconds: float, fn: Callable[["Future[T]"], Any]) -> "Future[Any]":
        """This Future's outcome, or ``fn(self)``'s if ``seconds`` pass first."""
        from ._clock import Clock

        promise: Promise[Any] = Promise()

        def _timeout() -> None:
            if self._state is PENDING and promise.future._state is PENDING:
                try:
                    promise.set_value(fn(self))
                except Exception as e:
                    promise.fail(e)

        timer = Clock.timer(seconds, _timeout)

        def _next(f: Future) -> None:
            timer.cancel()
            promise.associate(f)

        promise.future.on_discard(self.discard)
        self.on_any(_next)
        return promise.future

    # -- awaiting --------------------------------------------------------
    def __await__(self):
        if self._state is PENDING:
            if _parking[0]:
                # A process is stepping the awaiting async method itself
                # (asyncio, ``Runtime._step``): hand it this Future; it resumes
                # the method through its mailbox once the Future completes.
                yield _Park(self)
            else:
                if _run_queue is not None and self._waiter is None:
                    # asyncio with the runtime's run queue: the task waits on a
                    # TaskWait; this Future's completion resumes it from the
                    # run queue (no loop turn, no Handle).
                    wait = self._waiter = TaskWait(_run_queue, self)
                    yield wait
                    return self._outcome()
                if _create_waiter is None and _get_running_loop() is None:  # trio
                    return (yield from self._wait_generic().__await__())
                # asyncio: first give the loop one turn (a bare yield). A
                # dispatch to a free process is usually done by then -- its
                # drain was scheduled before this task -- and no loop future
                # is needed.
                yield
                if self._state is PENDING:
                    # Still pending: wait on an exact loop future (asyncio's C
                    # fast path) that _complete settles with this Future's
                    # outcome.
                    create = _create_waiter
                    waiter = create() if create is not None else _get_running_loop().create_future()
                    if self._waiter is None:
                        self._waiter = waiter
                    else:  # a second awaiter
                        self.on_any(lambda f: _wake(waiter, f._state, f._value))
                    return (yield from waiter)
        return self._outcome()

    def _outcome(self, pending: str = "a pending Future's awaiter was resumed before it completed") -> T:
        """What this completed Future gives (awaited, or ``get()``): its value,
        or raises; a pending one raises RuntimeError(``pending``)."""
        if self._state is READY:
            return self._value
        if self._state is FAILED:
            raise self._value
        if self._state is DISCARDED:
            raise Discarded("Future was discarded")
        raise RuntimeError(pending)

    async def _wait_generic(self) -> Any:
        # trio: park the task until _complete reschedules it (a cancelled
        # wait unregisters itself so it is never rescheduled twice).
        import trio

        lowlevel = trio.lowlevel
        parked = [lowlevel.current_task()]

        def _wake(_f: Future) -> None:
            task = parked[0]
            if task is not None:
                parked[0] = None
                lowlevel.reschedule(task)

        def _abort(_raise_cancel: Any) -> Any:
            parked[0] = None
            return lowlevel.Abort.SUCCEEDED

        self.on_any(_wake)
        if parked[0] is not None:  # not already woken (a completed Future)
            await lowlevel.wait_task_rescheduled(_abort)
        return self.get()

    def __repr__(self) -> str:
        if self._state is PENDING:
            return "<Future pending>"
        return f"<Future {self._state} {self._value!r}>"


def _wake(waiter: asyncio.Future, state: str, value: Any) -> None:
    """Settle an awaiting task's loop future like the runtime Future."""
    if waiter.done():  # the awaiting task was cancelled
        return
    if state is READY:
        waiter.set_result(value)
    elif state is FAILED:
        try:
            waiter.set_exception(value)
        except TypeError:  # StopIteration cannot travel through a future
            waiter.set_exception(RuntimeError(f"Future failed with {value!r}"))
    else:
        waiter.set_exception(Discarded("Future was discarded"))


class Promise(Generic[T]):
    """The producer side of a Future: ``set_value``, ``fail``, ``discard``."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: Future[T] = Future()

    def set_value(self, value: Any = None) -> bool:
        """Complete with ``value``; a Future value is followed (``associate``)."""
        if isinstance(value, Future):
            return self.associate(value)
        return self.future._complete(READY, value)

    def fail(self, error: BaseException | str) -> bool:
        """Complete with a failure (a str becomes ``Failure(str)``)."""
        if isinstance(error, str):
            from ._errors import Failure

            error = Failure(error)
        return self.future._complete(FAILED, error)

    def discard(self) -> bool:
        """Complete as DISCARDED."""
        return self.future._complete(DISCARDED, None)

    def associate(self, other: Future[Any]) -> bool:
        """Complete like ``other`` once it completes; discards pass to it."""
        if self.future._state is not PENDING:
            return False
        target = self.future
        target.on_discard(other.discard)
        other.on_any(lambda f: target._complete(f._state, f._value))
        return True

    def on_discard(self, callback: Callable[[], Any]) -> None:
        """Run ``callback()`` when a consumer asks to discard the Future."""
        self.future.on_discard(callback)


def collect(futures: Iterable[Future[Any]]) -> Future[list[Any]]:
    """READY with every value (in order) once all are READY; the first failure
    (or discard) fails it and discards the rest."""
    futures = list(futures)
    promise: Promise[list[Any]] = Promise()
    if not futures:
        promise.set_value([])
        return promise.future
    remaining = [len(futures)]

    def _one(f: Future) -> None:
        if promise.future._state is not PENDING:
            return
        if f._state is READY:
            remaining[0] -= 1
            if remaining[0] == 0:
                promise.set_value([g._value for g in futures])
        else:
            promise.fail(f._value if f._state is FAILED else Discarded("A collected Future was discarded"))
            for g in futures:
                g.discard()

    promise.future.on_discard(lambda: [g.discard() for g in futures])
    for f in futures:
        f.on_any(_one)
    return promise.future


def await_all(futures: Iterable[Future[Any]]) -> Future[list[Future[Any]]]:
    """READY with the Futures themselves once every one has settled."""
    futures = list(futures)
    promise: Promise[list[Future[Any]]] = Promise()
    remaining = [len(futures)]
    if not futures:
        promise.set_value([])
        return promise.future

    def _one(_f: Future) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            promise.set_value(futures)

    promise.future.on_discard(lambda: [g.discard() for g in futures])
    for f in futures:
        f.on_any(_one)
    return promise.future
