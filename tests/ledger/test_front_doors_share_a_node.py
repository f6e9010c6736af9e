"""SPEC 22 on the kernel: two isolator agents with different work directories on
one node (the seed's "multiple containerizers") never hand out one GPU
twice, and a refusal names unit, owner and holder (``serve`` beside an agent:
tests/service/test_serve_ledger.py)."""

from __future__ import annotations

import pytest

from actors.ledger import isolator_owner
from isolators import ContainerConfig, ContainerID, IsolatorError, Resources
from runtime import Runtime
from tests.support.kernel import KERNEL_BACKENDS
from tests.support.ledger import leases, until


def gpus(count: int) -> ContainerConfig:
    return ContainerConfig(resources=Resources.parse(f"gpus:{count}"))


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
async def test_two_agents_on_one_node_never_hand_out_the_same_gpu(node_factory, tmp_path, backend) -> None:
    ledger = str(tmp_path / "ledger")
    a = node_factory(backend, gpus=4, node_ledger=ledger)
    b = node_factory(backend, gpus=4, node_ledger=ledger)
    async with Runtime():
        components_a, agent_a = await a.start()
        components_b, agent_b = await b.start()
        await agent_a.recover([], set())
        await agent_b.recover([], set())
        await agent_a.prepare(ContainerID("a1"), gpus(2))
        await agent_b.prepare(ContainerID("b1"), gpus(2))
        assert await agent_a.containers() == {"a1": [0, 1]} and await agent_b.containers() == {"b1": [2, 3]}
        uuid2 = components_a.allocator.info(sorted(components_a.allocator.total())[2]).uuid
        owner_b = isolator_owner(b.path("work"))
        with pytest.raises(IsolatorError) as refused:
            await agent_a.prepare(ContainerID("a2"), gpus(1))
        assert str(refused.value).startswith(
            "Requested 1 gpus but only 0 available (2 more held by other front doors of this node:"
            f" {uuid2} (195:2), ")
        assert str(refused.value).endswith(f" (195:3) are held by {owner_b} (running) for b1)")
        # the kernel agrees: no GPU two cgroups can open, whichever agent made them
        assert a.kernel_grants() == {"a1": {0, 1}} and b.kernel_grants() == {"b1": {2, 3}}
        await agent_b.cleanup(ContainerID("b1"))
        await until(lambda: "195:2" not in leases(ledger), "b1's GPUs went back to the ledger")
        await agent_a.prepare(ContainerID("a2"), gpus(2))
        assert await agent_a.containers() == {"a1": [0, 1], "a2": [2, 3]}
        assert a.kernel_grants() == {"a1": {0, 1}, "a2": {2, 3}} and b.kernel_grants() == {}
        await a.clean_all()
        await b.clean_all()
        await a.stop()
        await b.stop()
    assert leases(ledger) == {}  # every unit free once both agents cleaned up and stopped
