"""SPEC 22 on the kernel: ``serve`` beside an isolator agent on one node -- neither
hands out a GPU the other holds, each refusal names unit, owner and holder,
``ledger/conflicts`` is on serve's metrics, the operator's view and release
(R-NL-5), and a SIGKILLed serve's units wait for it and are reconciled when
it comes back (R-NL-3)."""

from __future__ import annotations

import json
import signal

import pytest

from actors.ledger import isolator_owner, serve_owner
from isolators import ContainerConfig, ContainerID, IsolatorError, Resources
from runtime import Runtime
from tests.support.kernel import KERNEL_BACKENDS
from tests.support.ledger import ledger_command, leases, until
from tests.support.services import ask

SECRET = "test-bearer-secret"


def gpus(count: int) -> ContainerConfig:
    return ContainerConfig(resources=Resources.parse(f"gpus:{count}"))


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
async def test_serve_beside_an_agent_and_the_operators_view(serve_factory, node_factory, tmp_path, backend) -> None:
    ledger = str(tmp_path / "ledger")
    service = serve_factory(backend, listen="127.0.0.1:0", credential=SECRET, node_ledger=ledger).start()
    serve = serve_owner(service.socket)
    node = node_factory(backend, gpus=4, node_ledger=ledger)
    agent_owner = isolator_owner(node.path("work"))
    assert ask(service, "prepare", container_id="job", gpus=3)["error"] is None  # as an agent asks: root's
    async with Runtime():
        components, agent = await node.start()
        await agent.recover([], set())
        uuid0 = components.allocator.info(sorted(components.allocator.total())[0]).uuid
        with pytest.raises(IsolatorError, match=rf"{uuid0} \(195:0\), [^ ]+ \(195:1\), [^ ]+ \(195:2\) are held by"
                                                rf" {serve} \(running\) for job\)$"):  # serve named once
            await agent.prepare(ContainerID("a1"), gpus(2))
        await agent.prepare(ContainerID("a1"), gpus(1))
        assert await agent.containers() == {"a1": [3]}
        refused = ask(service, "prepare", container_id="job2", gpus=1)["error"]
        assert f"(195:3) is held by {agent_owner} (running) for a1" in refused
        assert service.metrics()["ledger_conflicts_total"] == 1.0  # ledger/conflicts, in Prometheus form
        assert node.kernel_grants() == {"a1": {3}}

        shown = ledger_command(f"--node_ledger={ledger}", f"--host_file={node.host_file}", "--json")
        assert shown.returncode == 0, shown.stderr
        units = {row["unit"]: row for row in json.loads(shown.stdout)["units"]}
        assert {unit: (row["state"], row["owner"], row["alive"], row["holders"]) for unit, row in units.items()} == {
            "195:0": ("held", serve, True, ["job"]), "195:1": ("held", serve, True, ["job"]),
            "195:2": ("held", serve, True, ["job"]), "195:3": ("held", agent_owner, True, ["a1"])}
        table = ledger_command(f"--node_ledger={ledger}", f"--host_file={node.host_file}").stdout.splitlines()
        assert table[0] == f"node ledger {ledger}"
        assert table[1].split() == ["UNIT", "UUID", "STATE", "OWNER", "HOLDERS", "HEALTH"]
        assert table[2].split() == ["195:0", uuid0, "held", serve, "(running)", "job", "healthy"]

        # serve dies: its units wait for it (its container may still run); the operator may not take them
        # while it runs, and does not need to: serve recovers and keeps what its container holds
        refused_release = ledger_command("release", f"--node_ledger={ledger}", f"--owner={agent_owner}")
        assert refused_release.returncode == 2 and f"owner {agent_owner} is running" in refused_release.stderr
        service.process.send_signal(signal.SIGKILL)
        service.process.wait(timeout=10)
        dead = {row["unit"]: row["alive"] for row in json.loads(ledger_command(
            f"--node_ledger={ledger}", f"--host_file={node.host_file}", "--json").stdout)["units"]}
        assert dead == {"195:0": False, "195:1": False, "195:2": False, "195:3": True}
        with pytest.raises(IsolatorError, match=rf"are held by {serve} \(not running: its units wait for it"):
            await agent.prepare(ContainerID("a2"), gpus(1))
        service.process.stdout.close()
        service.start()
        # recovered from the kernel and its records: kept, with its holder (written behind, within a linger)
        await until(lambda: leases(ledger).get("195:0") == (serve, ("job",)), "serve kept job's units")
        assert ask(service, "cleanup", container_id="job")["error"] is None
        await until(lambda: set(leases(ledger)) == {"195:3"}, "serve's units went back")
        await agent.prepare(ContainerID("a2"), gpus(3))
        assert node.kernel_grants() == {"a1": {3}, "a2": {0, 1, 2}}
        await node.clean_all()
        await node.stop()
    service.stop()
    assert leases(ledger) == {}
