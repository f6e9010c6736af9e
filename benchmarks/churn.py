"""Container churn: the isolator against the kernel's own floor.

Rules of the measurement:
- A simulated 8-GPU node (a host file in a temp dir) and ``--workers``
  concurrent workers (64). Workers 0-7 run GPU containers (``gpus:1``), the
  rest CPU-only ones (``gpus:0``). Each lifecycle is prepare -> usage ->
  update(gpus:0) -> cleanup of a fresh container id, through the isolator's
  public handle. Workers start lifecycles for ``--seconds`` (5) after a
  short warm-up that is not counted; lifecycles/s = lifecycles completed /
  time until the last one ended.
- Backends (``--backends``): ``memory``, ``cgroups_v1``, ``cgroups_v2``. The
  kernel ones need root and their hierarchy (else they are skipped, and
  said so); they use a cgroups root ``gpu-isolator-bench-<hex>`` of their own
  (``--cgroups-root``; an existing one is refused), removed at the end, also
  on Ctrl-C or an error.
- The floor, measured in the same run right before each isolator run, is the
  same kernel work done directly in one synchronous loop, with the same mix
  of GPU and CPU-only containers. v1: mkdir, ``a`` to devices.deny, each
  allow rule of the container's policy (standard set, control devices, its
  GPU) to devices.allow, the GPU's deny (what update(gpus:0) writes), rmdir;
  one open fd per file, one ``write(2)`` per rule. v2: mkdir, load the
  policy's program (verifier included), attach it, for a GPU container load
  and attach (replace) the gpus:0 program, rmdir. v2 also measures
  ``floor_cached``: programs loaded once up front, each lifecycle only
  attaching, as the device layer does by caching programs by policy.
- ``ratio`` = isolator lifecycles/s / floor lifecycles/s, per repetition
  (each pair measured back to back), median of ``--repeat`` (3). Latency
  percentiles (µs, per call) are those of the median repetition. Peak RSS is
  the process's high-water mark (``getrusage``) after that backend's runs
  (``peak_rss_mb_before``: before the first). ``device_ops_per_batch`` is
  how many operations device control applied per executor job (group
  commit).
- ``--device-worker`` (the isolator's ``device_worker`` flag): ``process``
  (default) runs the kernel work in a device worker process, ``thread`` in
  a thread of this process. ``worker_peak_rss_mb`` is the worker process's
  own peak (the table's peak RSS is this process's).
- Output: a table, then one JSON line (``--json-only``: only the JSON
  line). A progress line on stderr while it runs (``--no-progress``).

Run: ``python -m benchmarks.churn [--workers 64] [--seconds 5] [--repeat 3]
[--backends memory,cgroups_v1,cgroups_v2]`` from a source checkout (the benchmarks
are not part of the installed package).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from array import array
from typing import Any, Callable, Sequence

from actors import DeviceRule, Flags, Resources, container_policy
from actors.devices import CgroupDeviceAccess, build_device_program
from actors.devices import _bpf
from actors.devices._cgroups_v1 import plan_writes, v1_exceptions
from actors.devices._detect import default_hierarchy
from isolators import ContainerConfig, ContainerID, NvidiaComponents, NvidiaGpuIsolatorProcess
from runtime import Runtime

BACKENDS = ("memory", "cgroups_v1", "cgroups_v2")
CALLS = ("prepare", "usage", "update", "cleanup")
GPUS = 8
NVIDIA_MAJOR = 195
ROOT_PREFIX = "gpu-isolator-bench-"


# -- progress -------------------------------------------------------------------
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


# -- results ----------------------------------------------------------------------
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

    @property
    def per_second(self) -> float:
        return self.lifecycles / self.elapsed if self.elapsed > 0 else 0.0

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


def peak_rss_mb() -> float:
    """The process's peak resident set so far, in MiB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def worker_peak_rss_mb(devices: Any) -> float | None:
    """The device worker process's peak resident set (MiB), None without one."""
    pid = getattr(getattr(devices, "_process", None), "backend", None)
    pid = getattr(pid, "pid", None)
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


# -- the node -------------------------------------------------------------------
def write_host_file(directory: str, gpus: int = GPUS) -> str:
    """A simulated node of ``gpus`` GPUs; returns the host file's path."""
    path = os.path.join(directory, "host.json")
    with open(path, "w") as f:
        json.dump({"driver_version": "550.54.15", "gpu_count": gpus}, f)
    return path


class ChurnNode:
    """A simulated node with one isolator on ``backend`` (an async context manager).

    Inside a ``runtime.Runtime``. On exit it cleans up what is left, removes
    its cgroups root and its temp dir, and stops the actors."""

    def __init__(self, backend: str, cgroups_root: str | None = None, device_worker: str = "process") -> None:
        self.backend = backend
        self.cgroups_root = cgroups_root or ROOT_PREFIX + uuid.uuid4().hex[:12]
        self.tmp = tempfile.mkdtemp(prefix="gpu-isolator-bench-")
        os.makedirs(os.path.join(self.tmp, "dev"))
        self.flags = Flags(
            host_file=write_host_file(self.tmp),
            dev_dir=os.path.join(self.tmp, "dev"),
            runtime_dir=os.path.join(self.tmp, "run"),
            work_dir=os.path.join(self.tmp, "work"),
            volume_dir=os.path.join(self.tmp, "volume"),
            device_backend=backend,
            cgroups_root=self.cgroups_root,
            device_worker=device_worker,
        )
        self.components: NvidiaComponents | None = None
        self.isolator: Any = None

    @property
    def control_rules(self) -> list[DeviceRule]:
        """The control devices every container is granted."""
        return list(self.isolator.process.control_devices.values())

    async def __aenter__(self) -> "ChurnNode":
        try:
            flags = self.flags
            self.components = await NvidiaComponents.create(flags)
            self.isolator = await NvidiaGpuIsolatorProcess.create(flags, self.components)
            await self.isolator.recover([], set())
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self.isolator is not None:
                try:
                    for cid in list((await self.isolator.containers()).keys()):
                        await self.isolator.cleanup(ContainerID.parse(cid))
                    await self.isolator.devices.remove_root()
                finally:
                    await self.isolator.close()
            if self.components is not None:
                await self.components.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


# -- the isolator churn -----------------------------------------------------------
async def churn(
    isolator: Any,
    workers: int,
    seconds: float | None = None,
    lifecycles: int | None = None,
    gpu_workers: int = GPUS,
    progress: Callable[[float, int], None] | None = None,
    prefix: str = "c",
) -> ChurnRun:
    """Run ``workers`` concurrent lifecycle loops for ``seconds`` or until
    ``lifecycles`` have started; workers below ``gpu_workers`` ask for one GPU."""
    if (seconds is None) == (lifecycles is None):
        raise ValueError("churn needs exactly one of seconds or lifecycles")
    run = ChurnRun()
    clock = time.perf_counter
    with_gpu = ContainerConfig(resources=Resources.parse("gpus:1"))
    without_gpu = ContainerConfig(resources=Resources.parse("gpus:0"))
    no_gpus = Resources.parse("gpus:0")
    started = [0]
    start = clock()
    deadline = start + seconds if seconds is not None else None
    prepare_lat, usage_lat, update_lat, cleanup_lat = (run.latency[c] for c in CALLS)
    devices = isolator.devices
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
    run.device_batches = getattr(devices, "batches", 0) - batches0
    run.device_operations = getattr(devices, "operations", 0) - operations0
    return run


# -- the kernel floor -------------------------------------------------------------
def _policy(control: list[DeviceRule], gpu_minor: int | None) -> CgroupDeviceAccess:
    gpus = [DeviceRule("c", NVIDIA_MAJOR, gpu_minor, "rwm")] if gpu_minor is not None else []
    allow, deny = container_policy(control, gpus)
    return CgroupDeviceAccess.create(allow, deny)


def _timed_loop(body: Callable[[int], None], workers: int, seconds: float,
                progress: Callable[[float, int], None] | None) -> ChurnRun:
    run = ChurnRun()
    clock = time.perf_counter
    start = clock()
    deadline = start + seconds
    i = 0
    while clock() < deadline:
        for _ in range(workers):  # one round: the same GPU / CPU-only mix as the workers
            body(i)
            i += 1
        if progress is not None:
            progress((clock() - start) / seconds, i)
    run.elapsed = clock() - start
    run.lifecycles = i
    return run


def floor_v1(hierarchy: str, cgroups_root: str, control: list[DeviceRule], workers: int,
             seconds: float, progress: Callable[[float, int], None] | None = None) -> ChurnRun:
    """The cgroups v1 floor (see module rules); cgroups under ``<hierarchy>/<cgroups_root>``."""
    root = os.path.join(hierarchy, cgroups_root)
    os.makedirs(root, exist_ok=True)
    gpu_workers = min(GPUS, workers)
    plans = []
    for slot in range(workers):
        minor = slot if slot < gpu_workers else None
        access = _policy(control, minor)
        writes = plan_writes(None, v1_exceptions(access))
        deny_all = [line.encode() for name, line in writes if name == "devices.deny"]
        allows = [line.encode() for name, line in writes if name == "devices.allow"]
        revoke = f"c {NVIDIA_MAJOR}:{minor} rwm".encode() if minor is not None else None
        plans.append((deny_all, allows, revoke))
    mkdir, rmdir, open_, write, close = os.mkdir, os.rmdir, os.open, os.write, os.close
    flags = os.O_WRONLY | os.O_CLOEXEC

    def lifecycle(i: int) -> None:
        deny_all, allows, revoke = plans[i % workers]
        path = f"{root}/floor-{i}"
        mkdir(path)
        deny = open_(path + "/devices.deny", flags)
        allow = open_(path + "/devices.allow", flags)
        for line in deny_all:
            write(deny, line)
        for line in allows:
            write(allow, line)
        if revoke is not None:
            write(deny, revoke)
        close(allow)
        close(deny)
        rmdir(path)

    return _timed_loop(lifecycle, workers, seconds, progress)


def floor_v2(hierarchy: str, cgroups_root: str, control: list[DeviceRule], workers: int,
             seconds: float, progress: Callable[[float, int], None] | None = None,
             cached: bool = False) -> ChurnRun:
    """The cgroups v2 floor (see module rules): a program load per policy
    change, or (``cached``) programs loaded once and only attached."""
    root = os.path.join(hierarchy, cgroups_root)
    os.makedirs(root, exist_ok=True)
    gpu_workers = min(GPUS, workers)
    name = "gpuiso_floor"
    plain = build_device_program(_policy(control, None))
    codes = [build_device_program(_policy(control, slot)) if slot < gpu_workers else None
             for slot in range(workers)]
    loaded: dict[bytes, int] = {}
    if cached:
        for code in [plain, *[c for c in codes if c is not None]]:
            loaded[code] = _bpf.prog_load(code, name)
    mkdir, rmdir, open_, close = os.mkdir, os.rmdir, os.open, os.close
    load, attach = _bpf.prog_load, _bpf.prog_attach
    multi, replace = _bpf.BPF_F_ALLOW_MULTI, _bpf.BPF_F_ALLOW_MULTI | _bpf.BPF_F_REPLACE
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

    def lifecycle(i: int) -> None:
        code = codes[i % workers]
        path = f"{root}/floor-{i}"
        mkdir(path)
        cgroup = open_(path, dir_flags)
        try:
            if cached:
                first = loaded[code if code is not None else plain]
                attach(cgroup, first, multi)
                if code is not None:
                    attach(cgroup, loaded[plain], replace, first)
            else:
                first = load(code if code is not None else plain, name)
                try:
                    attach(cgroup, first, multi)
                    if code is not None:
                        second = load(plain, name)
                        try:
                            attach(cgroup, second, replace, first)
                        finally:
                            close(second)
                finally:
                    close(first)
        finally:
            close(cgroup)
        rmdir(path)

    try:
        return _timed_loop(lifecycle, workers, seconds, progress)
    finally:
        for fd in loaded.values():
            close(fd)


# -- one backend ------------------------------------------------------------------
def kernel_skip_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run here (None when it can)."""
    if backend == "memory":
        return None
    if os.geteuid() != 0:
        return "needs root"
    hierarchy = default_hierarchy(backend)
    marker = "devices.allow" if backend == "cgroups_v1" else "cgroup.controllers"
    if hierarchy is None or not os.path.isfile(os.path.join(hierarchy, marker)):
        return f"no {backend} hierarchy at {hierarchy}"
    return None


def remove_cgroup_tree(path: str) -> None:
    """rmdir ``path`` and every cgroup below it, deepest first (missing: nothing)."""
    if not os.path.isdir(path):
        return
    for directory, _subdirs, _files in sorted(os.walk(path), key=lambda entry: -entry[0].count("/")):
        try:
            os.rmdir(directory)
        except OSError as error:
            print(f"churn: could not remove cgroup {directory}: {error}", file=sys.stderr)


async def measure_backend(backend: str, args: argparse.Namespace, cgroups_root: str,
                          progress: Progress) -> dict[str, Any]:
    """``--repeat`` repetitions of (floor, isolator) on one backend; the summary row."""
    runs: list[ChurnRun] = []
    floors: list[ChurnRun] = []
    cached_floors: list[ChurnRun] = []
    worker_rss: list[float | None] = []
    hierarchy = default_hierarchy(backend)
    warmup = min(0.5, max(0.05, args.seconds / 10))
    for rep in range(args.repeat):
        tag = f"{backend} {rep + 1}/{args.repeat}"
        async with Runtime():
            async with ChurnNode(backend, cgroups_root, args.device_worker) as node:
                if backend != "memory":
                    control = node.control_rules
                    floor = floor_v1 if backend == "cgroups_v1" else floor_v2
                    floors.append(floor(hierarchy, cgroups_root, control, args.workers, args.seconds,
                                        lambda f, n: progress.show(f"{tag} floor", f, n)))
                    if backend == "cgroups_v2":
                        cached_floors.append(floor_v2(
                            hierarchy, cgroups_root, control, args.workers, args.seconds,
                            lambda f, n: progress.show(f"{tag} floor (programs cached)", f, n), cached=True))
                await churn(node.isolator, args.workers, seconds=warmup, prefix="w")
                runs.append(await churn(node.isolator, args.workers, seconds=args.seconds,
                                        progress=lambda f, n: progress.show(f"{tag} isolator", f, n)))
                worker_rss.append(worker_peak_rss_mb(node.isolator.devices))
    progress.clear()
    rates = [run.per_second for run in runs]
    median_index = sorted(range(len(runs)), key=lambda i: rates[i])[len(runs) // 2]
    middle = runs[median_index]
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
    errors = [e for run in runs for e in run.errors]
    if errors:
        row["first_error"] = errors[0]
    if floors:
        floor_rates = [f.per_second for f in floors]
        row["floor_per_s"] = round(statistics.median(floor_rates), 1)
        row["floor_runs_per_s"] = [round(r, 1) for r in floor_rates]
        row["ratio"] = round(statistics.median(r / f for r, f in zip(rates, floor_rates)), 3)
    if cached_floors:
        cached_rates = [f.per_second for f in cached_floors]
        row["floor_cached_per_s"] = round(statistics.median(cached_rates), 1)
        row["ratio_cached"] = round(statistics.median(r / f for r, f in zip(rates, cached_rates)), 3)
    return row


# -- output ---------------------------------------------------------------------------
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
        lines.append(f"{row['backend']:<11} {row['lifecycles_per_s']:>12,.0f} {floor} {ratio}  {cells}"
                     f"  {row['peak_rss_mb']:>6.1f} MiB")
        if row.get("worker_peak_rss_mb") is not None:
            lines.append(f"{'':<11} device worker process: peak RSS {row['worker_peak_rss_mb']:.1f} MiB")
        if "floor_cached_per_s" in row:
            lines.append(f"{'':<11} {'':>12} {row['floor_cached_per_s']:>9,.0f} {row['ratio_cached']:>6.2f}"
                         "  (floor with programs loaded once, as the device layer caches them)")
        if row.get("errors"):
            lines.append(f"{'':<11} {row['errors']} failed lifecycles, first: {row.get('first_error')}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.churn",
        description="Concurrent container churn through the GPU isolator, against the raw-kernel floor.",
    )
    parser.add_argument("--workers", type=int, default=64, help="concurrent workers (default 64; 0-7 use a GPU)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="seconds per backend per repetition, for the isolator and for the floor (default 5)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma list of memory, cgroups_v1, cgroups_v2 (default: all; kernel ones need root)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the median is reported (default 3)")
    parser.add_argument("--device-worker", choices=("process", "thread"), default="process",
                        help="where the kernel device work runs (the isolator's --device_worker; default process)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.add_argument("--cgroups-root", default=None,
                        help="cgroups root for the kernel backends, removed at the end"
                             f" (default: {ROOT_PREFIX}<random hex>); it must not exist yet")
    return parser


async def _measure_all(backends: list[str], args: argparse.Namespace, roots: dict[str, str],
                       progress: Progress) -> list[dict[str, Any]]:
    rows = []
    for backend in backends:
        reason = kernel_skip_reason(backend)
        if reason is not None:
            rows.append({"backend": backend, "skipped": reason})
            continue
        rows.append(await measure_backend(backend, args, roots[backend], progress))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        parser.error(f"unknown backend(s) {unknown or args.backends!r}: choose from {', '.join(BACKENDS)}")
    if args.workers < 1 or args.seconds <= 0 or args.repeat < 1:
        parser.error(f"need --workers >= 1, --seconds > 0 and --repeat >= 1, got workers={args.workers}"
                     f" seconds={args.seconds} repeat={args.repeat}")
    name = args.cgroups_root or ROOT_PREFIX + uuid.uuid4().hex[:12]
    for backend in backends:  # never adopt (and then remove) cgroups that are not ours
        hierarchy = default_hierarchy(backend)
        if hierarchy is not None and os.path.exists(os.path.join(hierarchy, name)):
            parser.error(f"cgroups root {os.path.join(hierarchy, name)} already exists: choose another --cgroups-root")
    roots = {backend: name for backend in backends}
    progress = Progress(not args.no_progress)
    start_rss = peak_rss_mb()
    try:
        rows = asyncio.run(_measure_all(backends, args, roots, progress))
    except KeyboardInterrupt:
        progress.clear()
        print("churn: interrupted", file=sys.stderr)
        return 130
    finally:
        for backend in backends:  # whatever an interruption or error left behind
            hierarchy = default_hierarchy(backend)
            if hierarchy is not None and os.geteuid() == 0:
                remove_cgroup_tree(os.path.join(hierarchy, roots[backend]))
    if not args.json_only:
        print(format_table(rows, args.workers, args.device_worker))
    print(json.dumps({
        "benchmark": "container_churn",
        "workers": args.workers,
        "gpu_workers": min(GPUS, args.workers),
        "seconds": args.seconds,
        "repeat": args.repeat,
        "device_worker": args.device_worker,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "peak_rss_mb_before": start_rss,
        "results": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
