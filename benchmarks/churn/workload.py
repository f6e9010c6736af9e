"""The isolator churn: concurrent workers looping container lifecycles.

Rules:
- ``churn(isolator, workers, seconds=... | lifecycles=...)`` runs
  ``workers`` loops at once; workers below ``gpu_workers`` ask for one GPU,
  the rest for none. A lifecycle is prepare -> usage -> update(gpus:0) ->
  cleanup of a fresh id ``<prefix><worker>-<n>``; each call's latency is
  kept. A failed lifecycle is reported in ``errors``, cleaned up, and not
  counted.
- With ``seconds`` workers start lifecycles until the deadline; with
  ``lifecycles`` exactly that many are started in all.
- ``ChurnRun.per_second`` = lifecycles completed / time until the last ended.
- ``ChurnRun.cpu`` is the CPU time the run cost (``cpu.CpuUse``: the event
  loop's thread, this process's other threads, the device worker process),
  read right before the first lifecycle and after the last;
  ``cpu_us_per_lifecycle()`` divides it by the lifecycles completed. With a
  ``hops.HopCounter`` installed, ``ChurnRun.hops`` is the run's hops the
  same way (``hops_per_lifecycle()``).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from typing import Any, Callable, Sequence

from isolators import ContainerConfig, ContainerID, Resources

from .cpu import CpuClock, CpuUse

CALLS = ("prepare", "usage", "update", "cleanup")
GPUS = 8


class ChurnRun:
    """One timed churn: lifecycles, elapsed seconds, per-call latencies (s)."""

    def __init__(self) -> None:
        self.lifecycles = 0
        self.gpu_lifecycles = 0
        self.elapsed = 0.0
        self.latency: dict[str, array] = {call: array("d") for call in CALLS}
        self.errors: list[str] = []
        self.device_batches = 0
        self.device_operations = 0
        self.cpu: CpuUse | None = None
        self.hops: Any = None
        """The run's ``hops.Hops`` when a counter was given."""
        self.hops_per_verb: dict[str, Any] | None = None
        """Per kind of lifecycle, each call's hops one at a time (``hops.census``)."""

    @property
    def per_second(self) -> float:
        return self.lifecycles / self.elapsed if self.elapsed > 0 else 0.0

    def cpu_us_per_lifecycle(self) -> dict[str, float | None] | None:
        """µs of CPU per lifecycle: ``loop``, ``other_threads``, ``device_worker``
        (None without a worker process); None before the run was measured."""
        if self.cpu is None or not self.lifecycles:
            return None
        per = 1e6 / self.lifecycles
        worker = self.cpu.worker
        return {"loop": round(self.cpu.loop * per, 1), "other_threads": round(self.cpu.other_threads * per, 1),
                "device_worker": round(worker * per, 1) if worker is not None else None}

    def hops_per_lifecycle(self) -> float | None:
        """Hops (see ``hops``) per lifecycle completed; None when not counted."""
        if self.hops is None or not self.lifecycles:
            return None
        return round(self.hops.hops / self.lifecycles, 2)

    def percentiles_us(self) -> dict[str, dict[str, float]]:
        result = {}
        for call, samples in self.latency.items():
            ordered = sorted(samples)
            result[call] = {"p50": _quantile_us(ordered, 0.50), "p99": _quantile_us(ordered, 0.99)}
        return result


def _quantile_us(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return 0.0
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 1)


async def churn(
    isolator: Any,
    workers: int,
    seconds: float | None = None,
    lifecycles: int | None = None,
    gpu_workers: int = GPUS,
    progress: Callable[[float, int], None] | None = None,
    prefix: str = "c",
    hops: Any = None,
) -> ChurnRun:
    """Run ``workers`` concurrent lifecycle loops (see module rules)."""
    if (seconds is None) == (lifecycles is None):
        raise ValueError("churn needs exactly one of seconds or lifecycles")
    run = ChurnRun()
    clock = time.perf_counter
    with_gpu = ContainerConfig(resources=Resources.parse("gpus:1"))
    without_gpu = ContainerConfig(resources=Resources.parse("gpus:0"))
    no_gpus = Resources.parse("gpus:0")
    started = [0]
    devices = isolator.devices
    worker_pid = getattr(devices, "worker_pid", None)
    hops_start = hops.read() if hops is not None else None
    cpu_start = CpuClock.read(worker_pid)
    start = clock()
    deadline = start + seconds if seconds is not None else None
    prepare_lat, usage_lat, update_lat, cleanup_lat = (run.latency[c] for c in CALLS)
    batches0, operations0 = getattr(devices, "batches", 0), getattr(devices, "operations", 0)

    def more() -> bool:
        if deadline is not None:
            return clock() < deadline
        if started[0] < lifecycles:  # type: ignore[operator]
            started[0] += 1
            return True
        return False

    async def worker(index: int) -> None:
        config = with_gpu if index < gpu_workers else without_gpu
        gpu = index < gpu_workers
        n = 0
        while more():
            cid = ContainerID(f"{prefix}{index}-{n}")
            n += 1
            t0 = clock()
            try:
                await isolator.prepare(cid, config)
                t1 = clock()
                await isolator.usage(cid)
                t2 = clock()
                await isolator.update(cid, no_gpus)
                t3 = clock()
                await isolator.cleanup(cid)
                t4 = clock()
            except Exception as error:  # report, clean up, keep churning
                run.errors.append(f"{cid}: {type(error).__name__}: {error}")
                await isolator.cleanup(cid)
                continue
            prepare_lat.append(t1 - t0)
            usage_lat.append(t2 - t1)
            update_lat.append(t3 - t2)
            cleanup_lat.append(t4 - t3)
            run.lifecycles += 1
            if gpu:
                run.gpu_lifecycles += 1

    async def report() -> None:
        while True:
            await asyncio.sleep(0.2)
            if seconds is not None:
                progress((clock() - start) / seconds, run.lifecycles)  # type: ignore[misc]
            else:
                progress(run.lifecycles / lifecycles, run.lifecycles)  # type: ignore[misc,operator]

    reporter = asyncio.get_running_loop().create_task(report()) if progress is not None else None
    try:
        await asyncio.gather(*(worker(i) for i in range(workers)))
    finally:
        if reporter is not None:
            reporter.cancel()
    run.elapsed = clock() - start
    run.cpu = CpuClock.read(getattr(devices, "worker_pid", None)).since(cpu_start)
    if hops is not None:
        run.hops = hops.read().since(hops_start)
    run.device_batches = getattr(devices, "batches", 0) - batches0
    run.device_operations = getattr(devices, "operations", 0) - operations0
    return run
