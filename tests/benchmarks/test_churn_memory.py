"""Per-container state does not grow with churn: after 10,000 lifecycles
(prepare -> usage -> update(gpus:0) -> cleanup, GPU and CPU-only containers,
on the in-memory backend) the isolator, the allocator and device control
hold nothing for the cleaned-up containers."""

from __future__ import annotations

import pytest

from actors.devices import MemoryBackend
from benchmarks.churn import churn
from isolators.simulated_node import SimulatedNode
from runtime import Runtime, current_runtime, snapshot

LIFECYCLES = 10_000


@pytest.mark.asyncio
async def test_ten_thousand_lifecycles_leave_nothing_behind() -> None:
    async with Runtime():
        async with SimulatedNode(backend="memory", gpus=8) as node:
            isolator = node.isolator
            process = isolator.process
            run = await churn(isolator, workers=16, lifecycles=LIFECYCLES, gpu_workers=4)
            assert run.errors == []
            assert run.lifecycles == LIFECYCLES and 0 < run.gpu_lifecycles < LIFECYCLES

            # The isolator: no record, no per-id queue, nothing lingering, nothing in the ledger or watched.
            assert process.records == {} and process.ordering.sequences() == 0
            assert process.repair.lingering == {} and process._device_dirs == set()
            assert process.ledger.owners() == set() and process.watches.watched == {}
            assert await isolator.containers() == {}
            assert len(process.policies) <= 1 + 8  # by GPU set (none, or one of 8), not by container

            # The allocator: every GPU is back.
            state = await node.components.allocator.state()
            assert state.allocated == [] and state.available == state.total and len(state.total) == 8

            # Device control: no cgroup, nothing queued.
            assert await isolator.devices.list_cgroups() == [] and MemoryBackend.shared_table(node.root) == {}
            control = current_runtime()._processes[isolator.devices.pid]
            assert control.driver.backend.list_cgroups() == []  # in line: nothing is ever queued

            # No process keeps a suspended call or a queued event.
            processes = snapshot()
            for pid in (process.pid, isolator.devices.pid, node.components.allocator.pid):
                stats = processes[str(pid)]
                assert (stats["suspended"], stats["queue_depth"]) == (0, 0), (pid, stats)
