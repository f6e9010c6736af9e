"""The peers benchmark reports what it measured and computes what its rules
say (tiny counts; how fast is never checked): medians and ratios from its
own runs, the bars with their verdicts, a missing framework reported and
left out, a lost tell an error rather than a figure."""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest

from benchmarks import peers
from benchmarks.peers import contender as contender_module
from benchmarks.peers.contender import Contender, check_told
from benchmarks.peers.measure import PEER_BAR, QUEUE_BARS
from benchmarks.peers.pykka_peer import PykkaContender
from benchmarks.reporting import alternating, round_robin

TINY = ["--n", "200", "--callers", "10", "--actors", "20", "--tells", "300", "--repeat", "3"]
WORKLOADS = {"sequential", "callers", "fan_out", "tells"}


def run_json(capsys: Any, *args: str) -> dict:
    assert peers.main([*TINY, "--json-only", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # --json-only: the JSON line alone
    return json.loads(lines[0])


def test_the_runtime_against_the_queue_actor_reports_medians_ratios_bars_and_memory(capsys: Any) -> None:
    result = run_json(capsys, "--only", "queue", "--memory-actors", "50")
    assert result["benchmark"] == "peers"
    assert result["counts"] == {"n": 200, "width": 10, "actors": 20, "tells": 300, "rounds": 3, "batches": 5,
                                "burst": 0}
    assert len(result["load_average"]) == 3 and result["python"]
    assert set(result["contenders"]) == {"runtime", "queue"}
    ours = result["contenders"]["runtime"]["workloads"]
    theirs = result["contenders"]["queue"]["workloads"]
    assert set(ours) == set(theirs) == WORKLOADS
    for workload in WORKLOADS:
        for row in (ours[workload], theirs[workload]):
            assert len(row["runs"]) == 3 and all(rate > 0 for rate in row["runs"])
            assert row["ops_per_s"] == round(statistics.median(row["runs"]))
            assert row["cpu_us_per_op"] > 0
        assert ours[workload]["ratio"] == 1.0
        expected = statistics.median(ours[workload]["runs"]) / statistics.median(theirs[workload]["runs"])
        assert theirs[workload]["ratio"] == pytest.approx(expected, rel=0.01)
    for row in (ours["fan_out"], theirs["fan_out"]):  # 5 batches a run, 3 runs: each batch's rate
        batches = row["batches"]
        assert 0 < batches["slowest"] <= batches["median"]
        ratio = batches["slowest"] / batches["median"]
        # slowest and median are stored rounded to whole ops/s, the ratio to 3 decimals (from the unrounded rates)
        rounding = 0.0005 + ratio * (0.5 / batches["slowest"] + 0.5 / batches["median"]) * 1.01
        assert batches["slowest_to_median"] == pytest.approx(ratio, abs=rounding)
    slowest = [row for row in result["bars"] if row["workload"] == "fan_out_slowest"]
    assert slowest == [{"against": "runtime", "workload": "fan_out_slowest", "need": 0.5,
                        "ratio": ours["fan_out"]["batches"]["slowest_to_median"],
                        "met": ours["fan_out"]["batches"]["slowest_to_median"] >= 0.5}]
    bars = {row["workload"]: row for row in result["bars"] if row["against"] == "queue"}
    assert set(bars) == WORKLOADS and len(result["bars"]) == len(WORKLOADS) + 1
    for workload, row in bars.items():
        assert row["need"] == QUEUE_BARS[workload]
        assert row["ratio"] == theirs[workload]["ratio"]
        assert row["met"] == (row["ratio"] >= row["need"])
    assert result["bars_met"] == all(row["met"] for row in result["bars"])
    for key in ("runtime", "queue"):
        assert result["contenders"][key]["rss_kib_per_actor"] > 0
    assert result["missing"] == {} and result["memory_errors"] == {}


def test_the_table_names_each_contender_the_bars_and_the_load_average(capsys: Any) -> None:
    assert peers.main([*TINY, "--repeat", "1", "--only", "queue", "--memory-actors", "0"]) == 0
    out = capsys.readouterr().out
    table, json_line = out.rsplit("\n", 2)[0], out.strip().splitlines()[-1]
    assert "load average" in table and "asyncio.Queue actor" in table and "gpu-isolator runtime" in table
    assert "CPU µs per operation" in table
    for name in ("sequential", "10 callers", "fan-out", "tells"):
        assert f"  {name}" in table and "vs asyncio.Queue actor" in table
    assert json.loads(json_line)["benchmark"] == "peers"


def test_tells_in_bursts_reach_the_actor_and_the_inline_queue_actor_is_held_to_the_tells_bar(capsys: Any) -> None:
    result = run_json(capsys, "--repeat", "1", "--only", "queue_inline", "--memory-actors", "0", "--tell-burst", "7")
    assert result["counts"]["burst"] == 7
    assert set(result["contenders"]["queue_inline"]["workloads"]) == {"tells"}
    rows = [row for row in result["bars"] if row["against"] == "queue_inline"]
    assert [row["workload"] for row in rows] == ["tells"] and rows[0]["need"] == QUEUE_BARS["tells"]
    assert rows[0]["met"] == (rows[0]["ratio"] >= 1.0)


def test_bursts_split_the_tells_and_zero_is_one_burst() -> None:
    from benchmarks.peers.contender import bursts

    assert bursts(10, 0) == [range(0, 10)] and bursts(10, 10) == [range(0, 10)] and bursts(10, 50) == [range(0, 10)]
    assert bursts(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]


def test_a_framework_that_is_not_installed_is_reported_and_left_out(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(PykkaContender, "modules", ("gpu_isolator_test_no_such_module",))
    result = run_json(capsys, "--repeat", "1", "--only", "pykka", "--memory-actors", "0")
    why = result["missing"]["pykka"]
    assert "gpu_isolator_test_no_such_module is not installed" in why and "[bench]" in why
    assert set(result["contenders"]) == {"runtime"}
    assert all(row["against"] != "pykka" for row in result["bars"])


def test_a_peer_is_held_to_twice_the_runtime_on_every_workload_it_runs(capsys: Any, monkeypatch: Any) -> None:
    from benchmarks.peers import lineup, queue_actor

    class StubPeer(queue_actor.QueueContender):  # a "framework" whose actor is the queue actor
        key = "pykka"
        label = "stub peer"
        workloads = ("sequential", "tells")

    monkeypatch.setattr(lineup, "PykkaContender", StubPeer)
    result = run_json(capsys, "--repeat", "1", "--only", "pykka", "--memory-actors", "0")
    rows = [row for row in result["bars"] if row["against"] == "pykka"]
    assert {row["workload"] for row in rows} == {"sequential", "tells"}
    assert all(row["need"] == PEER_BAR and row["met"] == (row["ratio"] >= PEER_BAR) for row in rows)
    assert set(result["contenders"]["pykka"]["workloads"]) == {"sequential", "tells"}


def test_an_unknown_contender_is_refused(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit:
        peers.main(["--only", "akka"])
    assert exit.value.code == 2
    assert "unknown contender(s) akka" in capsys.readouterr().err


def test_a_tells_run_that_lost_messages_is_an_error_not_a_figure() -> None:
    stub = Contender()
    stub.key = "stub"
    check_told(stub, 5, 5)
    with pytest.raises(RuntimeError, match=r"stub: the actor received 4 of 5 tells"):
        check_told(stub, 4, 5)
    with pytest.raises(RuntimeError, match=r"received None of 5"):
        check_told(stub, None, 5)


def test_missing_names_the_module_and_the_extra_that_installs_it(monkeypatch: Any) -> None:
    stub = Contender()
    stub.modules = ("asyncio", "gpu_isolator_test_absent")
    assert stub.missing() == f"gpu_isolator_test_absent is not installed ({contender_module.INSTALL_HINT})"
    stub.modules = ("asyncio",)
    assert stub.missing() is None


def test_runs_take_turns_so_load_hits_every_contender_alike() -> None:
    assert alternating(["a", "b"], 0) == ["a", "b"] and alternating(["a", "b"], 1) == ["b", "a"]
    assert [round_robin(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert round_robin([], 3) == []
