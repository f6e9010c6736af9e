"""The interleaved rounds, the medians and the bars.

Rules:
- ``Counts``: how much one run of each workload does (the same for every
  contender): ``n`` round trips (sequential, and shared by ``width``
  concurrent callers), ``actors`` for the fan-out, run ``batches`` times
  in a row, ``tells`` messages (in bursts of ``burst``, 0: all at once),
  ``rounds`` rounds. One warm-up run of each workload (a tenth of the
  counts) per contender comes first and is not counted.
- A round runs each workload once for every contender, in round-robin
  order (the contenders rotated by the round's number, so none always
  runs first or last). Before each run the garbage collector runs (not
  timed), so no run pays for the garbage of the one before it; within a
  fan-out run the collector is on, as an application has it, and its
  batches run back to back, each timed: what one batch leaves to the
  collector is paid by a later one (the slowest batch shows it).
- A run's figures: operations per second of wall-clock time, and CPU
  microseconds per operation (``time.process_time``: every thread of this
  process, so a framework's own threads count). Each figure is the median
  over the rounds; ``ratio`` is the runtime's median ÷ the contender's.
  A fan-out also reports its batches: the median batch rate, the slowest
  one and the slowest ÷ the median.
- Bars (the issues' "Must show"): against the Queue actor, tells >= 1.0,
  sequential >= 1.5, 100 callers >= 1.1, fan-out >= 1.5; against the
  Queue actor that handles a tell inline, tells >= 1.0; the runtime's
  slowest fan-out batch >= 0.5 of its median batch; against every peer
  framework held to a bar, >= 2.0 on every workload it runs.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, NamedTuple

from ..reporting import round_robin
from .contender import WORKLOADS, Contender

QUEUE_BARS = {"tells": 1.0, "sequential": 1.5, "callers": 1.1, "fan_out": 1.5}
QUEUE_KEYS = ("queue", "queue_inline")  # the hand-written baselines, held to QUEUE_BARS
PEER_BAR = 2.0
SLOWEST_BATCH_BAR = 0.5  # the runtime's slowest fan-out batch ÷ its median batch


class Counts(NamedTuple):
    n: int
    width: int
    actors: int
    tells: int
    rounds: int
    batches: int = 5
    burst: int = 0

    def ops(self, workload: str) -> int:
        if workload == "callers":
            return (self.n // self.width) * self.width
        return {"sequential": self.n, "fan_out": self.actors * self.batches, "tells": self.tells}[workload]

    def warmup(self) -> "Counts":
        return Counts(max(self.width, self.n // 10), self.width, max(1, self.actors // 10),
                      max(1, self.tells // 10), 1, 1, self.burst)


async def run_once(contender: Contender, workload: str, counts: Counts) -> tuple[float, float, list[float]]:
    """One timed run: (operations per second, CPU µs per operation, each
    fan-out batch's actors per second)."""
    ops = counts.ops(workload)
    batch_rates: list[float] = []
    gc.collect()
    cpu = time.process_time()
    start = time.perf_counter()
    if workload == "sequential":
        await contender.sequential(counts.n)
    elif workload == "callers":
        await contender.callers(counts.n, counts.width)
    elif workload == "fan_out":
        for _ in range(counts.batches):
            batch_start = time.perf_counter()
            await contender.fan_out(counts.actors)
            batch_rates.append(counts.actors / (time.perf_counter() - batch_start))
    else:
        await contender.tells(counts.tells, counts.burst)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return ops / seconds, cpu / ops * 1e6, batch_rates


async def measure(contenders: list[Contender], counts: Counts) -> dict[str, dict[str, dict[str, list[float]]]]:
    """``{key: {workload: {"rates": [...], "cpu_us": [...]}}}`` over the rounds."""
    samples = {c.key: {w: {"rates": [], "cpu_us": [], "batches": []} for w in c.workloads} for c in contenders}
    warmup = counts.warmup()
    for contender in contenders:
        for workload in contender.workloads:
            await run_once(contender, workload, warmup)
    for i in range(counts.rounds):
        for workload in WORKLOADS:
            for contender in round_robin(contenders, i):
                if workload in contender.workloads:
                    rate, cpu_us, batch_rates = await run_once(contender, workload, counts)
                    samples[contender.key][workload]["rates"].append(rate)
                    samples[contender.key][workload]["cpu_us"].append(cpu_us)
                    samples[contender.key][workload]["batches"].extend(batch_rates)
    return samples


def summarise(samples: dict[str, dict[str, dict[str, list[float]]]], ours: str = "runtime") -> dict[str, dict[str, Any]]:
    """Medians and ratios: ``{key: {workload: {ops_per_s, cpu_us_per_op, ratio, runs}}}``."""
    medians = {key: {w: statistics.median(s["rates"]) for w, s in per.items()} for key, per in samples.items()}
    result: dict[str, dict[str, Any]] = {}
    for key, per in samples.items():
        result[key] = {}
        for workload, s in per.items():
            mine = medians.get(ours, {}).get(workload)
            theirs = medians[key][workload]
            result[key][workload] = {
                "ops_per_s": round(theirs),
                "cpu_us_per_op": round(statistics.median(s["cpu_us"]), 2),
                "ratio": round(mine / theirs, 3) if mine is not None else None,
                "runs": [round(x) for x in s["rates"]],
            }
            if s.get("batches"):
                median, slowest = statistics.median(s["batches"]), min(s["batches"])
                result[key][workload]["batches"] = {"median": round(median), "slowest": round(slowest),
                                                    "slowest_to_median": round(slowest / median, 3)}
    return result


def bars(summary: dict[str, dict[str, Any]], contenders: list[Contender]) -> list[dict[str, Any]]:
    """Each bar the issue sets: against whom, which workload, the ratio, the need, met or not."""
    rows = []
    batches = summary.get("runtime", {}).get("fan_out", {}).get("batches")
    if batches:
        ratio = batches["slowest_to_median"]
        rows.append({"against": "runtime", "workload": "fan_out_slowest", "ratio": ratio,
                     "need": SLOWEST_BATCH_BAR, "met": ratio >= SLOWEST_BATCH_BAR})
    for contender in contenders:
        if contender.key == "runtime" or not contender.bar:
            continue
        for workload in contender.workloads:
            need = QUEUE_BARS[workload] if contender.key in QUEUE_KEYS else PEER_BAR
            ratio = summary[contender.key][workload]["ratio"]
            rows.append({"against": contender.key, "workload": workload, "ratio": ratio, "need": need,
                         "met": ratio is not None and ratio >= need})
    return rows
