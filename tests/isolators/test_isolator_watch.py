"""R-IS-9 (beyond Mesos): ``watch(id)`` resolves with a ContainerLimitation
when one of the container's GPUs turns unhealthy — the GPUs it holds now,
after any update — and is discarded at cleanup."""

from __future__ import annotations

import anyio
import pytest

import runtime
from actors import Gpu
from isolators import ContainerID, ContainerLimitation, Resources
from tests.support.containers import config, started_with
from tests.support.errors import isolator_failure


async def outcome(future):
    """The value of ``future`` once every actor is idle (never waits forever)."""
    await runtime.Clock.settle()
    assert future.is_ready(), f"the watch is still {future.state}"
    return future.get()


def allocator_watchers(components) -> int:
    process = runtime.current_runtime()._processes[components.allocator.pid]
    return len(process._watchers)


@pytest.mark.asyncio
async def test_watch_resolves_when_a_gpu_of_the_container_turns_unhealthy(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("a"), config("gpus:2"))     # [0, 1]
        await isolator.prepare(ContainerID("b"), config("gpus:1"))     # [2]
        watch_a = isolator.watch(ContainerID("a"))
        watch_b = isolator.watch(ContainerID("b"))
        await components.allocator.mark_unhealthy(Gpu(195, 3), "not anybody's")
        await components.allocator.mark_unhealthy(Gpu(195, 1), "Xid 79: fallen off the bus")
        await runtime.Clock.settle()
        limitation = await outcome(watch_a)
        assert isinstance(limitation, ContainerLimitation)
        assert limitation.reason == "REASON_GPU_UNHEALTHY"
        assert "195:1" in limitation.message and "a" in limitation.message
        assert "Xid 79" in limitation.message
        assert limitation.resources.gpus() == 1
        assert watch_b.is_pending()
        # The unhealthy GPU stays with its holder until released, then is withheld.
        await isolator.cleanup(ContainerID("a"))
        assert {g.minor for g in await components.allocator.available()} == {0}
        assert watch_b.is_pending()
        await isolator.cleanup(ContainerID("b"))
        assert watch_b.is_discarded()


@pytest.mark.asyncio
async def test_watch_follows_updates(memory_node) -> None:
    cid = ContainerID("a")
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator.prepare(cid, config("gpus:1"))                   # [0]
        watch = isolator.watch(cid)
        await isolator.update(cid, Resources.parse("gpus:3"))       # [0, 1, 2]
        await isolator.update(cid, Resources.parse("gpus:2"))       # [0, 1]
        await components.allocator.mark_unhealthy(Gpu(195, 2), "given back before it broke")
        await runtime.Clock.settle()
        assert watch.is_pending()
        await components.allocator.mark_unhealthy(Gpu(195, 1), "granted by the update")
        limitation = await outcome(watch)
        assert "195:1" in limitation.message
        await isolator.cleanup(cid)
        assert allocator_watchers(components) == 0


@pytest.mark.asyncio
async def test_watch_of_an_already_unhealthy_gpu_resolves_at_once(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(memory_node, a="gpus:1")
        await components.allocator.mark_unhealthy(Gpu(195, 0), "ECC")
        limitation = await outcome(isolator.watch(ContainerID("a")))
        assert "195:0" in limitation.message and "ECC" in limitation.message
        await isolator.cleanup(ContainerID("a"))


@pytest.mark.asyncio
async def test_watch_errors_and_discard(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator_failure(isolator.watch(ContainerID("nobody")), "Unknown container")
        await isolator_failure(isolator.watch(ContainerID("n", ContainerID("a"))),
                               "Not supported for nested containers")
        await isolator.prepare(ContainerID("a"), config("gpus:1"))
        first = isolator.watch(ContainerID("a"))
        second = isolator.watch(ContainerID("a"))
        await runtime.Clock.settle()  # let both register
        first.discard()
        await runtime.Clock.settle()
        assert first.is_discarded() and second.is_pending()
        await components.allocator.mark_unhealthy(Gpu(195, 0), "gone")
        assert "195:0" in (await outcome(second)).message
        await isolator.cleanup(ContainerID("a"))
        assert allocator_watchers(components) == 0


@pytest.mark.asyncio
async def test_cleanup_discards_watches_and_leaves_no_watcher_behind(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        watches = []
        for round_ in range(5):
            await isolator.prepare(ContainerID("a"), config("gpus:2"))
            watches.append(isolator.watch(ContainerID("a")))
            await isolator.cleanup(ContainerID("a"))
        assert all(w.is_discarded() for w in watches)
        with pytest.raises(runtime.Discarded):
            await watches[0]
        assert allocator_watchers(components) == 0


@pytest.mark.asyncio
async def test_an_nvml_event_resolves_the_watch_without_anybody_polling(memory_node) -> None:
    """R-HE-4 on the simulated node: event -> health monitor -> allocator -> watch()."""
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("a"), config("gpus:1"))     # [0]
        watch = isolator.watch(ContainerID("a"))
        simulated = components.nvml.nvml
        assert simulated.inject_xid(0, 13) == 1                     # the application's fault: ignored
        assert simulated.inject_xid(0, 79) == 1
        with anyio.fail_after(10):                                  # a hang guard
            limitation = await watch
        assert limitation.reason == "REASON_GPU_UNHEALTHY"
        assert limitation.message == "GPU 195:0 of container a became unhealthy: Xid 79"
        await isolator.prepare(ContainerID("b"), config("gpus:1"))     # avoids the unhealthy GPU
        assert await components.allocator.allocated() == {Gpu(195, 0), Gpu(195, 1)}
        await isolator.cleanup(ContainerID("a"))
        assert Gpu(195, 0) not in await components.allocator.available()
        await components.allocator.mark_healthy(Gpu(195, 0))
        assert Gpu(195, 0) in await components.allocator.available()
        await isolator.cleanup(ContainerID("b"))
