"""SPEC R-SH-3 for the embedded isolator and the node ledger: this release carries on from what
release 0.1.0 kept (fixtures written by its own code, tests/upgrades/writers/ledger_and_isolator.py) --
its containers keep their GPUs (the kernel judges), the ledger's owners, holders and health are
unchanged -- and a kept file it cannot read (truncated, garbage, a version it does not know) is moved
aside with an ERROR naming it, and what it held is rebuilt from the kernel, never handing out a unit in
use."""

from __future__ import annotations

import glob
import json
import logging
import os

import pytest

from actors.ledger import LedgerDirectory, owner_file_name
from isolators import ContainerConfig, ContainerID, ContainerState, IsolatorError, Resources
from runtime import Runtime
from tests.support.kernel import KERNEL_BACKENDS, skip_reason
from tests.support.ledger import leases, until
from tests.support.nodes import Node, judge
from tests.support.upgrades import CORRUPTIONS, Fixture, corrupt, probe_grants

FIXTURE = Fixture("ledger_and_isolator")
CONTAINERS = FIXTURE.facts["containers"]  # {"c1": [0], "c2": [1, 2]}; GPU 3 was free (marked unhealthy)


def gpus(count: int) -> ContainerConfig:
    return ContainerConfig(resources=Resources.parse(f"gpus:{count}"))


@pytest.fixture
def upgraded(tmp_path, node_root_prefix):
    """0.1.0's files under the test's directory and its cgroups rebuilt under a root of the test's own."""
    nodes = []

    def make(backend: str) -> Node:
        reason = skip_reason(backend)
        if reason:
            pytest.skip(reason)
        FIXTURE.install(tmp_path)
        node = Node(tmp_path / "node", backend, 4, host=FIXTURE.host, root_prefix=node_root_prefix,
                    node_ledger=str(tmp_path / "ledger"), cdi_spec_dir=str(tmp_path / "cdi"))
        nodes.append(node)
        return node

    try:
        yield make
    finally:
        for node in nodes:
            node.teardown()


def owner_of(node: Node) -> str:
    return f"isolator:{node.work_dir}"


def recorded(node: Node) -> list[ContainerState]:
    return [ContainerState(ContainerID(name)) for name in sorted(CONTAINERS)]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
async def test_the_isolator_carries_on_from_what_0_1_0_kept(upgraded, tmp_path, probes, gpu_nodes, backend):
    node = upgraded(backend)
    ledger, owner = str(tmp_path / "ledger"), owner_of(node)
    assert FIXTURE.facts["owner"].replace(FIXTURE.facts["base"], str(tmp_path)) == owner
    await FIXTURE.rebuild_cgroups(node)
    specs = {path: open(path, "rb").read() for path in glob.glob(str(tmp_path / "cdi" / "*.json"))}
    view = LedgerDirectory.open(ledger).view()
    assert view.health == {owner: {"GPU-3b9b6c25-bfc7-5416-b2f7-2777f3e3d5ff":
                                   "XID 79: fell off the bus (upgrade fixture)"}}  # 0.1.0's health file, version 0
    async with Runtime():
        _components, isolator = await node.start()
        await isolator.recover(recorded(node), set())
        assert await isolator.containers() == CONTAINERS
        assert isolator.recovery_report == []  # nothing to repair: the CDI specs are as 0.1.0 wrote them
        assert probe_grants(probes, node, CONTAINERS, gpu_nodes) == CONTAINERS  # the kernel's verdict
        await judge(node)
        held = {"195:0": (owner, ("c1",)), "195:1": (owner, ("c2",)), "195:2": (owner, ("c2",))}
        await until(lambda: leases(ledger) == held, "the same owner's leases, with their holders (written behind)")
        owner_file = os.path.join(ledger, "owners", owner_file_name(owner))
        assert json.loads(open(owner_file).read()) == {"owner": owner, "version": 1}  # the same owner, rewritten
        assert {path: open(path, "rb").read() for path in specs} == specs
        with pytest.raises(IsolatorError, match=r"^Requested 2 gpus but only 1 available"):
            await isolator.prepare(ContainerID("c3"), gpus(2))  # nothing in use is handed out again
        await isolator.prepare(ContainerID("c3"), gpus(1))
        assert await isolator.containers() == {**CONTAINERS, "c3": [3]}
        written = [json.loads(open(path).read()) for path in glob.glob(os.path.join(ledger, "units", "*.lease"))]
        assert {(lease["device"], lease.get("version")) for lease in written} == {
            ("195:0", 1), ("195:1", 1), ("195:2", 1), ("195:3", 1)}  # every lease written since names its version
        await node.clean_all()
        await until(lambda: leases(ledger) == {}, "every unit back in the ledger after the cleanups")
        await node.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
async def test_files_it_cannot_read_are_moved_aside_and_rebuilt_from_the_kernel(
        upgraded, tmp_path, probes, gpu_nodes, caplog, backend, how):
    """A lease of a unit c2 uses, c1's CDI spec, the owner's health file and its owner file, each made
    unreadable ``how``: another front door cannot take c2's unit meanwhile; the isolator starts, re-takes
    the unit from its kernel truth and moves each unreadable file aside with an ERROR saying where."""
    node = upgraded(backend)
    ledger, owner = str(tmp_path / "ledger"), owner_of(node)
    await FIXTURE.rebuild_cgroups(node)
    [c2_lease] = [path for path in glob.glob(os.path.join(ledger, "units", "*.lease"))
                  if json.loads(open(path).read())["device"] == "195:2"]
    spec = str(tmp_path / "cdi" / "gpu-isolator-container_c1.json")
    health = os.path.join(ledger, "owners", owner_file_name(owner)[: -len(".owner")] + ".health")
    owner_file = os.path.join(ledger, "owners", owner_file_name(owner))
    damaged = {path: corrupt(path, how) for path in (c2_lease, spec, health, owner_file)}
    other = Node(tmp_path / "other", backend, 4, host=FIXTURE.host, root_prefix=node.cgroups_root + "-",
                 node_ledger=ledger)
    caplog.set_level(logging.ERROR)
    try:
        async with Runtime():
            _c, intruder = await other.start()
            await intruder.recover([], set())
            with pytest.raises(IsolatorError):  # 195:2's lease cannot be read: nobody takes the unit
                await intruder.prepare(ContainerID("x"), gpus(2))
            await intruder.prepare(ContainerID("x"), gpus(1))
            assert await intruder.containers() == {"x": [3]}

            _components, isolator = await node.start()
            await isolator.recover(recorded(node), set())
            assert await isolator.containers() == CONTAINERS
            assert probe_grants(probes, node, CONTAINERS, gpu_nodes) == CONTAINERS
            await until(lambda: leases(ledger)["195:2"] == (owner, ("c2",)), "195:2 re-taken from the kernel's truth")
            moved = {path: glob.glob(path + ".unreadable-*") for path in (c2_lease, spec, health)}
            assert {path: [open(m, "rb").read() for m in found] for path, found in moved.items()} == {
                path: [damaged[path]] for path in moved}  # each moved aside, as it was
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert any(line.startswith(f"Node ledger {ledger}: the lease file {c2_lease} could not be read (")
                       and line.endswith(f"so it took the unit again: the file was moved aside to"
                                         f" {moved[c2_lease][0]}") for line in errors), errors
            assert any(line.startswith(f"Node ledger {ledger}: the health file {health} of {owner} cannot be read")
                       and f"moved aside to {moved[health][0]}" in line for line in errors), errors
            report = isolator.recovery_report
            assert [line for line in report if spec in line] == [
                line for line in errors if spec in line]  # one ERROR line, in the report too
            assert len([line for line in report if spec in line]) == 1
            assert report[0].startswith(f"Container c1: CDI spec '{spec}'") and report[0].endswith(
                f"moved aside to '{moved[spec][0]}' and rewritten from the recovered grant")
            json.loads(open(spec).read())  # rewritten whole
            assert json.loads(open(owner_file).read()) == {"owner": owner, "version": 1}
            assert node.kernel_grants() == {"c1": {0}, "c2": {1, 2}} and other.kernel_grants() == {"x": {3}}
            await node.clean_all()
            await other.clean_all()
            await until(lambda: leases(ledger) == {}, "every unit back in the ledger after the cleanups")
            await node.stop()
            await other.stop()
    finally:
        other.teardown()
