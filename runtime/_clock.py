"""Clock: the runtime's single source of time, and its timers.

Rules (libprocess ``process/clock.hpp``):
- Every runtime timer (``delay``, ``Future.after``, ``Clock.timer``) reads this
  clock. ``Clock.now()`` is monotonic seconds.
- ``Clock.pause()`` freezes time; ``Clock.advance(s)`` moves frozen time
  forward and fires, synchronously and in deadline order, every timer that
  falls due; ``Clock.resume()`` returns to real time, continuing from the
  frozen instant (time never jumps back), and due timers fire.
- ``await Clock.settle()`` returns once every process of the current runtime
  is idle with an empty mailbox and no executor job is running (a method
  suspended in an ``await`` counts as idle; so does a process whose async
  ``initialize`` is suspended, though events wait behind it).
- A cancelled timer never fires; cancelling a fired timer is a no-op.
- Leaving a ``Runtime`` scope resumes the clock and drops its timers.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Timer:
    """A scheduled callback; ``cancel()`` stops it from firing."""

    __slots__ = ("deadline", "_fn", "cancelled", "fired")

    def __init__(self, deadline: float, fn: Callable[[], Any]) -> None:
        self.deadline = deadline
        self._fn = fn
        self.cancelled = False
        self.fired = False

    def cancel(self) -> bool:
        """Stop the timer; True if it had not fired yet."""
        if self.fired or self.cancelled:
            return False
        self.cancelled = True
        return True


class _ClockState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.paused = False
        self.frozen = 0.0
        self.offset = 0.0
        self.heap: list[tuple[float, int, Timer]] = []
        self.seq = itertools.count()
        self.wakeup: Callable[[], None] | None = None

    def now(self) -> float:
        if self.paused:
            return self.frozen
        return time.monotonic() + self.offset

    def fire_due(self) -> None:
        now = self.now()
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, timer = heapq.heappop(heap)
            if timer.cancelled:
                continue
            timer.fired = True
            try:
                timer._fn()
            except Exception:
                logger.exception("Timer callback %r raised", timer._fn)

    def next_delay(self) -> float | None:
        while self.heap and self.heap[0][2].cancelled:
            heapq.heappop(self.heap)
        if self.paused or not self.heap:
            return None
        return max(0.0, self.heap[0][0] - self.now())


_state = _ClockState()


class Clock:
    """The runtime clock (all methods are class methods)."""

    @staticmethod
    def now() -> float:
        """Current time in seconds (frozen while paused)."""
        return _state.now()

    @staticmethod
    def paused() -> bool:
        return _state.paused

    @staticmethod
    def pause() -> None:
        """Freeze time; timers fire only through ``advance``."""
        if not _state.paused:
            _state.frozen = _state.now()
            _state.paused = True

    @staticmethod
    def resume() -> None:
        """Return to real time from the frozen instant; due timers fire."""
        if _state.paused:
            _state.offset = _state.frozen - time.monotonic()
            _state.paused = False
            _state.fire_due()
            if _state.wakeup is not None:
                _state.wakeup()

    @staticmethod
    def advance(seconds: float) -> None:
        """Move frozen time forward by ``seconds`` and fire what falls due."""
        if seconds < 0:
            raise ValueError(f"Clock.advance needs a non-negative duration, got {seconds}")
        if not _state.paused:
            raise RuntimeError("Clock.advance() needs a paused clock: call Clock.pause() first")
        _state.frozen += seconds
        _state.fire_due()

    @staticmethod
    def timer(seconds: float, fn: Callable[[], Any]) -> Timer:
        """Call ``fn()`` once ``seconds`` have passed on this clock."""
        timer = Timer(_state.now() + max(0.0, seconds), fn)
        heapq.heappush(_state.heap, (timer.deadline, next(_state.seq), timer))
        if _state.heap[0][2] is timer and _state.wakeup is not None and not _state.paused:
            _state.wakeup()
        return timer

    @staticmethod
    async def settle() -> None:
        """Wait until every process is idle (see the module rules)."""
        from ._runtime import current_runtime

        await current_runtime().settle()
