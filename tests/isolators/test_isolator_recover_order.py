"""Recovery is serialized (issue 20 item 4), judged by the kernel on memory,
cgroups v1 and v2: two recoveries issued together neither fail nor leak; a
call issued right after ``recover()`` (not awaited) waits for it -- a prepare
never gets a GPU a recovered container holds in the kernel, a prepare of an
id being recovered is refused without touching its cgroup, usage and
cleanup see the recovered record; and a recovery waits for the calls issued
before it."""

from __future__ import annotations

import pytest

import runtime
from isolators import ContainerID, ContainerState, IsolatorError, Resources
from tests.support.containers import config
from tests.support.nodes import judge


def states(*names: str) -> list[ContainerState]:
    return [ContainerState(ContainerID(n), pid=1000 + i, directory=f"/sandbox/{n}") for i, n in enumerate(names)]


async def crashed_with(node, **containers: int):
    """Prepare ``containers`` (name -> GPUs), crash the agent, start a fresh one."""
    components, isolator = await node.start()
    for name, gpus in containers.items():
        await isolator.prepare(ContainerID(name), config(f"gpus:{gpus}"))
    await node.crash(components, isolator)
    return await node.start()


async def outcome(future):
    try:
        return await future
    except Exception as error:
        return error


@pytest.mark.asyncio
async def test_two_recoveries_issued_together_neither_fail_nor_leak(node) -> None:
    async with runtime.Runtime():
        components, isolator = await crashed_with(node, a=1, b=2)
        first = isolator.recover(states("a", "b"), set())
        second = isolator.recover(states("a", "b"), set())
        assert await outcome(first) is None and await outcome(second) is None
        assert await isolator.containers() == {"a": [0], "b": [1, 2]}
        assert {g.minor for g in await components.allocator.available()} == {3}
        assert isolator.recovery_report == []
        await judge(node, {"a": 1, "b": 2})
        for name in ("a", "b"):
            await isolator.cleanup(ContainerID(name))
        assert {g.minor for g in await components.allocator.available()} == {0, 1, 2, 3}
        await judge(node, {})


@pytest.mark.asyncio
async def test_a_prepare_issued_right_after_recover_waits_for_it(node) -> None:
    async with runtime.Runtime():
        components, isolator = await crashed_with(node, a=1, b=2)
        recovered = isolator.recover(states("a", "b"), set())
        fresh = isolator.prepare(ContainerID("new"), config("gpus:1"))   # not awaited in between
        too_many = isolator.prepare(ContainerID("more"), config("gpus:1"))
        assert await outcome(recovered) is None
        assert await outcome(fresh) is None
        error = await outcome(too_many)
        assert type(error) is IsolatorError and str(error) == "Requested 1 gpus but only 0 available"
        assert await isolator.containers() == {"a": [0], "b": [1, 2], "new": [3]}
        await judge(node, {"a": 1, "b": 2, "new": 1})
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_prepare_of_an_id_being_recovered_is_refused_and_leaves_its_cgroup_alone(node) -> None:
    async with runtime.Runtime():
        components, isolator = await crashed_with(node, a=2)
        recovered = isolator.recover(states("a"), set())
        again = isolator.prepare(ContainerID("a"), config("gpus:1"))
        stats = isolator.usage(ContainerID("a"))
        assert await outcome(recovered) is None
        error = await outcome(again)
        assert type(error) is IsolatorError and str(error) == "Container has already been prepared"
        assert [g.minor for g in (await stats).gpus] == [0, 1]
        assert await isolator.containers() == {"a": [0, 1]}
        await judge(node, {"a": 2})  # the live cgroup still grants exactly GPUs 0 and 1
        cleaned = isolator.cleanup(ContainerID("a"))
        await cleaned
        await judge(node, {})


@pytest.mark.asyncio
async def test_calls_issued_after_recover_apply_in_order_after_it(node) -> None:
    async with runtime.Runtime():
        components, isolator = await crashed_with(node, a=1)
        calls = [
            isolator.recover(states("a"), set()),
            isolator.update(ContainerID("a"), Resources.parse("gpus:3")),
            isolator.usage(ContainerID("a")),
            isolator.cleanup(ContainerID("a")),
            isolator.prepare(ContainerID("a"), config("gpus:4")),
        ]
        results = [await outcome(call) for call in calls]
        assert results[0] is None and results[1] is None and results[3] is None and results[4] is None
        assert [g.minor for g in results[2].gpus] == [0, 1, 2]
        assert await isolator.containers() == {"a": [0, 1, 2, 3]}
        await judge(node, {"a": 4})
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_recovery_waits_for_the_calls_issued_before_it(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        prepared = isolator.prepare(ContainerID("a"), config("gpus:2"))
        recovered = isolator.recover(states("a"), set())  # a is being prepared: not an orphan, not recovered twice
        assert await outcome(prepared) is None and await outcome(recovered) is None
        assert await isolator.containers() == {"a": [0, 1]} and isolator.recovery_report == []
        await judge(node, {"a": 2})
        await node.clean_all()
