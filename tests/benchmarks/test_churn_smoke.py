"""The churn benchmark's code runs and reports what it promises (tiny
durations; no timed assertions: the numbers themselves are never checked).

Kernel backends run only as root with their hierarchy present, under a
cgroups root named ``gpu-isolator-test-churn-<hex>`` that must be gone
afterwards -- also when the run is interrupted."""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid

import pytest

from benchmarks import churn

TINY = ["--seconds", "0.05", "--repeat", "1", "--no-progress"]
CALLS = {"prepare", "usage", "update", "cleanup"}


def run_json(capsys, *args: str) -> dict:
    assert churn.main([*TINY, "--json-only", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, f"--json-only prints one line, got {out!r}"
    return json.loads(out[0])


def kernel_backends() -> list:
    params = []
    for backend in ("cgroups_v1", "cgroups_v2"):
        reason = churn.kernel_skip_reason(backend)
        params.append(pytest.param(backend, marks=pytest.mark.skipif(reason is not None, reason=str(reason))))
    return params


def test_memory_run_reports_every_figure(capsys) -> None:
    report = run_json(capsys, "--backends", "memory", "--workers", "10")
    assert report["benchmark"] == "container_churn"
    assert (report["workers"], report["gpu_workers"], report["repeat"]) == (10, 8, 1)
    (row,) = report["results"]
    assert row["backend"] == "memory" and row["errors"] == 0
    assert row["lifecycles"] > 0 and 0 < row["gpu_lifecycles"] < row["lifecycles"]
    assert row["lifecycles_per_s"] > 0 and len(row["runs_per_s"]) == 1
    assert set(row["latency_us"]) == CALLS
    for figures in row["latency_us"].values():
        assert set(figures) == {"p50", "p99"} and 0 <= figures["p50"] <= figures["p99"]
    assert row["peak_rss_mb"] > 0
    assert "floor_per_s" not in row and "ratio" not in row  # no kernel floor in memory


def test_table_then_json_and_the_median_of_repeats(capsys) -> None:
    assert churn.main(["--seconds", "0.03", "--repeat", "3", "--no-progress", "--backends", "memory",
                       "--workers", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("container churn, 3 workers (3 with gpus:1)")
    assert "lifecycles/s" in lines[1] and "peak RSS" in lines[1]
    assert lines[3].split()[0] == "memory"
    row = json.loads(lines[-1])["results"][0]
    assert len(row["runs_per_s"]) == 3
    assert sorted(row["runs_per_s"])[1] == row["lifecycles_per_s"]


def test_bad_arguments_are_refused(capsys) -> None:
    for args in (["--backends", "zfs"], ["--workers", "0"], ["--seconds", "0"], ["--repeat", "0"]):
        with pytest.raises(SystemExit) as exit_:
            churn.main(args)
        assert exit_.value.code == 2
    assert "unknown backend(s) ['zfs']" in capsys.readouterr().err


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


@pytest.mark.parametrize("worker", ["process", "thread"])
@pytest.mark.parametrize("backend", kernel_backends())
def test_kernel_run_measures_the_floor_and_removes_its_root(capsys, backend: str, worker: str) -> None:
    root = f"gpu-isolator-test-churn-{uuid.uuid4().hex[:10]}"
    path = os.path.join(churn.default_hierarchy(backend), root)
    try:
        report = run_json(capsys, "--backends", backend, "--workers", "9", "--cgroups-root", root,
                          "--device-worker", worker)
        assert report["device_worker"] == worker
        (row,) = report["results"]
        if worker == "process":
            assert row["worker_peak_rss_mb"] > 0
        else:
            assert row["worker_peak_rss_mb"] is None
        assert row["errors"] == 0, row.get("first_error")
        assert row["floor_per_s"] > 0 and row["ratio"] > 0
        if backend == "cgroups_v1":
            assert row["device_ops_per_batch"] >= 1
        else:
            assert row["floor_cached_per_s"] > 0 and row["ratio_cached"] > 0
        assert not os.path.exists(path)
    finally:
        churn.remove_cgroup_tree(path)


@pytest.mark.parametrize("where", ["isolator", "floor"])
@pytest.mark.parametrize("backend", kernel_backends())
def test_an_interrupted_run_still_removes_its_cgroups(capsys, monkeypatch, backend: str, where: str) -> None:
    root = f"gpu-isolator-test-churn-{uuid.uuid4().hex[:10]}"
    path = os.path.join(churn.default_hierarchy(backend), root)

    async def interrupted_churn(isolator, *args, **kwargs):
        # Ctrl-C while containers run: one is prepared when it comes.
        from isolators import ContainerConfig, ContainerID, Resources

        await isolator.prepare(ContainerID("left-behind"), ContainerConfig(resources=Resources.parse("gpus:1")))
        assert os.path.isdir(os.path.join(path, "left-behind"))
        raise KeyboardInterrupt

    def interrupted_floor(hierarchy, cgroups_root, *args, **kwargs):
        # Ctrl-C inside the floor's loop: a cgroup of it is left between mkdir and rmdir.
        os.makedirs(os.path.join(hierarchy, cgroups_root, "floor-7"))
        raise KeyboardInterrupt

    if where == "isolator":
        monkeypatch.setattr(churn, "churn", interrupted_churn)
    else:
        monkeypatch.setattr(churn, "floor_v1", interrupted_floor)
        monkeypatch.setattr(churn, "floor_v2", interrupted_floor)
    try:
        assert churn.main([*TINY, "--backends", backend, "--workers", "2", "--cgroups-root", root]) == 130
        assert "churn: interrupted" in capsys.readouterr().err
        assert not os.path.exists(path)
    finally:
        churn.remove_cgroup_tree(path)


def test_an_existing_root_is_never_adopted(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(churn, "default_hierarchy", lambda backend: str(tmp_path))
    (tmp_path / "mine").mkdir()
    with pytest.raises(SystemExit):
        churn.main([*TINY, "--backends", "memory", "--cgroups-root", "mine"])
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "mine").is_dir()
    shutil.rmtree(tmp_path / "mine")
