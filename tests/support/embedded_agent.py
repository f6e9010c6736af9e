"""An agent that embeds the isolator (``async with Runtime():``), run as a process of its own (SPEC R-SH-4).

Run as ``python -m tests.support.embedded_agent DIR LEDGER ACT``: the
simulated node of 8 GPUs in ``DIR`` (memory backend: a new process finds
no container of an earlier one; no health checks), joined to the node
ledger ``LEDGER``. It
creates the components and the isolator, recovers with no containers,
then:

- ``crash``: prepares ``c1`` with every GPU and ends with ``os._exit``
  (an agent that dies: its leases stay, held by ``c1``);
- ``exit``: leaves ``Runtime()`` at once, closing nothing;
- ``churn``: prepares ``c2`` with 2 GPUs, cleans it up and leaves
  ``Runtime()`` at once (its units are in the ledger link's linger window).

It prints one JSON line, flushed: ``recovered`` (the leases right after
``recover()`` answered, ``{device: [owner, holders]}``), ``left`` (the
leases once ``Runtime()`` was left) and ``owner_free`` (whether another
open of the ledger could take the agent's owner lock then), then exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from actors.ledger import isolator_owner
from isolators import ContainerConfig, ContainerID, NvidiaComponents, NvidiaGpuIsolatorProcess, Resources
from isolators.simulated_node import SimulatedNode
from runtime import Runtime
from tests.support.ledger import leases, owner_free


async def main(directory: str, ledger: str, act: str) -> None:
    node = SimulatedNode(directory, "memory").create_files()
    flags = node.flags(node_ledger=ledger, nvidia_health_checks=False)  # no NVML event wait to outlive it
    async with Runtime():
        components = await NvidiaComponents.create(flags)
        isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
        await isolator.recover([], set())
        recovered = leases(ledger)
        if act == "crash":
            await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=Resources.parse("gpus:8")))
            os._exit(0)
        if act == "churn":
            await isolator.prepare(ContainerID("c2"), ContainerConfig(resources=Resources.parse("gpus:2")))
            await isolator.cleanup(ContainerID("c2"))
    report = {"recovered": recovered, "left": leases(ledger), "owner_free": owner_free(ledger, isolator_owner(
        flags.work_dir))}
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
