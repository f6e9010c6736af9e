"""Drift repair (R-DV-5): someone else changes a container's device rules in
the kernel; ``await isolator.reconcile()`` puts them back, says what it fixed,
and a process in the cgroup sees exactly what it saw before the wipe (granted
GPU node: ENXIO, no driver behind it; denied node: EPERM).

Drifts: v1 ``a`` written to ``devices.allow`` (what a systemd reload can do);
v2 the container's program detached, or an extra program of our name
attached; in memory the record replaced. ``flags.reconcile_interval`` runs
the repair periodically on the runtime Clock (paused and advanced here).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from actors.devices import PROGRAM_NAME, Policy, MemoryBackend, build_device_program
from isolators import NvidiaGpuIsolatorProcess
from runtime import Clock, Runtime
from tests.support.containers import C, finish, two_containers, two_containers_probed
from tests.support.probes import DENIED, GRANTED
from tests.support.kernel import attach_program, detach_program, program_infos
from tests.support.nodes import judge

MINORS = (0, 1, 2, 3, 255)
# c1 holds GPU 0, c2 GPU 1 (lowest-first allocation); 255 is nvidiactl.
BEFORE = {0: GRANTED, 1: DENIED, 2: DENIED, 3: DENIED, 255: GRANTED}


def sees(probe: Any, gpu_nodes: dict[int, str]) -> dict[int, str]:
    return {minor: probe.access(gpu_nodes[minor]) for minor in MINORS}


def own_programs(node: Any, name: str) -> list[int]:
    return [info.id for info in program_infos(os.path.join(node.root, name)) if info.name == PROGRAM_NAME]


def wipe_v1(node: Any, name: str) -> None:
    """What a systemd reload can do: allow every device."""
    fd = os.open(os.path.join(node.root, name, "devices.allow"), os.O_WRONLY)
    try:
        os.write(fd, b"a")
    finally:
        os.close(fd)


def detach_v2(node: Any, name: str) -> None:
    (prog_id,) = own_programs(node, name)
    detach_program(os.path.join(node.root, name), prog_id)


def attach_extra_v2(node: Any, name: str, access: Policy) -> int:
    """A leaked extra program of our own name (every attached program must allow)."""
    return attach_program(os.path.join(node.root, name), build_device_program(access), PROGRAM_NAME)


def in_c1(node: Any, probes: Any) -> Any:
    """A probe process in c1's cgroup."""
    probe = probes()
    probe.move_to(os.path.join(node.root, "c1"))
    return probe


async def drifted_to_gpu_1(node: Any, probe: Any, gpu_nodes: Any, drift: Any) -> None:
    """c1 sees what it was given; ``drift(node, "c1")`` lets it open c2's GPU 1,
    which the kernel judge finds too."""
    assert sees(probe, gpu_nodes) == BEFORE
    drift(node, "c1")
    assert sees(probe, gpu_nodes)[1] == GRANTED
    with pytest.raises(AssertionError, match="GPU 1 is granted to"):
        await judge(node)


async def as_before(node: Any, probe: Any, gpu_nodes: Any) -> None:
    """c1 sees again what it was given, and the kernel grants each container its GPU."""
    assert sees(probe, gpu_nodes) == BEFORE
    await judge(node, {"c1": 1, "c2": 1})


def repaired(repairs: list[Any]) -> list[tuple[str, str]]:
    """Each repair as (container id, what was done)."""
    return [(r.container_id, r.description.split(": ", 1)[1]) for r in repairs]


def without_gpu(access: Policy, minor: int) -> Policy:
    allow = [r for r in access.allow if not (r.major == 195 and r.minor == minor)]
    return Policy.create(allow, access.deny)


@pytest.mark.asyncio
async def test_v1_allow_all_from_a_reload_is_repaired(node_factory: Any, probes: Any, gpu_nodes: Any) -> None:
    async with two_containers_probed(node_factory("cgroups_v1"), probes) as (node, isolator, _c1, probe):
        assert await isolator.reconcile() == []
        await drifted_to_gpu_1(node, probe, gpu_nodes, wipe_v1)  # c1 may use c2's GPU
        repairs = await isolator.reconcile()
        assert [r.container_id for r in repairs] == ["c1"]
        assert "a *:* rwm" in repairs[0].description and "rewrote the rules" in repairs[0].description
        await as_before(node, probe, gpu_nodes)
        assert await isolator.reconcile() == []


@pytest.mark.asyncio
async def test_v1_a_revoked_gpu_is_granted_again(node_factory: Any, probes: Any, gpu_nodes: Any) -> None:
    async with two_containers_probed(node_factory("cgroups_v1"), probes) as (node, isolator, _c1, probe):
        with open(os.path.join(node.root, "c1", "devices.deny"), "w") as deny:
            deny.write("c 195:0 rwm")
        assert sees(probe, gpu_nodes)[0] == DENIED  # drift: c1 lost its GPU
        repairs = await isolator.reconcile()
        assert repaired(repairs) == [
            ("c1", "allowed 'c 195:0 rwm'")
        ]
        await as_before(node, probe, gpu_nodes)


@pytest.mark.asyncio
async def test_v2_a_detached_program_is_attached_again(node_factory: Any, probes: Any, gpu_nodes: Any) -> None:
    async with two_containers_probed(node_factory("cgroups_v2"), probes) as (node, isolator, _c1, probe):
        assert await isolator.reconcile() == []
        await drifted_to_gpu_1(node, probe, gpu_nodes, detach_v2)  # no program: every device allowed
        repairs = await isolator.reconcile()
        assert repaired(repairs) == [
            ("c1", "attached the missing device program")
        ]
        assert len(own_programs(node, "c1")) == 1
        await as_before(node, probe, gpu_nodes)
        assert await isolator.reconcile() == []


@pytest.mark.asyncio
async def test_v2_an_extra_program_of_our_name_is_detached(
    node_factory: Any, probes: Any, gpu_nodes: Any
) -> None:
    async with two_containers_probed(node_factory("cgroups_v2"), probes) as (node, isolator, _c1, probe):
        (original,) = own_programs(node, "c1")
        extra = attach_extra_v2(node, "c1", without_gpu(node.kernel_policy("c1"), 0))
        assert sees(probe, gpu_nodes)[0] == DENIED  # drift: the extra program denies c1's GPU
        repairs = await isolator.reconcile()
        assert repaired(repairs) == [
            ("c1", f"detached leaked extra device program {extra}")
        ]
        assert own_programs(node, "c1") == [original]
        await as_before(node, probe, gpu_nodes)


@pytest.mark.asyncio
async def test_memory_a_replaced_record_is_restored(node_factory: Any) -> None:
    node = node_factory("memory")
    async with Runtime():
        isolator = await two_containers(node)
        table = MemoryBackend.shared_table(node.root)
        good = table["c1"]
        table["c1"] = Policy.create(["a *:* rwm"], [])
        del table["c2"]
        repairs = await isolator.reconcile()
        assert sorted(r.container_id for r in repairs) == ["c1", "c2"]
        assert "recreated the missing cgroup" in [r for r in repairs if r.container_id == "c2"][0].description
        assert table["c1"] == good
        await judge(node, {"c1": 1, "c2": 1})
        await finish(node)


@pytest.mark.asyncio
async def test_reconcile_never_recreates_a_container_being_cleaned_up(node_factory: Any) -> None:
    """A reconcile that arrives with a cleanup waits behind it and skips the container."""
    node = node_factory("memory")
    async with Runtime():
        isolator = await two_containers(node)
        cleanup = isolator.cleanup(C("c1"))
        repairs = isolator.reconcile()
        await cleanup
        assert await repairs == []
        await judge(node, {"c2": 1})
        assert not node.cgroup_exists("c1")
        await finish(node)


# -- periodic runs (flags.reconcile_interval) ---------------------------------------------


@pytest.mark.asyncio
async def test_periodic_reconcile_runs_on_the_clock_and_stops_with_the_isolator(node_factory: Any) -> None:
    node = node_factory("memory")
    async with Runtime():
        Clock.pause()
        isolator = await two_containers(node, reconcile_interval=30.0)
        process: NvidiaGpuIsolatorProcess = isolator.process
        table = MemoryBackend.shared_table(node.root)
        good = table["c1"]
        table["c1"] = Policy.create(["a *:* rwm"], [])
        Clock.advance(29.5)
        await Clock.settle()
        assert process.reconcile_runs == 0 and table["c1"] != good
        Clock.advance(0.5)
        await Clock.settle()
        assert process.reconcile_runs == 1 and table["c1"] == good
        await judge(node, {"c1": 1, "c2": 1})
        Clock.advance(30)
        await Clock.settle()
        assert process.reconcile_runs == 2  # rescheduled after each run
        await finish(node)
        Clock.advance(300)  # finalize cancelled the timer: nothing runs, nothing fails
        await Clock.settle()
        assert process.reconcile_runs == 2 and process._reconcile_timer is None


@pytest.mark.asyncio
async def test_periodic_reconcile_is_off_by_default(node_factory: Any) -> None:
    node = node_factory("memory")
    async with Runtime():
        Clock.pause()
        isolator = await two_containers(node)
        table = MemoryBackend.shared_table(node.root)
        table["c1"] = Policy.create(["a *:* rwm"], [])
        Clock.advance(3600)
        await Clock.settle()
        assert isolator.process.reconcile_runs == 0 and isolator.process._reconcile_timer is None
        assert table["c1"] == Policy.create(["a *:* rwm"], [])
        assert len(await isolator.reconcile()) == 1
        await finish(node)


@pytest.mark.asyncio
async def test_periodic_reconcile_repairs_a_v1_reload_as_a_process_sees_it(
    node_factory: Any, probes: Any, gpu_nodes: Any
) -> None:
    node = node_factory("cgroups_v1")
    async with Runtime():
        Clock.pause()
        isolator = await two_containers(node, reconcile_interval=10.0)
        probe = in_c1(node, probes)
        wipe_v1(node, "c1")
        assert sees(probe, gpu_nodes)[1] == GRANTED
        Clock.advance(10)
        # The periodic run was queued first; this one waits behind it per
        # container and so finds nothing left to repair.
        assert await isolator.reconcile() == []
        await as_before(node, probe, gpu_nodes)
        await finish(node, probe)
