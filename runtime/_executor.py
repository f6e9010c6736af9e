"""Executor: runs blocking calls off the event loop.

Rules:
- ``await executor.run(fn, *args)`` runs ``fn(*args)`` on one of at most
  ``max_workers`` threads and returns its result or raises its exception,
  unchanged. The event loop never blocks.
- Cancelling the awaiting task stops waiting at once; a call that has not
  started is not run, one that has started finishes in its thread and its
  result is dropped.
- Under asyncio a ``ThreadPoolExecutor`` is used (one hop ~20-70 µs on these
  machines); under trio, ``anyio.to_thread`` with a capacity limiter.
- ``Clock.settle()`` waits for running executor jobs (``in_flight()``),
  except those of a ``background`` executor: a job that waits for the
  outside world by design (e.g. NVML health events, seconds a wait) would
  otherwise keep every settle from returning.
- Batch work: one ``run`` per container operation or per drained mailbox,
  never one per line written.
- ``executor_jobs()`` counts the jobs started so far, across all executors
  (each one a hop the awaiting task waits on: benchmarks count them).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_in_flight = [0]
_started = [0]


def in_flight() -> int:
    """How many executor jobs are running now, across all executors."""
    return _in_flight[0]


def executor_jobs() -> int:
    """How many executor jobs were started so far, across all executors."""
    return _started[0]


class Executor:
    """A bounded pool of threads for blocking calls (see module rules)."""

    def __init__(self, max_workers: int = 4, name: str = "executor", *, background: bool = False) -> None:
        if max_workers < 1:
            raise ValueError(f"Executor needs max_workers >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self.background = background
        """Jobs that wait on the outside world: ``Clock.settle()`` does not wait for them."""
        self._pool: ThreadPoolExecutor | None = None
        self._limiter: Any = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in a worker thread and return its result."""
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        loop = asyncio._get_running_loop()
        counted = 0 if self.background else 1
        _in_flight[0] += counted
        _started[0] += 1
        try:
            if loop is not None:
                pool = self._pool
                if pool is None:
                    pool = self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix=self.name)
                return await loop.run_in_executor(pool, fn, *args)
            import anyio

            if self._limiter is None:
                self._limiter = anyio.CapacityLimiter(self.max_workers)
            # abandon_on_cancel: the caller stops waiting at once (module rules)
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter, abandon_on_cancel=True)
        finally:
            _in_flight[0] -= counted

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker threads (a later ``run`` starts new ones)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
