"""R-IS-7: recover after an agent crash (every actor dropped without
cleanup) — from v1 ``devices.list``, v2 programs read back from the kernel,
or the in-memory table; nested states skipped; a missing cgroup is a
warning; a v2 cgroup with no program of ours may use every device (a broad
grant: it keeps the free GPUs, rewritten to exactly those); one whose
program of our name cannot be read back keeps every free GPU out of the
pool (reported) until it is cleaned up; cgroups nobody named are recovered
as orphans."""

from __future__ import annotations

import logging
import os

import pytest

import runtime
from tests.support.containers import config, started_with
from tests.support.kernel import attach_program, attached_programs, detach_program
from tests.support.nodes import judge
from actors.devices import PROGRAM_NAME
from isolators import ContainerID, ContainerState, Resources
from tests.support.errors import isolator_failure


def states(*names: str) -> list[ContainerState]:
    return [ContainerState(ContainerID(n), pid=1000 + i, directory=f"/sandbox/{n}") for i, n in enumerate(names)]


async def free_minors(components) -> set[int]:
    return {g.minor for g in await components.allocator.available()}


@pytest.mark.asyncio
async def test_crash_and_recover_finds_the_same_gpus_held(node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(node, a="gpus:3")
        await isolator.update(ContainerID("a"), Resources.parse("gpus:1"))       # a: [0]
        await isolator.prepare(ContainerID("b"), config("gpus:2"))                  # b: [1, 2]
        await isolator.prepare(ContainerID("c"), config("cpus:1"))                  # c: []
        before = await isolator.containers()
        assert before == {"a": [0], "b": [1, 2], "c": []}
        await node.crash(components, isolator)

        components, isolator = await node.start()
        assert await free_minors(components) == {0, 1, 2, 3}  # a fresh allocator knows nothing yet
        await isolator.recover(states("a", "b", "c"), set())
        assert await isolator.containers() == before
        assert await free_minors(components) == {3}
        assert isolator.recovery_report == []

        await isolator_failure(isolator.prepare(ContainerID("d"), config("gpus:2")),
                               "Requested 2 gpus but only 1 available")
        await isolator_failure(isolator.update(ContainerID("b"), Resources.parse("gpus:4")),
                               "Requested 2 gpus but only 1 available")
        # The recovered containers work as before.
        await isolator.update(ContainerID("b"), Resources.parse("gpus:1"))
        assert await isolator.containers() == {"a": [0], "b": [1], "c": []}
        stats = await isolator.usage(ContainerID("a"))
        assert [g.minor for g in stats.gpus] == [0]
        for cid in ("a", "b", "c"):
            await isolator.cleanup(ContainerID(cid))
            assert not await isolator.devices.exists(cid)
        assert await free_minors(components) == {0, 1, 2, 3}
        assert await isolator.containers() == {}


@pytest.mark.asyncio
async def test_recover_twice_across_two_crashes(node) -> None:
    async with runtime.Runtime():
        await node.crash(*await started_with(node, a="gpus:2"))
        components, isolator = await node.start()
        await isolator.recover(states("a"), set())
        await isolator.update(ContainerID("a"), Resources.parse("gpus:3"))
        await node.crash(components, isolator)
        components, isolator = await node.start()
        await isolator.recover(states("a"), set())
        assert await isolator.containers() == {"a": [0, 1, 2]}
        assert await free_minors(components) == {3}
        await isolator.cleanup(ContainerID("a"))
        assert await free_minors(components) == {0, 1, 2, 3}


@pytest.mark.asyncio
async def test_recover_skips_nested_and_warns_about_missing_cgroups(node, caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with runtime.Runtime():
        await node.crash(*await started_with(node, a="gpus:1"))
        components, isolator = await node.start()
        nested = ContainerState(ContainerID("child", ContainerID("a")))
        await isolator.recover(states("a", "gone") + [nested], set())
        assert await isolator.containers() == {"a": [0]}
        assert any("gone" in r.getMessage() and "couldn't find the cgroup" in r.getMessage()
                   for r in caplog.records)
        await isolator.cleanup(ContainerID("gone"))   # unknown: silent
        await isolator.cleanup(ContainerID("a"))
        assert await free_minors(components) == {0, 1, 2, 3}


@pytest.mark.asyncio
async def test_cgroups_nobody_named_are_recovered_as_orphans(node) -> None:
    async with runtime.Runtime():
        await node.crash(*await started_with(node, a="gpus:1", b="gpus:2"))
        components, isolator = await node.start()
        await isolator.recover(states("a"), set())
        assert await isolator.containers() == {"a": [0], "b": [1, 2]}
        assert any("Container b" in line and "orphan" in line for line in isolator.recovery_report)
        assert await free_minors(components) == {3}
        await isolator.recover(states("a"), set())  # a second recover changes and reports nothing new
        assert await isolator.containers() == {"a": [0], "b": [1, 2]}
        report = isolator.recovery_report
        assert len(report) == 1
        await isolator.cleanup(ContainerID("b"))
        await isolator.cleanup(ContainerID("a"))
        assert await free_minors(components) == {0, 1, 2, 3}


@pytest.mark.asyncio
async def test_v1_recovers_from_devices_list(node_factory) -> None:
    node = node_factory("cgroups_v1")
    async with runtime.Runtime():
        await node.crash(*await started_with(node, a="gpus:2"))
        with open(os.path.join(node.cgroup_dir("a"), "devices.list")) as handle:
            lines = handle.read().splitlines()
        assert "c 195:0 rwm" in lines and "c 195:1 rwm" in lines and "c 195:2 rwm" not in lines
        # Edit the kernel state behind the agent's back: the kernel is the truth on v1.
        fd = os.open(os.path.join(node.cgroup_dir("a"), "devices.deny"), os.O_WRONLY)
        try:
            os.write(fd, b"c 195:0 rwm")
        finally:
            os.close(fd)
        components, isolator = await node.start()
        await isolator.recover(states("a"), set())
        assert await isolator.containers() == {"a": [1]}
        assert await free_minors(components) == {0, 2, 3}
        await isolator.cleanup(ContainerID("a"))


@pytest.mark.asyncio
async def test_v2_cgroup_without_a_program_of_ours_keeps_only_the_free_gpus(node_factory) -> None:
    node = node_factory("cgroups_v2")
    async with runtime.Runtime():
        await node.crash(*await started_with(node, a="gpus:1"))
        os.mkdir(node.cgroup_dir("ghost"))  # made by someone (a crash before its program): nothing restricts it

        components, isolator = await node.start()
        await isolator.recover(states("a", "ghost"), set())
        assert await isolator.containers() == {"a": [0], "ghost": [1, 2, 3]}
        assert await free_minors(components) == set()
        report = isolator.recovery_report
        assert len(report) == 2 and "ghost" in report[0] and "it keeps GPUs [1, 2, 3]" in report[0], report
        assert report[1].endswith("ghost: attached the missing device program"), report
        await judge(node, {"a": 1, "ghost": 3})  # its program now grants exactly those
        await isolator_failure(isolator.prepare(ContainerID("new"), config("gpus:1")),
                               "Requested 1 gpus but only 0 available")
        await isolator.cleanup(ContainerID("a"))
        assert await free_minors(components) == {0}
        await isolator.cleanup(ContainerID("ghost"))
        assert not os.path.isdir(node.cgroup_dir("ghost"))
        assert await free_minors(components) == {0, 1, 2, 3}


NOT_OURS = bytes.fromhex("b700000001000000" "9500000000000000")  # r0 = 1; exit: allows every device


@pytest.mark.asyncio
async def test_v2_programs_not_read_back_keep_every_gpu_out_until_all_unknown_are_cleaned(node_factory) -> None:
    node = node_factory("cgroups_v2")
    async with runtime.Runtime():
        await node.crash(*await started_with(node, a="gpus:1", b="gpus:2"))
        for name in ("a", "b"):  # a program of our name that is not one we wrote
            (ours,) = attached_programs(node.cgroup_dir(name))
            detach_program(node.cgroup_dir(name), ours)
            attach_program(node.cgroup_dir(name), NOT_OURS, PROGRAM_NAME)

        components, isolator = await node.start()
        await isolator.recover(states("a", "b"), set())
        assert await free_minors(components) == set()
        assert len(isolator.recovery_report) == 2
        assert all("its device rules cannot be read back" in line for line in isolator.recovery_report)
        # Either unknown container may hold any of the GPUs: none is free until both are gone.
        await isolator.cleanup(ContainerID("a"))
        assert await free_minors(components) == set()
        await isolator_failure(isolator.prepare(ContainerID("new"), config("gpus:1")),
                               "Requested 1 gpus but only 0 available")
        await isolator.cleanup(ContainerID("b"))
        assert await free_minors(components) == {0, 1, 2, 3}
        assert await isolator.devices.list_cgroups() == []


@pytest.mark.asyncio
async def test_v2_a_gpu_released_while_a_container_of_unknown_state_is_there_stays_held_back(node_factory) -> None:
    """An unknown device state may reach any GPU, the ones other containers
    held at recovery too: one they release is held back with the quarantine
    (the ledger's rule), not handed out, until the unknown one is cleaned up."""
    node = node_factory("cgroups_v2")
    async with runtime.Runtime():
        components, isolator = await node.start()
        for name in ("a", "b", "c"):
            await isolator.prepare(ContainerID(name), config("gpus:1"))  # GPUs 0, 1, 2
        await node.crash(components, isolator)
        (ours,) = attached_programs(node.cgroup_dir("a"))
        detach_program(node.cgroup_dir("a"), ours)
        attach_program(node.cgroup_dir("a"), NOT_OURS, PROGRAM_NAME)  # a program of our name we did not write

        components, isolator = await node.start()
        await isolator.recover(states("a", "b", "c"), set())
        assert await isolator.containers() == {"a": [0, 3], "b": [1], "c": [2]}  # a: the quarantine
        await isolator.cleanup(ContainerID("b"))
        assert await free_minors(components) == set()  # GPU 1 joins the quarantine: a may reach it
        assert await isolator.containers() == {"a": [0, 1, 3], "c": [2]}
        await isolator_failure(isolator.prepare(ContainerID("new"), config("gpus:1")),
                               "Requested 1 gpus but only 0 available")
        await isolator.cleanup(ContainerID("a"))
        assert await free_minors(components) == {0, 1, 3}
        await isolator.cleanup(ContainerID("c"))
        assert await isolator.devices.list_cgroups() == []
