"""CPU time: what each lifecycle costs the event loop, the other threads and the device worker.

Rules:
- ``CpuClock.read(worker_pid)`` takes one reading: this thread's CPU time
  (the event loop's, where the churn runs), this process's (every thread)
  and the device worker process's (None without one). ``since(earlier)``
  gives the seconds between two readings as a ``CpuUse``: loop, other
  threads (process minus loop: the executor threads, a device thread) and
  the worker (None when there was none, or another one took its place
  meanwhile: a restarted worker's time is not comparable).
- A process's CPU time is read from ``/proc/<pid>/schedstat`` (nanoseconds
  on the CPU, every thread), else ``/proc/<pid>/stat`` (user + system
  ticks). CPU time is what a lifecycle costs whatever else runs on the
  machine; wall-clock rates swing with the load, CPU per lifecycle much less.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used so far (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as handle:
            return int(handle.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None


class CpuUse(NamedTuple):
    """CPU seconds spent between two readings."""

    loop: float
    other_threads: float
    worker: float | None


class CpuClock(NamedTuple):
    """One reading (see the module rules)."""

    thread: float
    process: float
    worker_pid: int | None
    worker: float | None

    @classmethod
    def read(cls, worker_pid: int | None = None) -> "CpuClock":
        worker = process_cpu_seconds(worker_pid) if worker_pid is not None else None
        return cls(time.thread_time(), time.process_time(), worker_pid, worker)

    def since(self, earlier: "CpuClock") -> CpuUse:
        loop = self.thread - earlier.thread
        worker = None
        if self.worker_pid is not None and self.worker_pid == earlier.worker_pid \
                and self.worker is not None and earlier.worker is not None:
            worker = self.worker - earlier.worker
        return CpuUse(loop, max(0.0, self.process - earlier.process - loop), worker)
