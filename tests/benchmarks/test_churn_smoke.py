"""The churn benchmark counts what it promises and leaves nothing behind
(tiny durations; no timed assertions: how fast is never checked, only that
the figures are the ones the calls made and the report computes them as its
rules say).

Kernel backends run only as root with their hierarchy present, under a
cgroups root named ``gpu-isolator-test-churn-<hex>`` that must be gone
afterwards -- also when the run is interrupted."""

from __future__ import annotations

import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from benchmarks import churn
from benchmarks.churn import run as churn_run
from benchmarks.churn.cpu import CpuClock, CpuUse, process_cpu_seconds
from actors.devices import default_hierarchy
from isolators.simulated_node import SimulatedNode, backend_unavailable, remove_cgroup_tree
from runtime import Executor, Runtime
from actors.flags import DEVICE_WORKERS, KERNEL_BACKENDS

TINY = ["--seconds", "0.05", "--repeat", "1", "--no-progress"]
CALLS = {"prepare", "usage", "update", "cleanup"}
JSON_FIELDS = {"benchmark", "workers", "gpu_workers", "seconds", "repeat", "device_worker", "python", "kernel",
               "cpus", "peak_rss_mb_before", "results", "worker_counts", "ledger"}
ROW_FIELDS = {"backend", "lifecycles_per_s", "runs_per_s", "latency_us", "peak_rss_mb", "worker_peak_rss_mb",
              "lifecycles", "gpu_lifecycles", "device_ops_per_batch", "errors", "cpu_us_per_lifecycle",
              "workers", "hops_per_lifecycle", "hops_per_verb"}
HOP_FIELDS = {"hops", "executor_jobs", "worker_round_trips", "other_thread_wakeups"}


def run_json(capsys: Any, *args: str) -> dict:
    assert churn.main([*TINY, "--json-only", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, f"--json-only prints one line, got {out!r}"
    return json.loads(out[0])


def kernel_backends() -> list:
    return [pytest.param(b, marks=pytest.mark.skipif(backend_unavailable(b) is not None,
                                                     reason=str(backend_unavailable(b))))
            for b in KERNEL_BACKENDS]


def fresh_root(backend: str) -> tuple[str, str]:
    """A cgroups root name of this test's own, and its path in ``backend``'s hierarchy."""
    root = f"gpu-isolator-test-churn-{uuid.uuid4().hex[:10]}"
    return root, os.path.join(default_hierarchy(backend), root)


class CountingIsolator:
    """The isolator's handle, counting each call and the GPU ones."""

    def __init__(self, isolator: Any) -> None:
        self.isolator = isolator
        self.devices = isolator.devices
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.isolator, name)

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            if name == "prepare" and args[1].resources.gpus():
                self.calls["prepare with a GPU"] += 1
            return method(*args)

        return counted


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["memory", *kernel_backends()])
async def test_every_lifecycle_is_four_calls_and_every_gpu_comes_back(backend: str) -> None:
    async with Runtime():
        async with SimulatedNode(backend=backend, gpus=8, root_prefix="gpu-isolator-test-churn-") as node:
            counting = CountingIsolator(node.isolator)
            run = await churn.churn(counting, workers=12, lifecycles=300, gpu_workers=5)
            assert run.errors == []
            assert run.lifecycles == 300
            assert {call: counting.calls[call] for call in CALLS} == dict.fromkeys(CALLS, 300)
            assert run.gpu_lifecycles == counting.calls["prepare with a GPU"] and 0 < run.gpu_lifecycles < 300
            assert {call: len(samples) for call, samples in run.latency.items()} == dict.fromkeys(CALLS, 300)
            for figures in run.percentiles_us().values():
                assert 0 < figures["p50"] <= figures["p99"]
            # every GPU is free again, no container and no cgroup is left
            state = await node.components.allocator.state()
            assert state.allocated == [] and len(state.available) == len(state.total) == 8
            assert await node.isolator.containers() == {} and node.cgroups() == []
            if backend != "memory":
                assert run.device_operations >= 300 and run.device_batches >= 1
        assert not node.root_exists()


def test_a_row_is_the_median_of_its_repetitions() -> None:
    def timed(lifecycles: int, seconds: float, errors: tuple[str, ...] = (), worker: float | None = None
              ) -> churn.ChurnRun:
        run = churn.ChurnRun()
        run.lifecycles, run.elapsed, run.errors = lifecycles, seconds, list(errors)
        run.latency["prepare"].extend([lifecycles * 1e-6] * 3)
        run.cpu = CpuUse(lifecycles * 1e-4, 0.001, worker)  # loop: 100 µs a lifecycle
        return run

    runs = [timed(300, 1.0, worker=0.03), timed(100, 1.0, ("c1-0: boom",), worker=0.05), timed(200, 1.0)]
    floors = [timed(600, 1.0), timed(1000, 1.0), timed(250, 1.0)]
    row = churn.summary_row("cgroups_v1", runs, floors, [], [15.5, None, 16.0])
    assert row["runs_per_s"] == [300.0, 100.0, 200.0] and row["lifecycles_per_s"] == 200.0
    assert row["floor_runs_per_s"] == [600.0, 1000.0, 250.0] and row["floor_per_s"] == 600.0
    # the median of the per-repetition ratios (0.5, 0.1, 0.8), not 200 / 600
    assert row["ratio"] == 0.5 == statistics.median([0.5, 0.1, 0.8])
    assert row["lifecycles"] == 200 and row["latency_us"]["prepare"]["p50"] == 200.0  # the median run's
    assert (row["errors"], row["first_error"], row["worker_peak_rss_mb"]) == (1, "c1-0: boom", 16.0)
    assert "floor_cached_per_s" not in row and row["device_ops_per_batch"] is None
    # CPU per lifecycle: each figure's median over the repetitions that measured it
    assert row["cpu_us_per_lifecycle"] == {"loop": 100.0, "other_threads": 5.0, "device_worker": 300.0}
    assert row["floor_cpu_us_per_lifecycle"] == 100.0


def test_memory_run_reports_every_figure(capsys: Any) -> None:
    report = run_json(capsys, "--backends", "memory", "--workers", "10")
    assert set(report) == JSON_FIELDS and report["benchmark"] == "container_churn"
    assert (report["workers"], report["gpu_workers"], report["repeat"], report["seconds"]) == (10, 8, 1, 0.05)
    (row,) = report["results"]
    assert set(row) == ROW_FIELDS
    assert row["backend"] == "memory" and row["errors"] == 0 and row["worker_peak_rss_mb"] is None
    assert 0 < row["gpu_lifecycles"] < row["lifecycles"]
    assert row["runs_per_s"] == [row["lifecycles_per_s"]] and row["lifecycles_per_s"] > 0
    assert set(row["latency_us"]) == CALLS
    for figures in row["latency_us"].values():
        assert set(figures) == {"p50", "p99"} and 0 <= figures["p50"] <= figures["p99"]
    assert row["peak_rss_mb"] >= report["peak_rss_mb_before"] > 0
    cpu = row["cpu_us_per_lifecycle"]
    assert set(cpu) == {"loop", "other_threads", "device_worker"}
    assert cpu["loop"] > 0 and cpu["other_threads"] >= 0 and cpu["device_worker"] is None  # in memory: in line
    assert row["workers"] == 10 and report["worker_counts"] == [10]
    assert row["hops_per_lifecycle"] >= 0
    assert set(row["hops_per_verb"]) == {"gpus:1", "gpus:0"}
    for calls in row["hops_per_verb"].values():
        assert set(calls) == CALLS
        for figures in calls.values():
            assert set(figures) == HOP_FIELDS
            assert figures["hops"] == pytest.approx(
                figures["executor_jobs"] + figures["worker_round_trips"] + figures["other_thread_wakeups"])
    # in memory nothing goes to a device worker, and a container without GPUs wakes the loop from nowhere
    assert all(f["worker_round_trips"] == 0 for calls in row["hops_per_verb"].values() for f in calls.values())
    assert all(f["hops"] == 0 for f in row["hops_per_verb"]["gpus:0"].values())


def test_the_ledger_on_and_off_in_one_run_reports_its_ratio_jobs_and_one_leases_cost(capsys: Any) -> None:
    """SPEC 22's cost figures: each backend with the node ledger off, then on (a ledger of its own)."""
    report = run_json(capsys, "--backends", "memory", "--workers", "2", "--ledger", "both")
    assert report["ledger"] == "both" and report["lease_us"] > 0
    off, on = report["results"]
    assert set(off) == ROW_FIELDS and set(on) == ROW_FIELDS | {"ledger", "ledger_ratio", "ledger_jobs_per_lifecycle"}
    assert on["ledger"] == "on" and on["errors"] == 0 and on["lifecycles"] > 0
    assert on["ledger_ratio"] == round(on["lifecycles_per_s"] / off["lifecycles_per_s"], 3)
    assert on["ledger_jobs_per_lifecycle"] >= 0
    assert churn.main([*TINY, "--backends", "memory", "--workers", "2", "--ledger", "on"]) == 0
    assert "memory+ledger" in capsys.readouterr().out


def test_cpu_readings_count_this_thread_this_process_and_a_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.2\n"
                              "while time.process_time() < end: pass\nimport sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        before = CpuClock.read(child.pid)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # this thread: the "loop"
            pass
        done = threading.Event()

        def spin() -> None:  # another thread of this process
            stop = time.thread_time() + 0.05
            while time.thread_time() < stop:
                pass
            done.set()

        threading.Thread(target=spin).start()
        done.wait(5)
        deadline = time.monotonic() + 5
        while process_cpu_seconds(child.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.01)
        use = CpuClock.read(child.pid).since(before)
        assert 0.05 <= use.loop < 1 and 0.04 <= use.other_threads < 1
        assert use.worker is not None and 0.1 <= use.worker < 2
        assert CpuClock.read(child.pid + 10**7).since(before).worker is None  # another worker: not comparable
    finally:
        child.stdin.close()
        child.wait(5)
    assert process_cpu_seconds(child.pid) is None  # reaped: gone


def test_table_then_json_and_the_median_of_repeats(capsys: Any) -> None:
    assert churn.main(["--seconds", "0.03", "--repeat", "3", "--no-progress", "--backends", "memory",
                       "--workers", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "container churn, 3 workers (3 with gpus:1), simulated 8-GPU node, device work in a process"
    assert "lifecycles/s" in lines[1] and "peak RSS" in lines[1] and set(lines[2]) == {"-"}
    row = json.loads(lines[-1])["results"][0]
    assert lines[3].split()[:2] == ["memory", f"{row['lifecycles_per_s']:,.0f}"]
    assert len(row["runs_per_s"]) == 3 and sorted(row["runs_per_s"])[1] == row["lifecycles_per_s"]


def test_each_worker_count_is_a_table_of_its_own(capsys: Any) -> None:
    assert churn_run.DEFAULT_WORKERS == (64, 1)  # the busy node, and one container at a time
    assert churn.main([*TINY, "--backends", "memory", "--workers", "3,1"]) == 0
    text = capsys.readouterr().out.strip()
    tables, json_line = text.rsplit("\n", 1)
    first, second = tables.split("\n\n")
    assert first.splitlines()[0].startswith("container churn, 3 workers (3 with gpus:1)")
    assert second.splitlines()[0].startswith("container churn, 1 workers (1 with gpus:1)")
    report = json.loads(json_line)
    assert (report["workers"], report["worker_counts"]) == (3, [3, 1])
    assert [(row["backend"], row["workers"]) for row in report["results"]] == [("memory", 3), ("memory", 1)]
    assert second.splitlines()[5].split()[:3] == ["hops", "per", "lifecycle"]  # under the CPU line


@pytest.mark.asyncio
async def test_hops_are_executor_jobs_worker_batches_and_other_threads() -> None:
    class Devices:
        worker_batches = 0

    devices = Devices()
    loop = asyncio.get_running_loop()
    with churn.HopCounter(devices) as counter:
        before = counter.read()
        await Executor(1, name="hop-test").run(int)  # one job: its completion wakes the loop
        woken = asyncio.Event()
        thread = threading.Thread(target=lambda: loop.call_soon_threadsafe(woken.set))
        thread.start()
        await woken.wait()
        thread.join()
        devices.worker_batches += 2  # two round trips to a device worker process
        figures = counter.read().since(before).per(1)
    assert figures == {"hops": 4.0, "executor_jobs": 1.0, "worker_round_trips": 2.0, "other_thread_wakeups": 1.0}
    assert "call_soon_threadsafe" not in vars(loop)  # uninstalled: the loop's own method again


def test_bad_arguments_are_refused(capsys: Any) -> None:
    for args in (["--backends", "zfs"], ["--workers", "0"], ["--workers", "2,0"], ["--seconds", "0"],
                 ["--repeat", "0"]):
        with pytest.raises(SystemExit) as exit_:
            churn.main(args)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown backend(s) ['zfs']" in err and "need --workers >= 1, --seconds > 0 and --repeat >= 1" in err


def test_the_progress_line_rewrites_itself() -> None:
    stream = io.StringIO()
    progress = churn.Progress(True, stream)
    progress.show("memory 1/3 isolator", 0.5, 1234, force=True)
    progress.show("memory 1/3 isolator", 0.75, 2000)  # within 0.2 s: skipped
    progress.clear()
    text = stream.getvalue()
    assert text.startswith("\rmemory 1/3 isolator") and "[############............]" in text
    assert " 50.0%" in text and "1,234 lifecycles" in text and "2,000" not in text
    assert text.endswith("\r")
    quiet = io.StringIO()
    churn.Progress(False, quiet).show("x", 1.0, 1, force=True)
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("worker", DEVICE_WORKERS)
@pytest.mark.parametrize("backend", kernel_backends())
def test_kernel_run_measures_the_floor_and_removes_its_root(capsys: Any, backend: str, worker: str) -> None:
    root, path = fresh_root(backend)
    try:
        report = run_json(capsys, "--backends", backend, "--workers", "9", "--cgroups-root", root,
                          "--device-worker", worker)
        assert report["device_worker"] == worker
        (row,) = report["results"]
        assert row["errors"] == 0, row.get("first_error")
        if worker == "process":
            assert row["worker_peak_rss_mb"] > 0
        else:
            assert row["worker_peak_rss_mb"] is None
        assert row["floor_runs_per_s"] == [row["floor_per_s"]] and row["floor_per_s"] > 0
        # the ratio is the isolator's figure over the floor's (rounded as reported)
        assert row["ratio"] == pytest.approx(row["lifecycles_per_s"] / row["floor_per_s"], abs=2e-3)
        assert row["device_ops_per_batch"] >= 1
        cpu = row["cpu_us_per_lifecycle"]
        assert cpu["loop"] > 0 and row["floor_cpu_us_per_lifecycle"] > 0
        if worker == "process":
            assert cpu["device_worker"] > 0
        else:
            assert cpu["device_worker"] is None and cpu["other_threads"] > 0  # the device thread
        # one hand-off per verb that has kernel work (prepare, shrinking update, cleanup), none for the rest
        if worker == "process":
            expected = {"gpus:1": {"prepare": 1, "usage": 0, "update": 1, "cleanup": 1},
                        "gpus:0": {"prepare": 1, "usage": 0, "update": 0, "cleanup": 1}}
            assert {kind: {call: figures["worker_round_trips"] for call, figures in calls.items()}
                    for kind, calls in row["hops_per_verb"].items()} == expected
        if backend == "cgroups_v2":
            assert row["ratio_cached"] == pytest.approx(row["lifecycles_per_s"] / row["floor_cached_per_s"],
                                                        abs=2e-3)
        else:
            assert "floor_cached_per_s" not in row
        assert not os.path.exists(path)
    finally:
        remove_cgroup_tree(path)


@pytest.mark.parametrize("where", ["isolator", "floor"])
@pytest.mark.parametrize("backend", kernel_backends())
def test_an_interrupted_run_still_removes_its_cgroups(capsys: Any, monkeypatch: pytest.MonkeyPatch, backend: str,
                                                      where: str) -> None:
    root, path = fresh_root(backend)

    async def interrupted_churn(isolator: Any, *args: Any, **kwargs: Any) -> None:
        # Ctrl-C while containers run: one is prepared when it comes.
        from isolators import ContainerConfig, ContainerID, Resources

        await isolator.prepare(ContainerID("left-behind"), ContainerConfig(resources=Resources.parse("gpus:1")))
        assert os.path.isdir(os.path.join(path, "left-behind"))
        raise KeyboardInterrupt

    def interrupted_floor(hierarchy: str, cgroups_root: str, *args: Any, **kwargs: Any) -> None:
        # Ctrl-C inside the floor's loop: a cgroup of it is left between mkdir and rmdir.
        os.makedirs(os.path.join(hierarchy, cgroups_root, "floor-7"))
        raise KeyboardInterrupt

    if where == "isolator":
        monkeypatch.setattr(churn_run, "churn", interrupted_churn)
    else:
        monkeypatch.setattr(churn_run, "floor_v1", interrupted_floor)
        monkeypatch.setattr(churn_run, "floor_v2", interrupted_floor)
    try:
        assert churn.main([*TINY, "--backends", backend, "--workers", "2", "--cgroups-root", root]) == 130
        assert "churn: interrupted" in capsys.readouterr().err
        assert not os.path.exists(path)
    finally:
        remove_cgroup_tree(path)


@pytest.mark.parametrize("backend", kernel_backends())
def test_an_existing_root_is_never_adopted(capsys: Any, backend: str) -> None:
    root, path = fresh_root(backend)
    os.mkdir(path)  # a cgroup that is not the benchmark's
    try:
        with pytest.raises(SystemExit) as exit_:
            churn.main([*TINY, "--backends", backend, "--cgroups-root", root])
        assert exit_.value.code == 2
        assert f"cgroups root {path} already exists: choose another --cgroups-root" in capsys.readouterr().err
        assert os.path.isdir(path)
    finally:
        remove_cgroup_tree(path)
