"""The allocator actor (R-AL-1..3) driven through its handle."""

from __future__ import annotations

import asyncio
import threading

import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError, GpuHealth
from actors.flags import Flags
from actors.gpu import Gpu
from actors.nvml import NvmlService, NvmlUnavailable, SimulatedNvml, read_inventory
from actors.nvml.testing import nvml_library_missing
from actors.resources import Resources
from runtime import Clock, Future, ProcessTerminated, Runtime


def gpus(*minors: int) -> set[Gpu]:
    return {Gpu(195, minor) for minor in minors}


async def allocator_for(host_file, **flags) -> NvidiaGpuAllocator:
    f = Flags(host_file=str(host_file), **flags)
    return await NvidiaGpuAllocator.create(f, NvidiaGpuAllocator.resources(f))


@pytest.fixture
def node4(tmp_path):
    path = tmp_path / "node4.toml"
    path.write_text("gpu_count = 4\n")
    return path


@pytest.mark.asyncio
async def test_mesos_allocator_scenario(node4):
    async with Runtime():
        allocator = await allocator_for(node4)
        total = allocator.total()
        assert total == gpus(0, 1, 2, 3)

        # Allocate all GPUs at once; none is left.
        allocation = await allocator.allocate(len(total))
        assert allocation == total
        with pytest.raises(AllocatorError, match=r"^Requested 1 gpus but only 0 available$"):
            await allocator.allocate(1)

        # Free all GPUs at once and reallocate them by reference.
        await allocator.deallocate(allocation)
        assert await allocator.allocate(allocation) is None
        assert await allocator.available() == set()

        # Free one GPU and reallocate it: the same one comes back.
        first = min(allocation)
        await allocator.deallocate({first})
        assert await allocator.allocate(1) == {first}

        # Allocating 0 GPUs gives the empty set.
        assert await allocator.allocate(0) == set()

        # Free all GPUs; freeing again fails (a double free).
        await allocator.deallocate(allocation)
        with pytest.raises(AllocatorError) as caught:
            await allocator.deallocate(allocation)
        assert str(caught.value).startswith("{195:0, 195:1, 195:2, 195:3} are not allocated")

        # A bogus GPU can be neither allocated nor freed.
        bogus = Gpu(999, 999)
        with pytest.raises(AllocatorError, match=r"^\{999:999\} are not available \(999:999 is not managed"):
            await allocator.allocate({bogus})
        with pytest.raises(AllocatorError, match=r"^\{999:999\} are not allocated \(999:999 is not managed"):
            await allocator.deallocate({bogus})
        assert await allocator.available() == total
        await allocator.close()


@pytest.mark.asyncio
async def test_take_free_takes_every_unit_not_allocated_in_one_call(node4):
    """What an isolator holds back while a cgroup may reach any GPU: every free
    GPU, unhealthy ones too (they would come back with mark_healthy)."""
    async with Runtime():
        allocator = await allocator_for(node4)
        held = await allocator.allocate(1)
        await allocator.mark_unhealthy(Gpu(195, 3), "Xid 79")
        taken = await allocator.take_free()
        assert taken == allocator.total() - held and Gpu(195, 3) in taken
        assert await allocator.available() == set() and await allocator.allocated() == allocator.total()
        assert await allocator.take_free() == set()
        await allocator.deallocate(taken)
        assert await allocator.available() == allocator.total() - held - gpus(3)
        await allocator.close()


@pytest.mark.asyncio
async def test_a_failed_call_changes_nothing(node4):
    async with Runtime():
        allocator = await allocator_for(node4)
        await allocator.allocate({Gpu(195, 1)})
        with pytest.raises(AllocatorError, match=r"^\{195:1\} are not available \(195:1 is allocated\)$"):
            await allocator.allocate(gpus(0, 1))
        with pytest.raises(AllocatorError, match=r"^\{195:2\} are not allocated \(195:2 is free\)$"):
            await allocator.deallocate(gpus(1, 2))
        with pytest.raises(AllocatorError, match="Requested 4 gpus but only 3 available"):
            await allocator.allocate(4)
        assert await allocator.available() == gpus(0, 2, 3)
        assert await allocator.allocated() == gpus(1)
        with pytest.raises(AllocatorError, match="non-negative integer"):
            await allocator.allocate(-1)
        with pytest.raises(AllocatorError, match="takes a count or a set of GPUs"):
            await allocator.allocate(1.0)  # type: ignore[arg-type]
        with pytest.raises(AllocatorError, match="the single GPU 195:0"):
            await allocator.allocate(Gpu(195, 0))  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_concurrent_requests_never_hand_out_a_gpu_twice(node4):
    async with Runtime():
        allocator = await allocator_for(node4)
        results = await asyncio.gather(*(allocator.allocate(1) for _ in range(10)), return_exceptions=True)
        granted = [r for r in results if isinstance(r, set)]
        refused = [r for r in results if isinstance(r, AllocatorError)]
        assert len(granted) == 4 and len(refused) == 6
        assert set().union(*granted) == gpus(0, 1, 2, 3)


@pytest.mark.asyncio
async def test_one_allocator_shared_by_two_users(node4):
    async with Runtime():
        allocator = await allocator_for(node4)
        shared = NvidiaGpuAllocator(allocator.pid, allocator.total())
        assert shared == allocator and hash(shared) == hash(allocator)
        taken = await allocator.allocate(2)
        assert await shared.available() == gpus(0, 1, 2, 3) - taken


@pytest.mark.asyncio
async def test_devices_flag_picks_the_managed_gpus_by_nvml_index(data_dir):
    async with Runtime():
        allocator = await allocator_for(
            data_dir / "mixed.json", resources="gpus:2", nvidia_gpu_devices=[1, 3]
        )
        assert allocator.total() == gpus(1, 0)  # index 1 is minor 1, index 3 is minor 0
        assert allocator.info(Gpu(195, 0)).index == 3
        assert await allocator.allocate(2) == gpus(0, 1)


@pytest.mark.asyncio
async def test_no_gpus_means_no_nvml_at_all(tmp_path):
    absent = tmp_path / "never-read.toml"
    async with Runtime():
        flags = Flags(host_file=str(absent), resources="gpus:0")
        allocator = await NvidiaGpuAllocator.create(flags, Resources())
        assert allocator.total() == set() and allocator.nvml is None
        assert await allocator.allocate(0) == set()
        with pytest.raises(AllocatorError, match="Requested 1 gpus but only 0 available"):
            await allocator.allocate(1)


@pytest.mark.asyncio
async def test_create_reports_nvml_errors_and_bad_indices():
    async with Runtime():
        nvml = SimulatedNvml.with_gpus(2)
        nvml.init()
        flags = Flags(resources="gpus:1", nvidia_gpu_devices=[5])
        with pytest.raises(AllocatorError, match=r"^Failed to nvml::deviceGetHandleByIndex: no GPU with index 5"):
            await NvidiaGpuAllocator.create(flags, Resources.parse("gpus:1"), nvml)
        nvml.fail("nvmlDeviceGetMinorNumber", 15)
        with pytest.raises(AllocatorError) as caught:
            await NvidiaGpuAllocator.create(Flags(), Resources.parse("gpus:2"), nvml)
        assert str(caught.value) == (
            "Failed to read the GPU inventory from NVML: nvmlDeviceGetMinorNumber failed:"
            " GPU is lost (NVML_ERROR_GPU_IS_LOST); GPU index 0"
        )


# ------------------------------------------------------------------ topology (R-AL-2)


@pytest.mark.asyncio
async def test_a_request_for_four_lands_on_one_nvlink_island(data_dir):
    async with Runtime():
        allocator = await allocator_for(data_dir / "dgx8-nvlink.toml")
        assert await allocator.allocate(4) == gpus(0, 1, 2, 3)
        await allocator.deallocate(gpus(0, 1, 2, 3))
        # With GPU 0 taken, the only whole island left is 4-7 (lowest-first would take 1-4).
        assert await allocator.allocate(1) == gpus(0)
        assert await allocator.allocate(4) == gpus(4, 5, 6, 7)
        # A pair prefers NVLink plus a shared PCIe switch: 2-3, not 1-2.
        assert await allocator.allocate(2) == gpus(2, 3)


@pytest.mark.asyncio
async def test_pcie_box_prefers_gpus_behind_one_switch(data_dir):
    async with Runtime():
        allocator = await allocator_for(data_dir / "pcie4.toml")
        assert await allocator.allocate(1) == gpus(0)
        assert await allocator.allocate(2) == gpus(2, 3)


@pytest.mark.asyncio
async def test_without_topology_facts_it_is_mesos_lowest_first(tmp_path, data_dir):
    plain = tmp_path / "plain8.toml"
    plain.write_text("gpu_count = 8\n")
    async with Runtime():
        allocator = await allocator_for(plain)
        assert await allocator.allocate(1) == gpus(0)
        assert await allocator.allocate(4) == gpus(1, 2, 3, 4)
        lowest = await allocator_for(data_dir / "dgx8-nvlink.toml", gpu_allocation="lowest")
        assert await lowest.allocate(1) == gpus(0)
        assert await lowest.allocate(4) == gpus(1, 2, 3, 4)


# ------------------------------------------------------------------ health (R-AL-3)


@pytest.mark.asyncio
async def test_unhealthy_gpus_are_not_handed_out(data_dir):
    async with Runtime():
        allocator = await allocator_for(data_dir / "dgx8-nvlink.toml")
        change = await allocator.mark_unhealthy(Gpu(195, 0), "fell off the bus")
        assert change == GpuHealth(gpu=Gpu(195, 0), healthy=False, reason="fell off the bus")
        assert await allocator.unhealthy() == {Gpu(195, 0): "fell off the bus"}
        assert Gpu(195, 0) not in await allocator.available()
        with pytest.raises(AllocatorError, match=r"^Requested 8 gpus but only 7 available \(1 more withheld as unhealthy\)$"):
            await allocator.allocate(8)
        with pytest.raises(AllocatorError, match=r"\{195:0\} are not available \(195:0 is unhealthy: fell off the bus\)"):
            await allocator.allocate(gpus(0))
        assert await allocator.allocate(4) == gpus(4, 5, 6, 7)
        # Recovery reclaims what a surviving container holds, whatever its health.
        await allocator.reclaim(gpus(0))
        with pytest.raises(AllocatorError, match="195:0 is allocated"):
            await allocator.reclaim(gpus(0))
        await allocator.deallocate(gpus(0))
        assert Gpu(195, 0) not in await allocator.available()  # back in the pool, still withheld
        await allocator.mark_healthy(Gpu(195, 0))
        assert await allocator.available() == gpus(0, 1, 2, 3)
        state = await allocator.state()
        assert state.allocated == sorted(gpus(4, 5, 6, 7)) and state.unhealthy == {}
        with pytest.raises(AllocatorError, match="GPU 999:1 is not managed by this allocator"):
            await allocator.mark_unhealthy(Gpu(999, 1))


@pytest.mark.asyncio
async def test_watch_completes_when_a_watched_gpu_turns_unhealthy(node4):
    async with Runtime():
        allocator = await allocator_for(node4)
        watch = allocator.watch(gpus(1, 2))
        other = allocator.watch(gpus(3))
        await allocator.mark_unhealthy(Gpu(195, 2), "Xid 79")
        assert await watch == GpuHealth(gpu=Gpu(195, 2), healthy=False, reason="Xid 79")
        assert other.is_pending()
        again = await allocator.watch(gpus(2))  # already unhealthy: at once
        assert again.gpu == Gpu(195, 2)
        await allocator.close()
        with pytest.raises(ProcessTerminated):
            await other


# ------------------------------------------------------------------ NVML off the loop (R-NV-2)


class RecordingNvml(SimulatedNvml):
    """Records the threads NVML is called on."""

    def __init__(self, spec):
        super().__init__(spec)
        self.threads: set[str] = set()

    def device_count(self):
        self.threads.add(threading.current_thread().name)
        return super().device_count()

    def minor(self, handle):
        self.threads.add(threading.current_thread().name)
        return super().minor(handle)

    def event_set_wait(self, event_set, timeout_s):
        self.threads.add(threading.current_thread().name)
        return super().event_set_wait(event_set, timeout_s)


@pytest.mark.asyncio
async def test_nvml_calls_run_on_the_executor_not_the_loop(data_dir):
    nvml = RecordingNvml(SimulatedNvml.from_file(data_dir / "mixed.json").spec)
    nvml.init()
    expected = read_inventory(nvml)
    nvml.threads.clear()
    service = NvmlService(nvml)
    async with Runtime():
        inventory = await service.inventory()
        assert inventory == expected
        assert await service.inventory() is inventory  # cached
        usage = await service.usage(Gpu(195, 3))
        assert usage.power_mw == 61000 and usage.utilization_gpu_percent == 37
        assert usage.memory_used_bytes == 1024 * 1024 * 1024
        readings = await service.usages(gpus(0, 1))
        assert set(readings) == gpus(0, 1) and readings[Gpu(195, 0)].power_mw is None
        with pytest.raises(KeyError, match="195:9 is not on this node"):
            await service.usage(Gpu(195, 9))
        registration = await service.start_health_events([0, 1])
        assert registration.registered == {0: ["xid", "ecc"]} and registration.unknown == [1]
        assert await service.wait_health_event(0) is None
        nvml.inject_xid(0, 48)
        assert (await service.wait_health_event(0)).code == 48
        await service.stop_health_events()
        assert await service.count() == 4
        await service.close()
    assert nvml.threads and threading.main_thread().name not in nvml.threads
    assert any(name.startswith("nvml-events") for name in nvml.threads)  # a thread of its own


@pytest.mark.asyncio
async def test_nvml_service_opens_a_host_file(data_dir):
    async with Runtime():
        service = await NvmlService.open(str(data_dir / "pcie4.toml"))
        assert service.kind == "simulated"
        assert [info.minor for info in await service.gpus()] == [0, 1, 2, 3]
        await service.close()
        await service.close()  # idempotent
        with nvml_library_missing():  # no host file and no driver: an error, never a made-up node
            with pytest.raises(NvmlUnavailable, match="^nvmlInit failed: NVML Shared Library Not Found"):
                await NvmlService.open(None)


def test_future_type_is_the_runtimes(node4):
    async def main():
        async with Runtime():
            allocator = await allocator_for(node4)
            future = allocator.allocate(1)
            assert isinstance(future, Future)
            return await future

    assert asyncio.run(main()) == gpus(0)


def test_the_allocator_runs_under_trio_too(data_dir):
    import anyio

    async def main():
        async with Runtime():
            allocator = await allocator_for(data_dir / "dgx8-nvlink.toml")
            first = await allocator.allocate(1)
            island = await allocator.allocate(4)
            usage = await allocator.nvml.usages(island)
            await allocator.close()
            return first, island, usage

    first, island, usage = anyio.run(main, backend="trio")
    assert first == gpus(0) and island == gpus(4, 5, 6, 7)
    assert usage[Gpu(195, 4)].power_mw == 44000
