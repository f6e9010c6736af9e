"""What the churn benchmark shows: a progress line, the table, memory figures.

Rules:
- ``Progress`` is one ``\\r`` line on stderr (what runs, a bar of its time,
  lifecycles so far), at most five updates a second; ``clear()`` wipes it.
- ``format_table(rows, workers, device_worker)``: a header naming the
  setup, one row a backend (lifecycles/s, floor/s, ratio, p50/p99 µs of
  each call, peak RSS), then the CPU each lifecycle cost (µs: the event
  loop, the other threads, the device worker process, and the floor's),
  the worker's peak RSS, the cached v2 floor and failed lifecycles where
  there are any, and the hops (``hops``): per lifecycle in the timed run,
  and each call's of a ``gpus:1`` and a ``gpus:0`` lifecycle one at a time
  (``prepare 1 (worker 1)``: one hop, a round trip to the device worker;
  ``executor``: jobs in an executor thread; ``thread``: other threads'
  wake-ups); a skipped backend says why.
- A row with the node ledger on is named ``<backend>+ledger`` and says its
  ratio to the same backend with the ledger off and the ledger's jobs per
  lifecycle.
- ``peak_rss_mb()``: this process's high-water mark; ``worker_peak_rss_mb()``:
  the largest high-water mark among this process's children (the device
  worker; None when there is none).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

from .workload import CALLS, GPUS


class Progress:
    """One ``\\r`` line on stderr: what runs, a bar of its time, lifecycles so far."""

    WIDTH = 24

    def __init__(self, enabled: bool, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._last = 0.0
        self._shown = False

    def show(self, label: str, fraction: float, count: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        fraction = min(max(fraction, 0.0), 1.0)
        done = int(fraction * self.WIDTH)
        bar = "#" * done + "." * (self.WIDTH - done)
        self.stream.write(f"\r{label:<34} [{bar}] {fraction * 100:5.1f}%  {count:>9,} lifecycles ")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * 90 + "\r")
            self.stream.flush()
            self._shown = False


def peak_rss_mb() -> float:
    """The process's peak resident set so far, in MiB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def worker_peak_rss_mb() -> float | None:
    """The largest peak resident set (MiB) among this process's live children
    (the device worker process), None without one."""
    me = str(os.getpid())
    peaks = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == me and "VmHWM" in fields:
            peaks.append(int(fields["VmHWM"].split()[0]) / 1024)
    return round(max(peaks), 1) if peaks else None


def format_table(rows: list[dict[str, Any]], workers: int, device_worker: str = "process") -> str:
    header = (f"{'backend':<11} {'lifecycles/s':>12} {'floor/s':>9} {'ratio':>6}  "
              + "  ".join(f"{call + ' p50/p99 µs':>22}" for call in CALLS) + f"  {'peak RSS':>9}")
    lines = [f"container churn, {workers} workers ({min(GPUS, workers)} with gpus:1), simulated {GPUS}-GPU node,"
             f" device work in a {device_worker}",
             header, "-" * len(header)]
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['backend']:<11} skipped: {row['skipped']}")
            continue
        floor = f"{row['floor_per_s']:>9,.0f}" if "floor_per_s" in row else f"{'-':>9}"
        ratio = f"{row['ratio']:>6.2f}" if "ratio" in row else f"{'-':>6}"
        cells = "  ".join(
            f"{row['latency_us'][c]['p50']:>10,.0f} / {row['latency_us'][c]['p99']:>9,.0f}" for c in CALLS
        )
        name = row["backend"] + ("+ledger" if row.get("ledger") == "on" else "")
        lines.append(f"{name:<11} {row['lifecycles_per_s']:>12,.0f} {floor} {ratio}  {cells}"
                     f"  {row['peak_rss_mb']:>6.1f} MiB")
        if row.get("ledger") == "on":
            versus = (f"{row['ledger_ratio']:.3f} of the same backend with the ledger off; "
                      if "ledger_ratio" in row else "")
            lines.append(f"{'':<11} node ledger on: {versus}{row.get('ledger_jobs_per_lifecycle')} ledger jobs per"
                         " lifecycle")
        cpu = _cpu_line(row)
        if cpu:
            lines.append(f"{'':<11} {cpu}")
        hops = _hops_line(row)
        if hops:
            lines.append(f"{'':<11} {hops}")
        if row.get("worker_peak_rss_mb") is not None:
            lines.append(f"{'':<11} device worker process: peak RSS {row['worker_peak_rss_mb']:.1f} MiB")
        if "floor_cached_per_s" in row:
            lines.append(f"{'':<11} {'':>12} {row['floor_cached_per_s']:>9,.0f} {row['ratio_cached']:>6.2f}"
                         "  (floor with programs loaded once, as the device layer caches them)")
        if row.get("errors"):
            lines.append(f"{'':<11} {row['errors']} failed lifecycles, first: {row.get('first_error')}")
    return "\n".join(lines)


def _cpu_line(row: dict[str, Any]) -> str:
    """``CPU µs per lifecycle: loop 70.1, other threads 1.2, device worker 80.4; floor 60.2 ...``"""
    cpu = row.get("cpu_us_per_lifecycle")
    if not cpu:
        return ""
    parts = [f"loop {cpu['loop']:,.1f}", f"other threads {cpu['other_threads']:,.1f}"]
    if cpu.get("device_worker") is not None:
        parts.append(f"device worker {cpu['device_worker']:,.1f}")
    text = "CPU µs per lifecycle: " + ", ".join(parts)
    floors = []
    if row.get("floor_cpu_us_per_lifecycle") is not None:
        floors.append(f"floor {row['floor_cpu_us_per_lifecycle']:,.1f}")
    if row.get("floor_cached_cpu_us_per_lifecycle") is not None:
        floors.append(f"cached floor {row['floor_cached_cpu_us_per_lifecycle']:,.1f}")
    return text + ("; " + ", ".join(floors) if floors else "")


_SOURCES = (("worker_round_trips", "worker"), ("executor_jobs", "executor"), ("other_thread_wakeups", "thread"))


def _hops_line(row: dict[str, Any]) -> str:
    """``hops per lifecycle 3.00; one at a time, gpus:1: prepare 1 (worker 1), usage 0, ...``"""
    if "hops_per_lifecycle" not in row:
        return ""
    text = f"hops per lifecycle {row['hops_per_lifecycle']:.2f}"
    kinds = []
    for kind, calls in (row.get("hops_per_verb") or {}).items():
        cells = []
        for call in CALLS:
            figures = calls[call]
            sources = ", ".join(f"{name} {figures[key]:g}" for key, name in _SOURCES if figures[key])
            cells.append(f"{call} {figures['hops']:g}" + (f" ({sources})" if sources else ""))
        kinds.append(f"{kind}: " + ", ".join(cells))
    return text + ("; one at a time, " + "; ".join(kinds) if kinds else "")
