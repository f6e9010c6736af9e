"""The metrics the isolator, allocator and device control actors publish
(``/metrics/snapshot`` names): exact counts after each verb, timers,
gauges that follow the allocator (health included), several isolators in one
runtime, and nothing left once the actors are gone. On the in-memory
backend: the counts are the isolator's, not the kernel's."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors import Gpu
from actors.devices import MemoryBackend
from isolators import ContainerID, Resources
from runtime import Runtime, current_runtime
from tests.support.containers import config
from tests.support.errors import isolator_failure

pytestmark = pytest.mark.asyncio

PREFIXES = ("isolator/", "allocator/", "devices/")


def snapshot() -> dict[str, float]:
    return current_runtime().metrics.snapshot()


def actor_metrics() -> dict[str, float]:
    return {name: value for name, value in snapshot().items() if name.startswith(PREFIXES)}


def pick(snap: dict[str, float], *names: str) -> dict[str, float]:
    return {name: snap.get(name) for name in names}


async def test_counts_and_timers_after_prepare_update_cleanup(memory_node: Any) -> None:
    async with Runtime():
        components, isolator = await memory_node.start()
        await isolator.recover([], set())
        await isolator.prepare(ContainerID("c1"), config(1))
        await isolator.prepare(ContainerID("c2"), config(2))
        await isolator_failure(isolator.prepare(ContainerID("c3"), config(5)),
                               "Requested 5 gpus but only 1 available")
        await isolator.prepare(ContainerID("n1", ContainerID("c1")), config(0))  # nested: holds no GPUs
        snap = snapshot()
        assert pick(snap, "isolator/prepares", "isolator/prepare_failures", "isolator/prepare_ms/count",
                    "isolator/containers") == {
            "isolator/prepares": 3, "isolator/prepare_failures": 1, "isolator/prepare_ms/count": 2,
            "isolator/containers": 2}
        assert snap["isolator/prepare_ms"] > 0 and snap["isolator/prepare_ms/p99"] >= snap["isolator/prepare_ms/p50"]
        assert pick(snap, "allocator/gpus_total", "allocator/gpus_free", "allocator/gpus_allocated") == {
            "allocator/gpus_total": 4, "allocator/gpus_free": 1, "allocator/gpus_allocated": 3}

        await isolator.update(ContainerID("c1"), Resources.parse("gpus:2"))  # grows: runs
        await isolator.update(ContainerID("c1"), Resources.parse("gpus:2"))  # no change: answered at once
        await isolator_failure(isolator.update(ContainerID("nobody"), Resources.parse("gpus:1")), "Unknown container")
        snap = snapshot()
        assert pick(snap, "isolator/updates", "isolator/update_failures", "isolator/update_ms/count",
                    "allocator/gpus_free", "allocator/gpus_allocated") == {
            "isolator/updates": 3, "isolator/update_failures": 1, "isolator/update_ms/count": 1,
            "allocator/gpus_free": 0, "allocator/gpus_allocated": 4}

        await isolator.cleanup(ContainerID("c1"))
        await isolator.cleanup(ContainerID("c1"))  # unknown by now: a cleanup that does nothing, counted
        await isolator.cleanup(ContainerID("n1", ContainerID("c1")))  # nested: not counted
        snap = snapshot()
        assert pick(snap, "isolator/cleanups", "isolator/cleanup_failures", "isolator/cleanup_ms/count",
                    "isolator/containers", "allocator/gpus_free") == {
            "isolator/cleanups": 2, "isolator/cleanup_failures": 0, "isolator/cleanup_ms/count": 2,
            "isolator/containers": 1, "allocator/gpus_free": 2}
        # device control: the actor's own counts; in memory one batch per operation
        assert snap["devices/operations"] == isolator.devices.operations > 0
        assert snap["devices/batches"] == isolator.devices.batches == snap["devices/operations"]
        assert snap["devices/worker_restarts"] == 0
        assert snap["isolator/repairs"] == 0 and snap["isolator/reconciles"] == 0
        await isolator.cleanup(ContainerID("c2"))
        await memory_node.stop()


async def test_allocator_gauges_follow_health_marks(memory_node: Any) -> None:
    async with Runtime():
        components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("c1"), config(1))  # GPU 0
        await components.allocator.mark_unhealthy(Gpu(195, 0), "Xid 79")  # allocated and unhealthy
        await components.allocator.mark_unhealthy(Gpu(195, 3), "double-bit ECC error")  # free and unhealthy
        names = ("allocator/gpus_total", "allocator/gpus_free", "allocator/gpus_allocated",
                 "allocator/gpus_unhealthy", "allocator/mig_devices_total")
        assert pick(snapshot(), *names) == {
            "allocator/gpus_total": 4, "allocator/gpus_free": 2, "allocator/gpus_allocated": 1,
            "allocator/gpus_unhealthy": 2, "allocator/mig_devices_total": 0}
        await isolator.cleanup(ContainerID("c1"))  # GPU 0 comes back, still unhealthy: not free
        await components.allocator.mark_healthy(Gpu(195, 3))
        assert pick(snapshot(), *names[:4]) == {
            "allocator/gpus_total": 4, "allocator/gpus_free": 3, "allocator/gpus_allocated": 0,
            "allocator/gpus_unhealthy": 1}
        await memory_node.stop()


async def test_reconcile_counts_the_repairs_it_makes(memory_node: Any) -> None:
    async with Runtime():
        _components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("c1"), config(1))
        await isolator.prepare(ContainerID("c2"), config(1))
        assert await isolator.reconcile() == []
        del MemoryBackend.shared_table(memory_node.root)["c2"]  # drift: someone removed its cgroup
        repairs = await isolator.reconcile()
        assert [r.container_id for r in repairs] == ["c2"]
        snap = snapshot()
        assert pick(snap, "isolator/reconciles", "isolator/reconcile_failures", "isolator/repairs",
                    "isolator/reconcile_ms/count") == {
            "isolator/reconciles": 4, "isolator/reconcile_failures": 0, "isolator/repairs": len(repairs),
            "isolator/reconcile_ms/count": 4}
        await memory_node.clean_all()
        await memory_node.stop()


async def test_two_isolators_in_one_runtime_add_up_and_each_takes_its_part_away(node_factory: Any) -> None:
    first, second = node_factory("memory"), node_factory("memory", gpus=2)
    async with Runtime():
        _c1, one = await first.start()
        _c2, two = await second.start()
        await one.prepare(ContainerID("a"), config(1))
        await two.prepare(ContainerID("b"), config(2))
        snap = snapshot()
        assert pick(snap, "isolator/containers", "isolator/prepares", "allocator/gpus_total",
                    "allocator/gpus_free") == {
            "isolator/containers": 2, "isolator/prepares": 2, "allocator/gpus_total": 6, "allocator/gpus_free": 3}
        operations = snap["devices/operations"]
        await second.stop()  # its actors go: its gauges stop counting, its counts stay
        snap = snapshot()
        assert pick(snap, "isolator/containers", "isolator/prepares", "allocator/gpus_total",
                    "allocator/gpus_free") == {
            "isolator/containers": 1, "isolator/prepares": 2, "allocator/gpus_total": 4, "allocator/gpus_free": 3}
        assert snap["devices/operations"] == operations
        await one.cleanup(ContainerID("a"))
        await first.stop()
        await second.clean_all()
        await second.stop()


async def test_the_metrics_go_with_the_actors(memory_node: Any) -> None:
    async with Runtime() as rt:
        _components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("c1"), config(1))
        published = actor_metrics()
        assert {"isolator/containers", "isolator/prepares", "allocator/gpus_free", "devices/batches"} <= set(published)
        families = {f.name: f.type for f in text_string_to_metric_families(rt.metrics.prometheus())}
        assert families["isolator_prepares"] == "counter" and families["allocator_gpus_free"] == "gauge"
        assert families["isolator_prepare_seconds"] == "summary"
        await isolator.cleanup(ContainerID("c1"))
        await memory_node.stop()  # every actor terminated
        assert actor_metrics() == {}
        assert not [name for name in rt.metrics.names() if name.startswith(PREFIXES)]
        _components, isolator = await memory_node.start()  # a new agent: fresh counts
        assert await isolator.containers() == {}  # (its initialize has run)
        assert pick(snapshot(), "isolator/prepares", "isolator/containers") == {
            "isolator/prepares": 0, "isolator/containers": 0}
        await memory_node.stop()
