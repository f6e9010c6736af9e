"""Hops: the wake-ups a lifecycle costs the event loop, from other threads and processes.

Rules:
- A hop is a hand-off the event loop waits on and that wakes it from
  outside: a call from another thread (``loop.call_soon_threadsafe``: an
  executor job's completion is one, and so is any other thread that wakes
  the loop) and a batch sent to the device worker process (its answer
  wakes the loop through the pipe). ``HopCounter`` counts them on the
  running loop (it wraps ``call_soon_threadsafe`` on that loop object while
  installed), with the runtime's count of executor jobs
  (``runtime.executor_jobs``) and device control's of worker batches
  (``DeviceControl.worker_batches``).
- ``HopCounter.read()`` is a ``Hops`` reading; ``later.since(earlier)`` the
  hops between two. ``hops`` = other-thread calls + worker batches;
  ``executor_jobs`` and ``other_threads`` (thread calls that are not an
  executor job's completion) say where the thread calls came from.
- ``census(isolator, counter, gpus, lifecycles)``: that many lifecycles of
  one kind (``gpus:1`` or ``gpus:0``), one after the other, and the hops of
  each call per lifecycle (the mean: deterministic, as nothing else runs).
  Under concurrency hops are shared (group commit), so the churn reports
  per verb only from the census, and per lifecycle from the timed run.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from isolators import ContainerConfig, ContainerID, Resources
from runtime import executor_jobs

from .workload import CALLS


class Hops(NamedTuple):
    """Counts so far (see the module rules)."""

    thread_calls: int
    executor_jobs: int
    worker_batches: int

    def since(self, earlier: "Hops") -> "Hops":
        return Hops(*(now - then for now, then in zip(self, earlier)))

    @property
    def hops(self) -> int:
        return self.thread_calls + self.worker_batches

    def per(self, lifecycles: int) -> dict[str, float]:
        """Each figure per lifecycle, rounded as the report shows it."""
        def mean(value: int) -> float:
            return round(value / lifecycles, 2) if lifecycles else 0.0

        return {"hops": mean(self.hops), "executor_jobs": mean(self.executor_jobs),
                "worker_round_trips": mean(self.worker_batches),
                "other_thread_wakeups": mean(max(0, self.thread_calls - self.executor_jobs))}


class HopCounter:
    """Counts hops on the running loop while installed (a context manager)."""

    def __init__(self, devices: Any) -> None:
        self._devices = devices
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = 0

    def __enter__(self) -> "HopCounter":
        loop = self._loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None:
            del self._loop.call_soon_threadsafe  # the class's method again
            self._loop = None

    def read(self) -> Hops:
        return Hops(self._calls, executor_jobs(), getattr(self._devices, "worker_batches", 0))


async def census(isolator: Any, counter: HopCounter, gpus: int, lifecycles: int = 20,
                 prefix: str = "h") -> dict[str, dict[str, float]]:
    """Hops of each call of a ``gpus:<gpus>`` lifecycle, one at a time (see module rules)."""
    config = ContainerConfig(resources=Resources.parse(f"gpus:{gpus}"))
    no_gpus = Resources.parse("gpus:0")
    totals = {call: Hops(0, 0, 0) for call in CALLS}

    for n in range(lifecycles):
        cid = ContainerID(f"{prefix}{gpus}-{n}")
        calls = {"prepare": lambda: isolator.prepare(cid, config), "usage": lambda: isolator.usage(cid),
                 "update": lambda: isolator.update(cid, no_gpus), "cleanup": lambda: isolator.cleanup(cid)}
        for call in CALLS:
            before = counter.read()
            await calls[call]()
            step = counter.read().since(before)
            totals[call] = Hops(*(a + b for a, b in zip(totals[call], step)))
    return {call: totals[call].per(lifecycles) for call in CALLS}
