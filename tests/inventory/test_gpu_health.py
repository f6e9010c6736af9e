"""R-HE-1..4 on the simulated node: health events reach the allocator.

The simulated node raises events the way NVML does (only to event sets
registered for that GPU and type); the allocator's health monitor waits on
its own thread and hands each event over. Waits for an effect are bounded
(``anyio.fail_after``) so a hang fails instead of stalling; no timing is
asserted. The same path through the real ``pynvml`` and the fake C library
is in ``test_fake_nvml_health.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import GpuHealth
from actors.flags import Flags
from actors.gpu import Gpu
from actors.mig import MigDevice
from actors.nvml import SimulatedNvml
from actors.resources import Resources
from runtime import Clock, Runtime

GUARD = 10  # seconds: a hang guard, never a timing assertion


def gpus(*minors: int) -> set[Gpu]:
    return {Gpu(195, m) for m in minors}


def node(text: str = "gpu_count = 4") -> SimulatedNvml:
    nvml = SimulatedNvml.from_text(text)
    nvml.init()
    return nvml


async def eventually(check: Callable[[], bool]) -> None:
    with anyio.fail_after(GUARD):
        while not check():
            await anyio.sleep(0.005)


async def unhealthy_soon(allocator: NvidiaGpuAllocator, gpu: Gpu) -> GpuHealth:
    with anyio.fail_after(GUARD):
        return await allocator.watch({gpu})


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_monitoring_starts_with_the_allocator_and_withholds_gpus_raising_critical_events(backend):
    # The whole path (the monitor's own thread, the hand-over to the
    # allocator actor, watch(), mark_healthy) under each event loop anyio runs.
    anyio.run(monitoring_scenario, backend=backend)


async def monitoring_scenario() -> None:
    nvml = node()
    async with Runtime():
        allocator = await NvidiaGpuAllocator.create(Flags(), Resources.parse("gpus:4"), nvml)
        assert allocator.monitor is not None  # on by default, before any watch()
        assert nvml.inject_xid(2, 79) == 1  # registered at create: the event is not lost
        assert await unhealthy_soon(allocator, Gpu(195, 2)) == GpuHealth(
            gpu=Gpu(195, 2), healthy=False, reason="Xid 79"
        )
        # Xid 13 is the application's fault: nothing changes. Events are handed
        # over in order, so once GPU 0's Xid 48 is seen, GPU 1's Xid 13 was too.
        nvml.inject_xid(1, 13)
        nvml.inject_xid(0, 48)
        assert (await unhealthy_soon(allocator, Gpu(195, 0))).reason == "Xid 48"
        nvml.inject_ecc(3)
        assert (await unhealthy_soon(allocator, Gpu(195, 3))).reason == "double-bit ECC error"
        assert await allocator.unhealthy() == {
            Gpu(195, 0): "Xid 48", Gpu(195, 2): "Xid 79", Gpu(195, 3): "double-bit ECC error",
        }
        assert await allocator.available() == gpus(1)
        assert await allocator.allocate(1) == gpus(1)
        # The operator returns a GPU to the pool.
        assert await allocator.mark_healthy(Gpu(195, 2)) == GpuHealth(gpu=Gpu(195, 2), healthy=True)
        assert await allocator.available() == gpus(2)
        assert (await allocator.state()).unwatched == []
        await allocator.close()
        # closed: the event set is freed at once, or by the waiting thread as its wait ends
        await eventually(lambda: nvml.live_event_sets == 0)
    assert nvml.inject_xid(0, 79) == 0  # nobody hears it


@pytest.mark.asyncio
async def test_the_ignored_xids_are_a_flag():
    nvml = node()
    async with Runtime():
        allocator = await NvidiaGpuAllocator.create(
            Flags(nvidia_ignored_xids=[79]), Resources.parse("gpus:4"), nvml
        )
        nvml.inject_xid(1, 79)   # ignored here
        nvml.inject_xid(1, 13)   # no longer ignored
        assert (await unhealthy_soon(allocator, Gpu(195, 1))).reason == "Xid 13"
        await allocator.close()


@pytest.mark.asyncio
async def test_a_gpu_without_ecc_events_still_reports_xids_and_one_with_none_is_unwatched(caplog):
    nvml = node('[[gpus]]\nsupported_events = ["xid"]\n[[gpus]]\nsupported_events = []\n[[gpus]]\n')
    with caplog.at_level(logging.WARNING, logger="actors.nvml"):
        async with Runtime():
            allocator = await NvidiaGpuAllocator.create(Flags(), Resources.parse("gpus:3"), nvml)
            assert (await allocator.state()).unwatched == ["195:1"]
            assert nvml.inject_ecc(0) == 0  # not supported, not registered
            assert nvml.inject_xid(1, 79) == 0  # supports nothing: nobody hears it
            nvml.inject_xid(0, 79)
            assert (await unhealthy_soon(allocator, Gpu(195, 0))).reason == "Xid 79"
            assert await allocator.available() == gpus(1, 2)  # unknown health: still handed out
            await allocator.close()
    logged = [r.getMessage() for r in caplog.records if "GPU index 1" in r.getMessage()]
    assert logged == [
        "GPU index 1 reports neither Xid nor double-bit ECC events (supported event types 0x0);"
        " its health is unknown: it is handed out unwatched"
    ]


@pytest.mark.asyncio
async def test_health_checks_off_watch_nothing():
    nvml = node()
    async with Runtime():
        allocator = await NvidiaGpuAllocator.create(
            Flags(nvidia_health_checks=False), Resources.parse("gpus:4"), nvml
        )
        assert allocator.monitor is None
        assert nvml.inject_xid(0, 79) == 0  # no event set at all
        assert (await allocator.state()).unwatched == ["195:0", "195:1", "195:2", "195:3"]
        await allocator.close()


@pytest.mark.asyncio
async def test_wait_errors_back_off_then_every_gpu_is_withheld(caplog):
    nvml = node("gpu_count = 2")
    nvml.fail("nvmlEventSetWait_v2", 999)
    with caplog.at_level(logging.WARNING, logger="actors.allocator"):
        async with Runtime():
            Clock.pause()
            allocator = await NvidiaGpuAllocator.create(
                Flags(nvidia_health_wait=0.05), Resources.parse("gpus:2"), nvml
            )
            watch = allocator.watch(gpus(0, 1))

            def failures() -> list[str]:
                return [r.getMessage() for r in caplog.records if "Waiting for NVML health events failed" in r.getMessage()]

            for count, backoff in enumerate([1, 2, 4, 8], start=1):
                await eventually(lambda: len(failures()) == count)
                assert watch.is_pending()  # not yet: retrying
                Clock.advance(backoff)
            await eventually(lambda: len(failures()) == 5)
            reason = (
                "node health unknown: waiting for NVML health events failed 5 times in a row:"
                " nvmlEventSetWait_v2 failed: Unknown Error (NVML_ERROR_UNKNOWN)"
            )
            with anyio.fail_after(GUARD):
                assert await watch == GpuHealth(gpu=Gpu(195, 0), healthy=False, reason=reason)
            assert await allocator.unhealthy() == {Gpu(195, 0): reason, Gpu(195, 1): reason}
            assert [m.split("; ")[-1] for m in failures()] == [
                "retrying in 1s", "retrying in 2s", "retrying in 4s", "retrying in 8s", "retrying in 16s",
            ]
            # NVML recovers: waits succeed again, but the GPUs stay withheld until the operator says.
            nvml.fail("nvmlEventSetWait_v2", None)
            Clock.advance(16)
            await eventually(lambda: any("received again after 5 failed waits" in r.getMessage()
                                         for r in caplog.records))
            assert await allocator.available() == set()
            await allocator.mark_healthy(Gpu(195, 1))
            assert await allocator.available() == gpus(1)
            await allocator.close()


@pytest.mark.asyncio
async def test_the_first_backoff_is_the_flags_and_doubles_up_to_30_seconds(caplog):
    """``Flags.nvidia_health_backoff`` is the first retry's wait; each failure in a row doubles it, at most 30 s."""
    nvml = node("gpu_count = 1")
    nvml.fail("nvmlEventSetWait_v2", 999)
    with caplog.at_level(logging.WARNING, logger="actors.allocator"):
        async with Runtime():
            Clock.pause()
            allocator = await NvidiaGpuAllocator.create(
                Flags(nvidia_health_wait=0.05, nvidia_health_backoff=10), Resources.parse("gpus:1"), nvml
            )

            def failures() -> list[str]:
                return [r.getMessage() for r in caplog.records
                        if "Waiting for NVML health events failed" in r.getMessage()]

            for count, backoff in enumerate([10, 20, 30], start=1):
                await eventually(lambda: len(failures()) == count)
                Clock.advance(backoff)
            await eventually(lambda: len(failures()) == 4)
            assert [m.split("; ")[-1] for m in failures()] == [
                "retrying in 10s", "retrying in 20s", "retrying in 30s", "retrying in 30s",
            ]
            await allocator.close()


@pytest.mark.asyncio
async def test_events_on_a_mig_gpu_withhold_its_mig_devices(data_dir):
    nvml = SimulatedNvml.from_file(data_dir / "h200-mig.toml")
    nvml.init()
    flags = Flags(nvidia_mig_strategy="mixed")
    async with Runtime():
        allocator = await NvidiaGpuAllocator.create(flags, NvidiaGpuAllocator.resources(flags, nvml), nvml)
        gi3 = MigDevice(Gpu(195, 0), 3, 0)
        nvml.inject_xid(0, 79, gpu_instance=3)  # one GPU instance: only its devices
        assert await unhealthy_soon(allocator, gi3) == GpuHealth(gpu=gi3, healthy=False, reason="Xid 79")
        assert await allocator.unhealthy() == {gi3: "Xid 79"}
        nvml.inject_ecc(2)  # the whole GPU: every MIG device on it
        await unhealthy_soon(allocator, MigDevice(Gpu(195, 2), 1, 1))
        assert await allocator.unhealthy() == {
            gi3: "Xid 79",
            MigDevice(Gpu(195, 2), 1, 0): "double-bit ECC error",
            MigDevice(Gpu(195, 2), 1, 1): "double-bit ECC error",
        }
        assert Gpu(195, 1) in await allocator.available()  # a whole GPU of its own, untouched
        await allocator.close()


@pytest.mark.asyncio
async def test_health_generations_report_every_change_including_recovery():
    # What the kubelet plugin's ListAndWatch waits on (R-K8-2): one new
    # generation per change, recovery included; a discarded wait is dropped.
    nvml = node()
    async with Runtime():
        allocator = await NvidiaGpuAllocator.create(Flags(), Resources.parse("gpus:4"), nvml)
        first = await allocator.health_since(None)
        assert first.unhealthy == {}
        waiting = allocator.health_since(first.generation)
        assert waiting.is_pending()
        nvml.inject_xid(2, 79)
        with anyio.fail_after(GUARD):
            second = await waiting
        assert second.generation == first.generation + 1 and second.unhealthy == {Gpu(195, 2): "Xid 79"}
        assert (await allocator.health_since(first.generation)) == second  # behind: answered at once
        dropped = allocator.health_since(second.generation)
        dropped.discard()
        await allocator.mark_unhealthy(Gpu(195, 2), "Xid 79")  # no change: no new generation
        assert (await allocator.health_since(None)).generation == second.generation
        back = allocator.health_since(second.generation)
        await allocator.mark_healthy(Gpu(195, 2))
        third = await back
        assert third.generation == second.generation + 1 and third.unhealthy == {}
        assert dropped.is_discarded()  # a discarded wait was dropped, not answered
        await allocator.close()


@pytest.mark.asyncio
async def test_preferred_is_the_allocators_choice_without_allocating(data_dir):
    nvml = SimulatedNvml.from_file(data_dir / "dgx8-nvlink.toml")
    nvml.init()
    async with Runtime():
        allocator = await NvidiaGpuAllocator.create(Flags(), Resources.parse("gpus:8"), nvml)
        every = gpus(*range(8))
        assert await allocator.preferred(gpus(1, 2, 3, 4, 5, 6, 7), 4) == sorted(gpus(4, 5, 6, 7))
        assert await allocator.preferred(every, 2, gpus(6)) == sorted(gpus(6, 7))
        assert await allocator.available() == every  # nothing was allocated
        with pytest.raises(Exception, match="must be included but are not among the candidates"):
            await allocator.preferred(gpus(0, 1), 2, gpus(5))
        with pytest.raises(Exception, match="not managed by this allocator"):
            await allocator.preferred({Gpu(195, 9)}, 1)
        with pytest.raises(Exception, match="Cannot choose 3 of 2 candidates"):
            await allocator.preferred(gpus(0, 1), 3)
        await allocator.close()
