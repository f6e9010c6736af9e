"""SPEC R-SH-3 for ``serve``: this release carries on from what release 0.1.0's ``serve`` kept
(fixtures written by its own code, tests/upgrades/writers/serve.py): the agent's container keeps its
GPUs (the kernel judges), the exec container whose command ended while no service ran is released, the
ledger's owner is unchanged; and records it cannot read (truncated, garbage, a version it does not
know) are moved aside with an ERROR naming them while the service starts, recovering every container
from the kernel with its GPUs, handing none of them out."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time

import pytest

from actors.ledger import owner_file_name
from tests.support.kernel import KERNEL_BACKENDS, skip_reason
from tests.support.ledger import leases
from tests.support.nodes import Node
from tests.support.services import ServeProcess, ask, gpus_of
from tests.support.upgrades import CORRUPTIONS, Fixture, corrupt, probe_grants

FIXTURE = Fixture("serve")
AGENT_JOB = "agent-job"
EXEC = FIXTURE.facts["exec"]
HELD = FIXTURE.facts["containers"]  # {"agent-job": [0, 1], EXEC: [2]}


@pytest.fixture
def upgraded(tmp_path, node_root_prefix):
    """0.1.0's records and ledger under the test's directory, its cgroups rebuilt under a root of the
    test's own, and a (not yet started) ServeProcess on them."""
    made = []

    def make(backend: str) -> ServeProcess:
        reason = skip_reason(backend)
        if reason:
            pytest.skip(reason)
        node = Node(tmp_path / "node", backend, 4, host=FIXTURE.host, root_prefix=node_root_prefix,
                    node_ledger=str(tmp_path / "ledger"))
        FIXTURE.install(tmp_path, {FIXTURE.facts["cgroups_root"]: node.root})
        os.makedirs(node.work_dir, mode=0o700, exist_ok=True)
        os.replace(tmp_path / "work" / "service", os.path.join(node.work_dir, "service"))
        service = ServeProcess(node, tmp_path / "serve")
        service.socket = str(tmp_path / "run" / "gpu-isolator.sock")  # 0.1.0's socket, rewritten
        made.append((node, service))
        asyncio.run(FIXTURE.rebuild_cgroups(node))
        return service

    try:
        yield make
    finally:
        for node, service in made:
            try:
                service.close()
            finally:
                node.teardown()


def eventually(check, bound: float = 10.0) -> bool:
    """Whether ``check()`` holds within ``bound`` seconds (leases are written behind: wait for the state)."""
    deadline = time.monotonic() + bound
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def records_path(service: ServeProcess) -> str:
    return os.path.join(service.node.work_dir, "service", "containers.json")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_serve_carries_on_from_what_0_1_0_kept(upgraded, tmp_path, probes, gpu_nodes, backend):
    service = upgraded(backend)
    node, ledger, owner = service.node, str(tmp_path / "ledger"), f"serve:{service.socket}"
    assert FIXTURE.facts["owner"].replace(FIXTURE.facts["base"], str(tmp_path)) == owner
    service.start()
    assert "2 container(s) recovered" in service.ready_line
    state = service.wait_state(lambda s: EXEC not in s["containers"])  # its command ended: released
    assert gpus_of(state) == {AGENT_JOB: HELD[AGENT_JOB]} and state["free"] == [2, 3]
    view = state["containers"][AGENT_JOB]
    assert (view["state"], view["user"], view["command"]) == ("running", "root", None)  # its record, read
    assert probe_grants(probes, node, [AGENT_JOB], gpu_nodes) == {AGENT_JOB: HELD[AGENT_JOB]}
    held = {"195:0": (owner, (AGENT_JOB,)), "195:1": (owner, (AGENT_JOB,))}
    assert eventually(lambda: {d: lease for d, lease in leases(ledger).items() if d != "195:2"} == held), (
        f"not the same owner's leases with their holders (written behind): {leases(ledger)}")
    assert json.loads(open(os.path.join(ledger, "owners", owner_file_name(owner))).read()) == {
        "owner": owner, "version": 1}
    assert ask(service, "prepare", container_id="next", gpus=3)["error"] is not None  # 0 and 1 stay the job's
    assert ask(service, "prepare", container_id="next", gpus=2)["error"] is None
    assert gpus_of(service.state())["next"] == [2, 3]
    assert json.loads(open(records_path(service)).read())["version"] == 1
    for name in (AGENT_JOB, "next"):
        assert ask(service, "cleanup", container_id=name)["error"] is None
    assert service.stop() == 0
    assert eventually(lambda: leases(ledger) == {}), f"units left leased after the cleanups: {leases(ledger)}"


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_records_it_cannot_read_are_moved_aside_and_the_containers_recovered_from_the_kernel(
        upgraded, tmp_path, probes, gpu_nodes, how):
    """The records and the lease of the exec container's GPU made unreadable ``how``; on one kernel backend
    (the files are the same on either; a serve start costs seconds)."""
    backend = next((b for b in KERNEL_BACKENDS if skip_reason(b) is None), KERNEL_BACKENDS[0])
    service = upgraded(backend)
    node, ledger, owner = service.node, str(tmp_path / "ledger"), f"serve:{service.socket}"
    records = records_path(service)
    damaged = corrupt(records, how)
    [lease_2] = [path for path in glob.glob(os.path.join(ledger, "units", "*.lease"))
                 if json.loads(open(path).read())["device"] == "195:2"]
    corrupt(lease_2, how)  # the exec container's unit: re-taken from the kernel, its file moved aside
    service.start()  # it starts: no crash loop on a file
    assert "2 container(s) recovered" in service.ready_line
    [moved] = glob.glob(records + ".unreadable-*")
    assert open(moved, "rb").read() == damaged
    [error] = [line for line in service.log().splitlines() if f"The service's records {records} cannot be read" in line]
    assert "ERROR" in error and f"moved aside to {moved}." in error
    state = service.state()
    assert gpus_of(state) == HELD  # every container the kernel shows, with the GPUs its cgroup is granted
    assert {name: view["state"] for name, view in state["containers"].items()} == dict.fromkeys(HELD, "recovered")
    assert probe_grants(probes, node, HELD, gpu_nodes) == HELD
    assert ask(service, "prepare", container_id="next", gpus=2)["error"] is not None  # nothing in use handed out
    assert ask(service, "prepare", container_id="next", gpus=1)["error"] is None
    assert gpus_of(service.state())["next"] == [3]
    assert json.loads(open(records).read())["version"] == 1  # rebuilt: written again whole
    assert eventually(lambda: {device: lease[0] for device, lease in leases(ledger).items()} == dict.fromkeys(
        ("195:0", "195:1", "195:2", "195:3"), owner)), f"not every unit serve's: {leases(ledger)}"
    assert len(glob.glob(lease_2 + ".unreadable-*")) == 1
    for name in (*HELD, "next"):
        assert ask(service, "cleanup", container_id=name)["error"] is None
    assert service.stop() == 0
    assert eventually(lambda: leases(ledger) == {}), f"units left leased after the cleanups: {leases(ledger)}"
