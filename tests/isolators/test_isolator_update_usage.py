"""R-IS-4 / R-IS-5: update (Mesos' errors; grow; shrink releasing the highest
minors first; a failed update changes nothing) and usage (Mesos' errors;
NVML readings per allocated GPU from the simulated node)."""

from __future__ import annotations

import logging

import pytest

import runtime
from isolators import ContainerConfig, ContainerID, GpuStatistics, Resources
from tests.support.errors import isolator_failure

MIB = 1 << 20


def gpus(text: str) -> Resources:
    return Resources.parse(text)


async def granted(isolator, cid: str) -> list[int]:
    state = await isolator.devices.state(cid)
    return [m for m in range(4) if state.is_granted("c", 195, m, "rw")]


@pytest.mark.asyncio
async def test_update_errors_use_mesos_wording(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=gpus("gpus:1")))
        await isolator_failure(isolator.update(ContainerID("n1", ContainerID("c1")), gpus("gpus:1")),
                               "Not supported for nested containers")
        await isolator_failure(isolator.update(ContainerID("nobody"), gpus("gpus:1")), "Unknown container")
        await isolator_failure(isolator.update(ContainerID("c1"), gpus("gpus:2.5")),
                               "The 'gpus' resource must be an unsigned integer")
        await isolator_failure(isolator.update(ContainerID("c1"), gpus("gpus:5")),
                               "Requested 4 gpus but only 3 available")
        # Nothing changed.
        assert await isolator.containers() == {"c1": [0]}
        assert await granted(isolator, "c1") == [0]
        assert {g.minor for g in await components.allocator.available()} == {1, 2, 3}
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_update_grows_and_shrinks_highest_minors_first(node, caplog) -> None:
    caplog.set_level(logging.INFO, logger="isolators._process")
    cid = ContainerID("c1")
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(cid, ContainerConfig(resources=gpus("gpus:1")))
        await isolator.update(cid, gpus("cpus:4;gpus:3"))
        assert await isolator.containers() == {"c1": [0, 1, 2]}
        assert await granted(isolator, "c1") == [0, 1, 2]
        assert await isolator.reconcile() == []  # the isolator's own writes are no drift
        assert {g.minor for g in await components.allocator.available()} == {3}

        await isolator.update(cid, gpus("gpus:1"))
        assert await isolator.containers() == {"c1": [0]}
        assert await granted(isolator, "c1") == [0]
        assert {g.minor for g in await components.allocator.available()} == {1, 2, 3}
        assert any("released GPUs [1, 2], highest minors first" in r.getMessage() for r in caplog.records)
        assert await isolator.reconcile() == []

        await isolator.update(cid, gpus("gpus:1"))  # same count: nothing to do
        assert await isolator.containers() == {"c1": [0]}
        await isolator.update(cid, gpus("cpus:1"))  # no gpus: zero
        assert await isolator.containers() == {"c1": []}
        assert await granted(isolator, "c1") == []
        state = await isolator.devices.state("c1")
        assert state.is_granted("c", 195, 255, "rwm")  # control devices stay
        await isolator.update(cid, gpus("gpus:4"))
        assert await granted(isolator, "c1") == [0, 1, 2, 3]
        assert await isolator.reconcile() == []
        await isolator.cleanup(cid)
        assert await components.allocator.available() == components.allocator.total()


@pytest.mark.asyncio
async def test_shrink_picks_the_highest_minors_held(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("a"), ContainerConfig(resources=gpus("gpus:1")))   # [0]
        await isolator.prepare(ContainerID("b"), ContainerConfig(resources=gpus("gpus:1")))   # [1]
        await isolator.update(ContainerID("a"), gpus("gpus:3"))                              # [0, 2, 3]
        assert await isolator.containers() == {"a": [0, 2, 3], "b": [1]}
        await isolator.update(ContainerID("a"), gpus("gpus:2"))
        assert await isolator.containers() == {"a": [0, 2], "b": [1]}
        for cid in ("a", "b"):
            await isolator.cleanup(ContainerID(cid))


@pytest.mark.asyncio
async def test_usage_errors_use_mesos_wording(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator_failure(isolator.usage(ContainerID("n1", ContainerID("c1"))),
                               "Not supported for nested containers")
        await isolator_failure(isolator.usage(ContainerID("c1")), "Unknown container")


@pytest.mark.asyncio
async def test_usage_reports_nvml_readings_per_gpu(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=gpus("gpus:2")))
        await isolator.prepare(ContainerID("c2"), ContainerConfig())
        stats = await isolator.usage(ContainerID("c1"))
        assert stats.gpus_allocated == 2
        uuids = {info.gpu.minor: info.uuid for info in components.inventory.gpus}
        assert stats.gpus == [
            GpuStatistics(
                minor=i,
                uuid=uuids[i],
                memory_used_bytes=100 * (i + 1) * MIB,
                memory_total_bytes=16384 * MIB,
                utilization_gpu_percent=10 + i,
                utilization_memory_percent=20 + i,
                power_milliwatts=50000 + i,
                temperature_celsius=40 + i,
            )
            for i in (0, 1)
        ]
        assert stats.timestamp > 0
        empty = await isolator.usage(ContainerID("c2"))
        assert empty.gpus_allocated == 0 and empty.gpus == []
        await isolator.update(ContainerID("c1"), gpus("gpus:1"))
        assert [g.minor for g in (await isolator.usage(ContainerID("c1"))).gpus] == [0]
        for cid in ("c1", "c2"):
            await isolator.cleanup(ContainerID(cid))


@pytest.mark.asyncio
async def test_usage_leaves_out_what_nvml_does_not_report(memory_node) -> None:
    memory_node.write_host({"gpu_count": 2})
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=gpus("gpus:1")))
        (stat,) = (await isolator.usage(ContainerID("c1"))).gpus
        assert stat.memory_total_bytes == 16384 * MIB and stat.memory_used_bytes == 0
        assert stat.power_milliwatts is None and stat.temperature_celsius is None
        await isolator.cleanup(ContainerID("c1"))


async def utilization(isolator, cid: str) -> int:
    (stat,) = (await isolator.usage(ContainerID(cid))).gpus
    return stat.utilization_gpu_percent


@pytest.mark.asyncio
async def test_usage_answers_from_readings_younger_than_the_bound_with_no_executor_job(memory_node) -> None:
    async with runtime.Runtime():
        runtime.Clock.pause()
        components, isolator = await memory_node.start({"nvidia_usage_max_age": 0.5})
        simulated = components.nvml.nvml
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=gpus("gpus:1")))
        await isolator.prepare(ContainerID("c2"), ContainerConfig(resources=gpus("gpus:1")))
        first = await isolator.usage(ContainerID("c1"))
        assert first.gpus[0].utilization_gpu_percent == 10
        simulated.set_usage(0, utilization_gpu=77)
        jobs = runtime.executor_jobs()
        runtime.Clock.advance(0.5)  # as old as the bound allows: the readings taken then answer
        again = await isolator.usage(ContainerID("c1"))
        assert runtime.executor_jobs() == jobs  # no NVML call, no hop
        assert again.gpus == first.gpus and again.timestamp == first.timestamp
        assert again.gpus[0] is not first.gpus[0]  # a copy each answer
        assert await utilization(isolator, "c2") == 11  # never read: read now
        assert runtime.executor_jobs() == jobs + 1
        runtime.Clock.advance(0.01)  # older than the bound: read again
        assert await utilization(isolator, "c1") == 77
        assert runtime.executor_jobs() == jobs + 2
        for cid in ("c1", "c2"):
            await isolator.cleanup(ContainerID(cid))


@pytest.mark.asyncio
async def test_usage_with_no_age_allowed_reads_nvml_every_time(memory_node) -> None:
    async with runtime.Runtime():
        runtime.Clock.pause()
        components, isolator = await memory_node.start({"nvidia_usage_max_age": "0"})
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=gpus("gpus:1")))
        assert await utilization(isolator, "c1") == 10
        components.nvml.nvml.set_usage(0, utilization_gpu=55)
        jobs = runtime.executor_jobs()
        assert await utilization(isolator, "c1") == 55
        assert runtime.executor_jobs() == jobs + 1
        await isolator.cleanup(ContainerID("c1"))
