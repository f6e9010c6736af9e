"""The runtime's metrics: counters, gauges, timers; libprocess' snapshot
shape and Prometheus text (parsed by prometheus-client's own parser); the
metrics of several processes of one kind under fixed names (``MetricSet``)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime import Metrics, MetricSet, Runtime, current_runtime


def test_a_counter_a_pushed_gauge_and_a_pulled_gauge_read_in_the_snapshot() -> None:
    metrics = Metrics()
    metrics.counter("isolator/prepares").inc()
    metrics.counter("isolator/prepares").inc(2)  # the same counter by name
    gauge = metrics.gauge("allocator/gpus_free")
    gauge.set(8)
    gauge.dec(3)
    held = {"c1", "c2"}
    metrics.gauge("isolator/containers", lambda: len(held))
    held.add("c3")
    assert metrics.snapshot() == {"allocator/gpus_free": 5, "isolator/containers": 3, "isolator/prepares": 3}


def test_a_timer_reports_last_count_and_percentiles_in_ms_like_libprocess() -> None:
    metrics = Metrics()
    timer = metrics.timer("isolator/prepare")
    assert metrics.snapshot() == {}  # nothing recorded: nothing to say
    for ms in range(1, 101):  # 1..100 ms
        timer.record(ms / 1000)
    snap = metrics.snapshot()
    assert snap["isolator/prepare_ms"] == pytest.approx(100.0)
    assert snap["isolator/prepare_ms/count"] == 100
    assert snap["isolator/prepare_ms/min"] == pytest.approx(1.0)
    assert snap["isolator/prepare_ms/max"] == pytest.approx(100.0)
    assert snap["isolator/prepare_ms/p50"] == pytest.approx(50.5)
    assert snap["isolator/prepare_ms/p90"] == pytest.approx(90.1)
    assert snap["isolator/prepare_ms/p99"] == pytest.approx(99.01)
    assert {"isolator/prepare_ms/p95", "isolator/prepare_ms/p999", "isolator/prepare_ms/p9999"} <= set(snap)


def test_a_timer_keeps_the_last_1000_values_for_percentiles_and_counts_all() -> None:
    timer = Metrics().timer("t")
    for _ in range(5000):
        timer.record(1.0)
    for _ in range(1000):
        timer.record(0.001)
    assert timer.count == 6000
    assert timer.statistics()["max"] == pytest.approx(0.001)


def test_timing_a_block_records_its_duration() -> None:
    timer = Metrics().timer("block")
    with timer.time():
        sum(range(1000))
    assert timer.count == 1 and 0 < timer.last < 1


def test_bad_names_and_a_name_under_another_kind_are_errors_that_say_what_to_do() -> None:
    metrics = Metrics()
    metrics.counter("a/b")
    with pytest.raises(ValueError, match="Metric 'a/b' is already registered as a counter, not a gauge"):
        metrics.gauge("a/b")
    with pytest.raises(ValueError, match=r"Invalid metric name 'a b': use letters, digits and '/_-\.:'"):
        metrics.counter("a b")
    metrics.remove("a/b")
    metrics.gauge("a/b").set(1)
    assert metrics.snapshot() == {"a/b": 1}


def test_a_pulled_gauge_that_raises_is_left_out_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    metrics.counter("ok").inc()
    metrics.gauge("broken", lambda: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="runtime._metrics"):
        assert metrics.snapshot() == {"ok": 1}
        assert "broken" not in metrics.prometheus()
    assert "Metric broken: reading the gauge failed" in caplog.text


def test_prometheus_text_parses_with_prometheus_clients_parser() -> None:
    metrics = Metrics()
    metrics.counter("isolator/prepares", "containers prepared").inc(7)
    metrics.gauge("allocator/gpus_free", help="GPUs not allocated\nto anyone").set(4)
    timer = metrics.timer("isolator/prepare", "prepare latency")
    for seconds in (0.001, 0.002, 0.003):
        timer.record(seconds)
    families = {f.name: f for f in text_string_to_metric_families(metrics.prometheus())}
    assert families["isolator_prepares"].type == "counter"
    assert [(s.name, s.value) for s in families["isolator_prepares"].samples] == [("isolator_prepares_total", 7)]
    assert families["allocator_gpus_free"].type == "gauge"
    assert families["allocator_gpus_free"].documentation == "GPUs not allocated\nto anyone"
    assert families["allocator_gpus_free"].samples[0].value == 4
    summary = families["isolator_prepare_seconds"]
    assert summary.type == "summary"
    samples = {(s.name, s.labels.get("quantile")): s.value for s in summary.samples}
    assert samples[("isolator_prepare_seconds_count", None)] == 3
    assert samples[("isolator_prepare_seconds_sum", None)] == pytest.approx(0.006)
    assert samples[("isolator_prepare_seconds", "0.5")] == pytest.approx(0.002)


@pytest.mark.anyio
async def test_every_runtime_has_its_own_registry_with_its_process_count() -> None:
    async with Runtime() as rt:
        assert current_runtime().metrics is rt.metrics
        assert rt.metrics.snapshot() == {"runtime/processes": 0}
    async with Runtime() as other:
        assert other.metrics is not rt.metrics


def test_processes_of_one_kind_share_fixed_names_pulled_gauges_summed() -> None:
    metrics = Metrics()
    first, second = MetricSet(metrics), MetricSet(metrics)
    held_a, held_b = ["c1"], ["c2", "c3"]
    first.gauge("isolator/containers", lambda: len(held_a))
    second.gauge("isolator/containers", lambda: len(held_b))
    first.counter("isolator/prepares").inc()
    second.counter("isolator/prepares").inc(2)
    first.timer("isolator/prepare").record(0.001)
    second.timer("isolator/prepare").record(0.003)
    snap = metrics.snapshot()
    assert snap["isolator/containers"] == 3 and snap["isolator/prepares"] == 3
    assert snap["isolator/prepare_ms/count"] == 2
    first.close()
    snap = metrics.snapshot()
    assert snap["isolator/containers"] == 2  # the closed one's gauge stops counting at once
    assert snap["isolator/prepares"] == 3  # counts and timers stay while another holds them
    assert snap["isolator/prepare_ms/count"] == 2
    second.close()
    assert metrics.snapshot() == {} and metrics.prometheus() == ""  # the last one out removes them
    assert metrics.names() == []


def test_a_pulled_counter_keeps_a_closed_process_count_and_never_goes_down() -> None:
    metrics = Metrics()
    first, second = MetricSet(metrics), MetricSet(metrics)
    ops = {"a": 5, "b": 1}
    first.counter("devices/operations", read=lambda: ops["a"])
    second.counter("devices/operations", read=lambda: ops["b"])
    assert metrics.snapshot() == {"devices/operations": 6}
    ops["a"] = 7
    first.close()
    ops["a"] = 100  # read no more
    ops["b"] = 2
    assert metrics.snapshot() == {"devices/operations": 9}
    families = {f.name: f for f in text_string_to_metric_families(metrics.prometheus())}
    assert families["devices_operations"].type == "counter"
    assert families["devices_operations"].samples[0].value == 9
    second.close()
    assert "devices/operations" not in metrics.names()


def test_a_metric_set_closes_once_and_refuses_new_metrics_after(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    published = MetricSet(metrics)
    published.counter("x/broken", read=lambda: 1 / 0)
    published.gauge("x/g", lambda: 1)
    with caplog.at_level(logging.ERROR, logger="runtime._metrics"):
        assert metrics.snapshot() == {"x/g": 1}  # a broken pulled counter is left out, logged
        published.close()
        published.close()  # idempotent
    assert "Metric x/broken: reading the counter failed" in caplog.text
    assert metrics.names() == []
    with pytest.raises(ValueError, match="Metric 'x/g': this MetricSet is closed"):
        published.gauge("x/g", lambda: 1)


def test_a_metric_set_leaves_a_metric_registered_directly_under_another_kind_alone() -> None:
    metrics = Metrics()
    metrics.counter("a/b")
    with pytest.raises(ValueError, match="Metric 'a/b' is already registered as a counter, not a gauge"):
        MetricSet(metrics).gauge("a/b", lambda: 1)
    metrics.remove("a/b")
    published = MetricSet(metrics)
    published.gauge("a/b", lambda: 1)
    metrics.remove("a/b")  # removed under the set's feet: closing it is still fine
    metrics.counter("a/b").inc()
    published.close()
    assert metrics.snapshot() == {"a/b": 1}
