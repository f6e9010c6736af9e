"""Sequence: run callbacks one after another (libprocess ``process::Sequence``).

Rules (libprocess ``process/sequence.hpp``):
- ``add(fn, *args)`` registers a callback and returns a Future of its result.
  ``fn(*args)`` is invoked once every callback added before it is DONE (its
  Future READY, FAILED or DISCARDED), never earlier; the next one is invoked
  only once this one's Future is done. So callbacks run in the order they
  were added, one at a time, whatever each of them waits on.
- ``fn`` returns a value or a Future (followed: the returned Future completes
  like it). An exception from ``fn`` fails its Future; it never stops the
  sequence. A coroutine is refused (a ``TypeError`` fails the Future): the
  sequence cannot run one; pass a callable that dispatches it to a process
  (``defer(pid, method)``, ``lambda: dispatch(pid, method, ...)``).
- An idle sequence (nothing running, nothing waiting) invokes ``fn`` at once,
  inside ``add``; otherwise ``fn`` is invoked by whatever code completes the
  previous callback's Future, like a Future callback (libprocess hops to a
  sequence process here; this runtime is single-threaded, so no hop is
  needed). A continuation of a process's own state must therefore be a
  deferred or dispatching callable, as everywhere in the runtime.
- Discarding a returned Future is a request, as for every Future: before
  ``fn`` was invoked, ``fn`` is never invoked and the Future becomes
  DISCARDED when its turn comes (callbacks after it still wait for every
  earlier one); once invoked, the request passes to the Future ``fn``
  returned, and the next callback waits for that Future to be done.
- ``close()`` is libprocess' destruction of a Sequence: every callback not yet
  invoked is never invoked and its Future becomes DISCARDED at once; the one
  running goes on and its Future completes as it would have. ``add`` on a
  closed sequence returns a DISCARDED Future and never invokes ``fn``.
- A callback that calls ``add`` on its own sequence queues behind itself.
- ``claim()`` / ``release()`` (beyond libprocess: the fast path of a process
  that runs the first call itself, as the current event, with no Future and
  no hop): ``claim`` takes an idle sequence and returns True, and every
  ``add`` then waits as for a running callback until ``release``; a sequence
  that is not idle is not taken (False): ``add`` the work instead.
- ``on_idle`` (optional, beyond libprocess) is called with no argument each
  time the sequence becomes idle (nothing running, nothing waiting) after an
  ``add`` or a callback's completion: keyed users (one sequence per
  container, say) drop the sequence there, so that their map does not grow
  with every key ever seen.
- Callbacks are invoked in a loop, never recursively: a long chain of
  callbacks that complete at once does not deepen the stack.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from ._future import PENDING, Future, Promise

__all__ = ["Sequence"]


class Sequence:
    """Serializes callbacks: each runs after every earlier one is done (see the rules)."""

    __slots__ = ("_running", "_waiting", "_advancing", "_closed", "_on_idle")

    def __init__(self, on_idle: Callable[[], Any] | None = None) -> None:
        self._running: Future[Any] | None = None
        """The Future of the callback invoked last, while it is pending."""
        self._waiting: deque[tuple[Promise[Any], Callable[..., Any], tuple]] = deque()
        """Callbacks not yet invoked, oldest first."""
        self._advancing = False
        self._closed = False
        self._on_idle = on_idle

    def add(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """A Future of ``fn(*args)``, invoked once every earlier callback is done."""
        if self._closed:
            return _discarded()
        if self._running is None and not self._waiting and not self._advancing:
            self._advancing = True  # an ``add`` from inside ``fn`` waits for it
            try:
                result = _invoke(fn, args)
            finally:
                self._advancing = False
            if result._state is PENDING:
                self._running = result
                result.on_any(self._done)
            else:
                self._advance()
            return result
        promise: Promise[Any] = Promise()
        self._waiting.append((promise, fn, args))
        return promise.future

    def claim(self) -> bool:
        """If idle, take the sequence for work the caller runs itself: True,
        and every ``add`` waits until ``release()``. False (nothing taken)
        when a callback is running or waiting: ``add`` the work instead."""
        if self._running is not None or self._waiting or self._advancing or self._closed:
            return False
        self._running = _CLAIMED
        return True

    def release(self) -> None:
        """End the work ``claim`` took the sequence for; what waits starts."""
        if self._running is _CLAIMED:
            self._running = None
            self._advance()

    def is_idle(self) -> bool:
        """True when no callback is running or waiting."""
        return self._running is None and not self._waiting

    def __len__(self) -> int:
        """Callbacks running or waiting."""
        return len(self._waiting) + (self._running is not None)

    def close(self) -> None:
        """Never invoke the callbacks still waiting: their Futures become
        DISCARDED; the running one goes on (see the rules)."""
        self._closed = True
        waiting, self._waiting = self._waiting, deque()
        for promise, _fn, _args in waiting:
            promise.discard()

    @property
    def closed(self) -> bool:
        return self._closed

    def _done(self, _future: Future[Any]) -> None:
        """The running callback's Future is done: on to the next ones."""
        self._running = None
        self._advance()

    def _advance(self) -> None:
        """Invoke waiting callbacks until one is pending or none is left, in a
        loop (callbacks that complete at once do not recurse); then, if idle,
        tell ``on_idle``."""
        if self._advancing:
            return  # the loop further up this stack goes on
        self._advancing = True
        try:
            while self._running is None and self._waiting:
                promise, fn, args = self._waiting.popleft()
                if promise.future.has_discard() or promise.future._state is not PENDING:
                    promise.discard()
                    continue
                result = _invoke(fn, args)
                promise.associate(result)  # a done result completes it now
                if result._state is PENDING:
                    self._running = result
                    result.on_any(self._done)
        finally:
            self._advancing = False
        if self._running is None and not self._waiting and self._on_idle is not None:
            self._on_idle()


_CLAIMED: Future[Any] = Future()
"""Stands for the work of a ``claim`` while it runs (never completed)."""


def _invoke(fn: Callable[..., Any], args: tuple) -> Future[Any]:
    """``fn(*args)`` as a Future (its Future, its value, or its exception)."""
    try:
        result = fn(*args)
    except Exception as error:
        return Future.failed(error)
    if isinstance(result, Future):
        return result
    if hasattr(result, "__await__") and hasattr(result, "close"):  # a coroutine: never run here
        result.close()
        return Future.failed(TypeError(
            f"Sequence.add: {getattr(fn, '__qualname__', fn)!r} returned a coroutine, which a sequence cannot"
            " run; pass a callable that dispatches it to a process (defer(pid, method))"
        ))
    return Future.ready(result)


def _discarded() -> Future[Any]:
    promise: Promise[Any] = Promise()
    promise.discard()
    return promise.future
