"""R-IS-8: many containers at once — 50 simultaneous prepares of one GPU on
a 4-GPU node give exactly 4 successes; prepare and cleanup of one id racing
leave every GPU free; calls for one id apply in arrival order."""

from __future__ import annotations

import re

import pytest

import runtime
from isolators import ContainerConfig, ContainerID, Resources
from tests.support.containers import config, started_with
from tests.support.errors import assert_isolator_error


async def settle(futures):
    """Every future's outcome: its value or its exception (in order)."""
    done = await runtime.await_all(futures)
    return [f.get() if f.is_ready() else f.failure() for f in done]


@pytest.mark.asyncio
async def test_fifty_simultaneous_prepares_on_four_gpus(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        ids = [ContainerID(f"c{i}") for i in range(50)]
        outcomes = await settle([isolator.prepare(cid, config(1)) for cid in ids])
        winners = [cid.value for cid, out in zip(ids, outcomes) if not isinstance(out, BaseException)]
        losers = [out for out in outcomes if isinstance(out, BaseException)]
        assert len(winners) == 4 and len(losers) == 46
        for loser in losers:
            assert_isolator_error(loser, "Requested 1 gpus but only 0 available")
        held = await isolator.containers()
        assert sorted(held) == sorted(winners)
        assert sorted(m for minors in held.values() for m in minors) == [0, 1, 2, 3]
        assert await components.allocator.available() == set()
        assert sorted(await isolator.devices.list_cgroups()) == sorted(winners)
        await settle([isolator.cleanup(cid) for cid in ids])
        assert await components.allocator.available() == components.allocator.total()
        assert await isolator.devices.list_cgroups() == []
        assert await isolator.containers() == {}


@pytest.mark.asyncio
async def test_prepare_and_cleanup_of_one_id_racing(node) -> None:
    cid = ContainerID("racer")
    async with runtime.Runtime():
        components, isolator = await node.start()
        futures = []
        for i in range(20):
            asked = config(f"gpus:{1 + i % 4}")
            if i % 2:
                futures += [isolator.cleanup(cid), isolator.prepare(cid, asked), isolator.cleanup(cid)]
            else:
                futures += [isolator.prepare(cid, asked), isolator.update(cid, Resources.parse("gpus:2")),
                            isolator.cleanup(cid)]
        outcomes = await settle(futures)
        assert not [o for o in outcomes if isinstance(o, BaseException)]
        assert await components.allocator.available() == components.allocator.total()
        assert await components.allocator.allocated() == set()
        assert await isolator.containers() == {}
        assert await isolator.devices.list_cgroups() == []


@pytest.mark.asyncio
async def test_racing_over_several_ids_leaks_nothing(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        futures = []
        for round_ in range(10):
            for n in range(6):
                cid = ContainerID(f"c{n}")
                futures.append(isolator.prepare(cid, config(f"gpus:{n % 3}")))
                futures.append(isolator.update(cid, Resources.parse(f"gpus:{(n + round_) % 3}")))
                futures.append(isolator.usage(cid))
                futures.append(isolator.cleanup(cid))
        outcomes = await settle(futures)
        refused = re.compile(r"Requested \d+ gpus but only \d+ available|Unknown container")
        for out in outcomes:  # only "not enough GPUs" may fail (or what follows such a failure)
            if isinstance(out, BaseException):
                assert_isolator_error(out, refused)
        assert await components.allocator.available() == components.allocator.total()
        assert await isolator.containers() == {}


@pytest.mark.asyncio
async def test_calls_for_one_id_apply_in_arrival_order(node) -> None:
    cid = ContainerID("c1")
    async with runtime.Runtime():
        components, isolator = await node.start()
        futures = [
            isolator.update(cid, Resources.parse("gpus:1")),          # before prepare: unknown
            isolator.usage(cid),                                      # before prepare: unknown
            isolator.prepare(cid, config(1)),
            isolator.usage(cid),                                      # 1 GPU
            isolator.update(cid, Resources.parse("gpus:3")),
            isolator.usage(cid),                                      # 3 GPUs
            isolator.prepare(cid, config(1)),                         # already prepared
            isolator.update(cid, Resources.parse("gpus:2")),
            isolator.containers(),
            isolator.usage(cid),                                      # 2 GPUs
            isolator.cleanup(cid),
            isolator.usage(cid),                                      # unknown again
            isolator.prepare(cid, config("gpus:4")),
            isolator.usage(cid),                                      # 4 GPUs
        ]
        out = await settle(futures)
        assert_isolator_error(out[0], "Unknown container")
        assert_isolator_error(out[1], "Unknown container")
        assert out[2] is None
        assert [g.minor for g in out[3].gpus] == [0]
        assert out[4] is None
        assert [g.minor for g in out[5].gpus] == [0, 1, 2]
        assert_isolator_error(out[6], "Container has already been prepared")
        assert out[7] is None
        assert [g.minor for g in out[9].gpus] == [0, 1]
        assert out[10] is None
        assert_isolator_error(out[11], "Unknown container")
        assert out[12] is None
        assert [g.minor for g in out[13].gpus] == [0, 1, 2, 3]
        await isolator.cleanup(cid)
        assert await components.allocator.available() == components.allocator.total()


@pytest.mark.asyncio
async def test_different_containers_do_not_wait_for_each_other(memory_node) -> None:
    """A call on one id is not queued behind a pending call on another."""
    async with runtime.Runtime():
        components, isolator = await started_with(memory_node, a=1)
        # Hold the allocator: a's update waits on it; b's usage must still answer.
        gate = runtime.Promise()
        original = components.allocator.allocate_resources

        def slow_allocate(request, holder=None):
            return gate.future.then(lambda _: original(request, holder))

        components.allocator.allocate_resources = slow_allocate
        update = isolator.update(ContainerID("a"), Resources.parse("gpus:2"))
        await isolator.prepare(ContainerID("b"), ContainerConfig())
        assert (await isolator.usage(ContainerID("b"))).gpus_allocated == 0
        assert update.is_pending()
        gate.set_value(None)
        await update
        assert await isolator.containers() == {"a": [0, 1], "b": []}
