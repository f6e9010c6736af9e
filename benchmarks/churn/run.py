"""The entry point: arguments, one measurement a backend, the output.

Rules:
- ``main(argv)`` parses the arguments (bad ones: exit 2 with one line),
  refuses a ``--cgroups-root`` that already exists in a chosen backend's
  hierarchy (never adopt, and then remove, cgroups that are not ours),
  measures each backend (``measure_backend``; a backend that cannot run
  here is a row saying why), prints the table and the JSON line, and
  returns 0 (130 on Ctrl-C).
- Whatever happens, the cgroups root is removed from every chosen kernel
  hierarchy at the end.
- ``--workers`` is a comma list of worker counts (default ``64,1``: the
  busy node, and one container at a time); each count is a table of its
  own, one row a backend, and each row says its ``workers``.
- ``measure_backend`` runs ``--repeat`` repetitions, each in a fresh
  runtime on a fresh ``SimulatedNode``: the floor(s) right before a
  warm-up, the hop census (``hops.census``: a ``gpus:1`` and a ``gpus:0``
  lifecycle's hops per call, one lifecycle at a time) and the timed
  isolator churn, with hops counted (``hops_per_lifecycle``); the row holds
  the medians, and the census of the median repetition
  (``hops_per_verb``).
- CPU per lifecycle (``cpu_us_per_lifecycle``: the event loop, the other
  threads, the device worker process; ``floor_cpu_us_per_lifecycle`` and
  ``floor_cached_cpu_us_per_lifecycle``) is the median of each figure over
  the repetitions.
- The node ledger (SPEC 22; ``--ledger off|on|both``, default off): with
  ``on`` every repetition's node has a node ledger of its own (a fresh
  directory under ``/dev/shm`` when that is a memory filesystem, as
  ``/run`` is on a real node; else under the temp dir), removed after it.
  ``both`` measures each backend with the ledger off, then on, in the same
  run: the ``on`` row has ``ledger: "on"``, ``ledger_ratio`` (its median
  lifecycles/s over the ``off`` row's; the bar is 0.95) and
  ``ledger_jobs_per_lifecycle`` (the ledger's executor jobs per lifecycle
  in the timed run). The JSON's ``lease_us`` (``ledger.lease_cost_us``)
  is the file work of one lease taken and returned, alone in its batch:
  what a grant pays when its front door does not hold the unit's lease yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import uuid
from typing import Any, Sequence

from actors.devices import DeviceRule, default_hierarchy
from actors.flags import DEVICE_WORKERS, NODE_BACKENDS
from isolators.simulated_node import SimulatedNode, backend_unavailable, remove_cgroup_tree
from runtime import Runtime

from .floor import floor_v1, floor_v2
from .hops import HopCounter, census
from .ledger import lease_cost_us, ledger_jobs, node_ledger_dir, removed
from .report import Progress, format_table, peak_rss_mb, worker_peak_rss_mb
from .workload import GPUS, ChurnRun, churn

BACKENDS = NODE_BACKENDS
ROOT_PREFIX = "gpu-isolator-bench-"
DEFAULT_WORKERS = (64, 1)
CENSUS_LIFECYCLES = 20


def _control_rules(node: SimulatedNode) -> list[DeviceRule]:
    """The control devices every container is granted (a simulated node
    without device nodes takes their numbers from its host file)."""
    return [DeviceRule.parse(f"c {numbers} rwm") for numbers in node.components.inventory.control_devices.values()]


async def measure_backend(backend: str, args: argparse.Namespace, cgroups_root: str,
                          progress: Progress, workers: int | None = None, ledger: bool = False) -> dict[str, Any]:
    """``--repeat`` repetitions of (floor, isolator) on one backend with
    ``workers`` workers (default: the first of ``args.workers``), the node
    ledger on when ``ledger``; the summary row."""
    if workers is None:
        workers = args.workers[0] if isinstance(args.workers, list) else args.workers
    jobs: list[float] = []
    runs: list[ChurnRun] = []
    floors: list[ChurnRun] = []
    cached_floors: list[ChurnRun] = []
    worker_rss: list[float | None] = []
    hierarchy = default_hierarchy(backend)
    warmup = min(0.5, max(0.05, args.seconds / 10))
    for rep in range(args.repeat):
        tag = f"{backend}{' ledger' if ledger else ''} {workers}w {rep + 1}/{args.repeat}"
        ledger_dir = node_ledger_dir() if ledger else None
        extra: dict[str, Any] = {"device_worker": args.device_worker}
        if ledger_dir is not None:
            extra["node_ledger"] = os.path.join(ledger_dir, "ledger")
        async with Runtime(), removed(ledger_dir):
            node = SimulatedNode(backend=backend, gpus=GPUS, cgroups_root=cgroups_root, extra=extra)
            async with node:
                if hierarchy is not None:
                    control = _control_rules(node)
                    floor = floor_v1 if backend == "cgroups_v1" else floor_v2
                    floors.append(floor(hierarchy, cgroups_root, control, workers, args.seconds,
                                        lambda f, n: progress.show(f"{tag} floor", f, n)))
                    if backend == "cgroups_v2":
                        cached_floors.append(floor_v2(
                            hierarchy, cgroups_root, control, workers, args.seconds,
                            lambda f, n: progress.show(f"{tag} floor (programs cached)", f, n), cached=True))
                await churn(node.isolator, workers, seconds=warmup, prefix="w")
                with HopCounter(node.isolator.devices) as hops:
                    progress.show(f"{tag} hop census", 0.0, 0, force=True)
                    per_verb = {f"gpus:{gpus}": await census(node.isolator, hops, gpus, CENSUS_LIFECYCLES)
                                for gpus in (1, 0)}
                    jobs_before = await ledger_jobs(node)
                    run = await churn(node.isolator, workers, seconds=args.seconds, hops=hops,
                                      progress=lambda f, n: progress.show(f"{tag} isolator", f, n))
                    if ledger and run.lifecycles:
                        jobs.append((await ledger_jobs(node) - jobs_before) / run.lifecycles)
                run.hops_per_verb = per_verb
                runs.append(run)
                worker_rss.append(worker_peak_rss_mb())
    progress.clear()
    row = summary_row(backend, runs, floors, cached_floors, worker_rss)
    if ledger:
        row["ledger"] = "on"
        row["ledger_jobs_per_lifecycle"] = round(statistics.median(jobs), 4) if jobs else None
    return {"backend": row.pop("backend"), "workers": workers, **row}


def summary_row(backend: str, runs: list[ChurnRun], floors: list[ChurnRun], cached_floors: list[ChurnRun],
                worker_rss: list[float | None]) -> dict[str, Any]:
    """One backend's row: medians over the repetitions (the ratio is the
    median of each repetition's isolator/floor ratio); latencies and counts
    of the median repetition."""
    rates = [run.per_second for run in runs]
    middle = runs[sorted(range(len(runs)), key=lambda i: rates[i])[len(runs) // 2]]
    row: dict[str, Any] = {
        "backend": backend,
        "lifecycles_per_s": round(statistics.median(rates), 1),
        "runs_per_s": [round(r, 1) for r in rates],
        "latency_us": middle.percentiles_us(),
        "peak_rss_mb": peak_rss_mb(),
        "worker_peak_rss_mb": max((r for r in worker_rss if r is not None), default=None),
        "lifecycles": middle.lifecycles,
        "gpu_lifecycles": middle.gpu_lifecycles,
        "device_ops_per_batch": round(middle.device_operations / middle.device_batches, 1)
        if middle.device_batches else None,
        "errors": sum(len(run.errors) for run in runs),
    }
    row["cpu_us_per_lifecycle"] = _median_cpu(runs)
    counted = [run.hops_per_lifecycle() for run in runs if run.hops is not None]
    if counted:
        row["hops_per_lifecycle"] = round(statistics.median(counted), 2)
    if middle.hops_per_verb is not None:
        row["hops_per_verb"] = middle.hops_per_verb
    errors = [e for run in runs for e in run.errors]
    if errors:
        row["first_error"] = errors[0]
    if floors:
        floor_rates = [f.per_second for f in floors]
        row["floor_per_s"] = round(statistics.median(floor_rates), 1)
        row["floor_runs_per_s"] = [round(r, 1) for r in floor_rates]
        row["ratio"] = round(statistics.median(r / f for r, f in zip(rates, floor_rates)), 3)
        row["floor_cpu_us_per_lifecycle"] = _median_loop_cpu(floors)
    if cached_floors:
        cached_rates = [f.per_second for f in cached_floors]
        row["floor_cached_per_s"] = round(statistics.median(cached_rates), 1)
        row["ratio_cached"] = round(statistics.median(r / f for r, f in zip(rates, cached_rates)), 3)
        row["floor_cached_cpu_us_per_lifecycle"] = _median_loop_cpu(cached_floors)
    return row


def _median_cpu(runs: list[ChurnRun]) -> dict[str, float | None] | None:
    """Each CPU figure per lifecycle, the median over the repetitions that measured it."""
    figures = [f for f in (run.cpu_us_per_lifecycle() for run in runs) if f is not None]
    if not figures:
        return None
    medians: dict[str, float | None] = {}
    for key in figures[0]:
        values = [f[key] for f in figures if f[key] is not None]
        medians[key] = round(statistics.median(values), 1) if values else None
    return medians


def _median_loop_cpu(floors: list[ChurnRun]) -> float | None:
    """The floor's CPU per lifecycle (all of it on its one thread), median."""
    figures = _median_cpu(floors)
    return figures["loop"] if figures is not None else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.churn",
        description="Concurrent container churn through the GPU isolator, against the raw-kernel floor.",
    )
    parser.add_argument("--workers", type=_counts, default=list(DEFAULT_WORKERS),
                        help="concurrent workers, a comma list: one table each (default 64,1; workers 0-7 use a GPU)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="seconds per backend per repetition, for the isolator and for the floor (default 2)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma list of memory, cgroups_v1, cgroups_v2 (default: all; kernel ones need root)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the median is reported (default 3)")
    parser.add_argument("--device-worker", choices=DEVICE_WORKERS, default="process",
                        help="where the kernel device work runs (the isolator's --device_worker; default process)")
    parser.add_argument("--ledger", choices=("off", "on", "both"), default="off",
                        help="the node ledger: off (default), on, or both (off then on, each backend; the on row"
                             " says its ratio to off)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.add_argument("--cgroups-root", default=None,
                        help="cgroups root for the kernel backends, removed at the end"
                             f" (default: {ROOT_PREFIX}<random hex>); it must not exist yet")
    return parser


def _counts(text: str) -> list[int]:
    """``--workers``: ``64,1`` -> [64, 1] (each must be a number; checked >= 1 in ``main``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()] or [0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts like 64,1, got {text!r}") from None


async def _measure_all(backends: list[str], args: argparse.Namespace, cgroups_root: str,
                       progress: Progress) -> list[dict[str, Any]]:
    rows = []
    for workers in args.workers:
        for backend in backends:
            reason = backend_unavailable(backend)
            if reason is not None:
                rows.append({"backend": backend, "workers": workers, "skipped": reason})
                continue
            off = None
            if args.ledger in ("off", "both"):
                off = await measure_backend(backend, args, cgroups_root, progress, workers)
                rows.append(off)
            if args.ledger in ("on", "both"):
                on = await measure_backend(backend, args, cgroups_root, progress, workers, ledger=True)
                if off is not None and off["lifecycles_per_s"]:
                    on["ledger_ratio"] = round(on["lifecycles_per_s"] / off["lifecycles_per_s"], 3)
                rows.append(on)
    return rows


def _remove_root(backend: str, cgroups_root: str) -> None:
    hierarchy = default_hierarchy(backend)
    if hierarchy is None or os.geteuid() != 0:
        return
    try:
        remove_cgroup_tree(os.path.join(hierarchy, cgroups_root))
    except OSError as error:
        print(f"churn: could not remove cgroup {error.filename}: {error.strerror}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        parser.error(f"unknown backend(s) {unknown or args.backends!r}: choose from {', '.join(BACKENDS)}")
    if min(args.workers) < 1 or args.seconds <= 0 or args.repeat < 1:
        shown = ",".join(map(str, args.workers))
        parser.error(f"need --workers >= 1, --seconds > 0 and --repeat >= 1, got workers={shown}"
                     f" seconds={args.seconds} repeat={args.repeat}")
    cgroups_root = args.cgroups_root or ROOT_PREFIX + uuid.uuid4().hex[:12]
    for backend in backends:  # never adopt (and then remove) cgroups that are not ours
        hierarchy = default_hierarchy(backend)
        if hierarchy is not None and os.path.exists(os.path.join(hierarchy, cgroups_root)):
            parser.error(f"cgroups root {os.path.join(hierarchy, cgroups_root)} already exists:"
                         " choose another --cgroups-root")
    progress = Progress(not args.no_progress)
    start_rss = peak_rss_mb()
    try:
        rows = asyncio.run(_measure_all(backends, args, cgroups_root, progress))
    except KeyboardInterrupt:
        progress.clear()
        print("churn: interrupted", file=sys.stderr)
        return 130
    finally:
        for backend in backends:  # whatever an interruption or error left behind
            _remove_root(backend, cgroups_root)
    if not args.json_only:
        print("\n\n".join(format_table([row for row in rows if row["workers"] == workers], workers,
                                         args.device_worker) for workers in args.workers))
    print(json.dumps({
        "benchmark": "container_churn",
        "workers": args.workers[0],
        "gpu_workers": min(GPUS, args.workers[0]),
        "worker_counts": args.workers,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "device_worker": args.device_worker,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "peak_rss_mb_before": start_rss,
        "ledger": args.ledger,
        **({"lease_us": lease_cost_us()} if args.ledger != "off" else {}),
        "results": rows,
    }))
    return 0
