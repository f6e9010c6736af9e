"""Drift that cannot be repaired is contained and reported (issue 20 item 5),
judged by a process in the cgroup (granted node: ENXIO, denied: EPERM).

- v1: a wiped cgroup (``a`` in devices.allow) with a child cgroup of an
  outsider: the kernel refuses the re-deny (EINVAL);
- v2: an outsider's allow-all program attached in place of ours with flags 0
  or ``BPF_F_ALLOW_OVERRIDE``: ours cannot be attached (EPERM);
- v2: an outsider's deny-all program attached beside ours: the container
  lost even /dev/null, and reconcile used to say nothing.

Each comes back from ``reconcile()`` as a ``Repair`` with ``failed`` and the
reason; where the container may reach GPUs beyond its record, every free GPU
is held back for it (no other container gets one) until a reconcile
repairs it, then they go back.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from actors.devices import PROGRAM_NAME, Policy, _bpf, build_device_program
from isolators import Repair
from runtime import Runtime
from tests.support.containers import C, config, finish, free_gpus, two_containers, two_containers_probed
from tests.support.probes import DENIED, GRANTED
from tests.support.errors import isolator_failure
from tests.support.kernel import attach_program, detach_program, program_infos
from tests.support.nodes import judge


def attach(cgroup_dir: str, policy: Policy, name: str, flags: int) -> int:
    """An outsider's device program on ``cgroup_dir``; its id."""
    return attach_program(cgroup_dir, build_device_program(policy), name, flags)


def ours(cgroup_dir: str) -> list[int]:
    return [info.id for info in program_infos(cgroup_dir) if info.name == PROGRAM_NAME]


async def reconcile_until_repaired(isolator: Any) -> list[Repair]:
    """Reconcile until no repair fails (bounded): after the child cgroup's
    rmdir the kernel needs a moment to let go of it before a re-deny works."""
    deadline = time.monotonic() + 10
    while True:
        repairs = await isolator.reconcile()
        if not any(r.failed for r in repairs) or time.monotonic() > deadline:
            return repairs
        time.sleep(0.1)


async def held_back_for_c1(isolator: Any, node: Any) -> Repair:
    """A reconcile fails to repair c1 (its failed repair, returned) and every free GPU is held back for it."""
    failed = failed_only(await isolator.reconcile(), "c1")
    assert await free_gpus(node) == set()
    await isolator_failure(isolator.prepare(C("c3"), config(1)), "Requested 1 gpus but only 0 available")
    return failed


async def c2_released_while_held_back(isolator: Any, node: Any) -> None:
    """c2's cleanup releases GPU 1 while c1 may reach any GPU: it is held back for c1 too."""
    await isolator.cleanup(C("c2"))
    assert await free_gpus(node) == set()


async def repaired_and_released(node: Any, probe: Any, gpu_nodes: Any) -> None:
    """c1 has its GPU 0 and no other again; the held-back GPUs 1 (c2's), 2 and 3 are free."""
    assert [probe.access(gpu_nodes[m]) for m in range(3)] == [GRANTED, DENIED, DENIED]
    assert await free_gpus(node) == {1, 2, 3}
    await judge(node, {"c1": 1})


def failed_only(repairs: list[Repair], cid: str) -> Repair:
    assert [(r.container_id, r.failed) for r in repairs] == [(cid, True)], repairs
    return repairs[0]


@pytest.mark.asyncio
async def test_v1_a_wiped_cgroup_with_an_outsiders_child_is_contained(
    node_factory: Any, probes: Any, gpu_nodes: Any
) -> None:
    async with two_containers_probed(node_factory("cgroups_v1"), probes) as (node, isolator, c1, probe):
        with open(os.path.join(c1, "devices.allow"), "w") as allow:
            allow.write("a")
        os.mkdir(os.path.join(c1, "outsider"))  # the kernel now refuses to take anything back from c1
        try:
            assert probe.access(gpu_nodes[2]) == GRANTED  # c1 reaches the free GPUs
            failed = await held_back_for_c1(isolator, node)  # GPUs 2 and 3 are held back for c1
            assert "Invalid argument" in failed.reason and "held back" in failed.description
            await c2_released_while_held_back(isolator, node)
            assert failed_only(await isolator.reconcile(), "c1").failed  # still, and still contained
            assert await free_gpus(node) == set()
        finally:
            os.rmdir(os.path.join(c1, "outsider"))
        repairs = await reconcile_until_repaired(isolator)  # repairable again: repaired, and the GPUs go back
        assert [r.failed for r in repairs] == [False] * len(repairs) and len(repairs) >= 2
        assert repairs[-1].description == "released GPUs [1, 2, 3] held back while its kernel state was unknown"
        await repaired_and_released(node, probe, gpu_nodes)


@pytest.mark.asyncio
@pytest.mark.parametrize("flags", [0, _bpf.BPF_F_ALLOW_OVERRIDE], ids=["flags-0", "allow-override"])
async def test_v2_an_outsiders_allow_all_program_in_place_of_ours_is_contained(
    node_factory: Any, probes: Any, gpu_nodes: Any, flags: int
) -> None:
    async with two_containers_probed(node_factory("cgroups_v2"), probes) as (node, isolator, c1, probe):
        (own,) = ours(c1)
        detach_program(c1, own)
        outsider = attach(c1, Policy.create(["a"]), "outsider", flags)
        assert probe.access(gpu_nodes[2]) == GRANTED
        failed = await held_back_for_c1(isolator, node)
        assert "Operation not permitted" in failed.reason and "without BPF_F_ALLOW_MULTI" in failed.reason
        await c2_released_while_held_back(isolator, node)
        detach_program(c1, outsider)  # the outsider goes away: the next reconcile repairs it
        repairs = await isolator.reconcile()
        assert not any(r.failed for r in repairs)
        assert any("attached the missing device program" in r.description for r in repairs)
        assert repairs[-1].description == "released GPUs [1, 2, 3] held back while its kernel state was unknown"
        await repaired_and_released(node, probe, gpu_nodes)


@pytest.mark.asyncio
async def test_v2_an_outsiders_deny_all_program_beside_ours_is_reported(
    node_factory: Any, probes: Any, gpu_nodes: Any
) -> None:
    async with two_containers_probed(node_factory("cgroups_v2"), probes) as (node, isolator, c1, probe):
        assert probe.access("/dev/null") == GRANTED
        outsider = attach(c1, Policy.create([]), "outsider", _bpf.BPF_F_ALLOW_MULTI)
        assert (probe.access("/dev/null"), probe.access(gpu_nodes[0])) == (DENIED, DENIED)
        failed = failed_only(await isolator.reconcile(), "c1")
        assert f"device programs [{outsider}] that are not device control's" in failed.reason
        assert await free_gpus(node) == {2, 3}  # it can only deny more: nothing held back
        assert ours(c1) and outsider in [info.id for info in program_infos(c1)]  # reported, not detached
        detach_program(c1, outsider)
        assert await isolator.reconcile() == []
        assert (probe.access("/dev/null"), probe.access(gpu_nodes[0])) == (GRANTED, GRANTED)


@pytest.mark.asyncio
async def test_recovery_contains_drift_it_cannot_repair(node_factory: Any, probes: Any, gpu_nodes: Any) -> None:
    node = node_factory("cgroups_v1")
    async with Runtime():
        isolator = await two_containers(node)
        await node.stop()  # the agent goes away
        c1 = node.cgroup_dir("c1")
        with open(os.path.join(c1, "devices.allow"), "w") as allow:
            allow.write("a")
        os.mkdir(os.path.join(c1, "outsider"))
        try:
            _c, isolator = await node.start()
            await isolator.recover([], {C("c1"), C("c2")})
            # c1 grants every GPU: it keeps the ones nobody holds (its record), and
            # the rules that would take the rest back cannot be written: reported.
            assert await isolator.containers() == {"c1": [0, 2, 3], "c2": [1]}
            report = isolator.recovery_report
            assert any("Container c1: recovery could not repair its device rules" in line and "Invalid argument"
                       in line and "no GPU is free to hold back" in line for line in report), report
            assert await free_gpus(node) == set()
        finally:
            os.rmdir(os.path.join(c1, "outsider"))
        repairs = await reconcile_until_repaired(isolator)
        assert not any(r.failed for r in repairs), repairs
        await judge(node, {"c1": 3, "c2": 1})
        await finish(node)
