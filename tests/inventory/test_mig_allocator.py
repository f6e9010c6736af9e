"""R-MG-3: the allocator hands out units — whole GPUs or MIG devices."""

from __future__ import annotations

import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError
from actors.flags import Flags
from actors.gpu import Gpu
from actors.mig import MigDevice, MigDeviceInfo
from runtime import Runtime

G0 = Gpu(195, 0)


def mig(minor: int, gi: int, ci: int = 0) -> MigDevice:
    return MigDevice(Gpu(195, minor), gi, ci)


async def allocator_for(host_file, **flags) -> NvidiaGpuAllocator:
    f = Flags(host_file=str(host_file), **flags)
    return await NvidiaGpuAllocator.create(f, NvidiaGpuAllocator.resources(f))


@pytest.mark.asyncio
async def test_mixed_hands_out_whole_gpus_and_mig_devices_from_their_own_pools(data_dir):
    async with Runtime():
        allocator = await allocator_for(data_dir / "h200-mig.toml", nvidia_mig_strategy="mixed")
        pools = allocator.pools()
        assert pools["gpus"] == {Gpu(195, 1)}
        assert pools["mig-1g.18gb"] == {mig(0, 3), mig(0, 4)}
        assert allocator.total() == set().union(*pools.values())
        assert isinstance(allocator.info(mig(0, 3)), MigDeviceInfo) and allocator.info(mig(0, 3)).profile == "1g.18gb"

        # Whole GPUs by count come from 'gpus' only: MIG devices never count as GPUs here.
        assert await allocator.allocate(1) == {Gpu(195, 1)}
        with pytest.raises(AllocatorError, match=r"^Requested 1 gpus but only 0 available$"):
            await allocator.allocate(1)

        # MIG devices by resource, lowest first (parent minor, GI, CI), several pools at once.
        got = await allocator.allocate_resources({"mig-1g.18gb": 1, "mig-3g.71gb": 1})
        assert got == {mig(0, 3), mig(0, 1)}
        state = await allocator.state()
        assert state.allocated == [Gpu(195, 1)] and state.mig_allocated == [mig(0, 1), mig(0, 3)]
        assert state.pools == {"gpus": 0, "mig-1c.3g.71gb": 2, "mig-1g.18gb": 1, "mig-2g.35gb": 1, "mig-3g.71gb": 0}

        # All or nothing: a short pool fails the whole request with Mesos' text, changing nothing.
        before = await allocator.state()
        with pytest.raises(AllocatorError, match=r"^Requested 2 mig-1g\.18gb but only 1 available$"):
            await allocator.allocate_resources({"mig-2g.35gb": 1, "mig-1g.18gb": 2})
        assert await allocator.state() == before
        with pytest.raises(AllocatorError) as unknown:
            await allocator.allocate_resources({"mig-2g.20gb": 1})
        assert str(unknown.value) == (
            "Requested 1 mig-2g.20gb but this node offers no 'mig-2g.20gb' (its resources: gpus, mig-1c.3g.71gb,"
            " mig-1g.18gb, mig-2g.35gb, mig-3g.71gb)"
        )
        with pytest.raises(AllocatorError, match="the count must be a non-negative integer"):
            await allocator.allocate_resources({"mig-1g.18gb": 1.5})

        # Units go back and come again; double frees are refused naming the unit.
        await allocator.deallocate({mig(0, 3)})
        with pytest.raises(AllocatorError) as double:
            await allocator.deallocate({mig(0, 3), mig(0, 9)})
        assert str(double.value) == (
            "{195:0/gi3/ci0, 195:0/gi9/ci0} are not allocated (195:0/gi3/ci0 is free;"
            " 195:0/gi9/ci0 is not managed by this allocator)"
        )
        assert await allocator.allocate_resources({"mig-1g.18gb": 2}) == {mig(0, 3), mig(0, 4)}
        await allocator.close()


@pytest.mark.asyncio
async def test_single_counts_mig_devices_as_gpus_lowest_first(tmp_path):
    path = tmp_path / "a100.toml"
    path.write_text(
        "[[gpus]]\nmemory_total_mib = 40536\nmig = true\nnuma_node = 0\nmig_devices = ["
        "{gi = 1, ci = 0, profile = '3g.20gb'}, {gi = 2, ci = 0, profile = '3g.20gb'}]\n"
        "[[gpus]]\nmemory_total_mib = 40536\nmig = true\nnuma_node = 0\nmig_devices = ["
        "{gi = 1, ci = 0, profile = '3g.20gb'}]\n"
    )
    async with Runtime():
        allocator = await allocator_for(path, nvidia_mig_strategy="single")
        assert allocator.total() == {mig(0, 1), mig(0, 2), mig(1, 1)}
        assert await allocator.allocate(2) == {mig(0, 1), mig(0, 2)}
        assert await allocator.allocate_resources({"gpus": 1}) == {mig(1, 1)}
        with pytest.raises(AllocatorError, match=r"^Requested 1 gpus but only 0 available$"):
            await allocator.allocate(1)
        await allocator.close()


@pytest.mark.asyncio
async def test_mig_devices_are_reclaimed_withheld_and_watched_like_gpus(data_dir):
    async with Runtime():
        allocator = await allocator_for(data_dir / "h200-mig.toml", nvidia_mig_strategy="mixed")
        await allocator.reclaim({mig(0, 2), Gpu(195, 1)})
        assert await allocator.allocated() == {mig(0, 2), Gpu(195, 1)}
        watch = allocator.watch({mig(0, 2)})
        change = await allocator.mark_unhealthy(mig(0, 4), "Xid 79")
        assert change.gpu == mig(0, 4) and not watch.is_ready()
        await allocator.mark_unhealthy(mig(0, 2), "Xid 48")
        assert (await watch).gpu == mig(0, 2)
        with pytest.raises(AllocatorError, match=r"^Requested 2 mig-1g\.18gb but only 1 available \(1 more withheld as unhealthy\)$"):
            await allocator.allocate_resources({"mig-1g.18gb": 2})
        assert (await allocator.state()).unhealthy == {"195:0/gi2/ci0": "Xid 48", "195:0/gi4/ci0": "Xid 79"}
        await allocator.mark_healthy(mig(0, 4))
        assert await allocator.allocate_resources({"mig-1g.18gb": 2}) == {mig(0, 3), mig(0, 4)}
        with pytest.raises(AllocatorError, match="is not managed by this allocator"):
            await allocator.mark_unhealthy(mig(3, 0))
        await allocator.close()


@pytest.mark.asyncio
async def test_a_node_of_only_mig_devices_touches_whole_gpus_never(data_dir):
    async with Runtime():
        allocator = await allocator_for(
            data_dir / "h200-mig.toml", nvidia_mig_strategy="mixed", nvidia_gpu_devices=[0], resources="mig-3g.71gb:0"
        )
        assert "gpus" not in allocator.pools() and "mig-3g.71gb" in allocator.pools()
        assert allocator.pools()["mig-3g.71gb"] == set()
        assert len(allocator.total()) == 3
        await allocator.close()
