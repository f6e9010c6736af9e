"""Writer: what an embedded isolator and its node ledger keep, written by the earlier release's code.

Rules (run by ``python -m tests.upgrades.write_fixtures ledger_and_isolator``; root, cgroups v1):
- One simulated 4-GPU node (its host file kept as ``host.json``, so the
  test's node has the same GPU UUIDs) with a node ledger and a CDI spec
  directory, all under one scratch directory ``BASE``. The isolator
  prepares ``c1`` (1 GPU) and ``c2`` (2 GPUs), GPU 3 is marked unhealthy
  (so the owner has a health file), then the isolator is dropped without a
  cleanup (an agent stopped mid-way, as a rolling update leaves it): its
  leases (holders ``c1``, ``c2``), its owner file, its health file and
  the containers' CDI specs stay.
- Kept under the out dir: ``ledger/`` (``units/*.lease``, ``owners/*``),
  ``cdi/`` (the containers' specs), ``host.json`` and ``facts.json``: the
  kernel facts a test rebuilds the state from (fixtures cannot hold the
  kernel) -- each container's cgroup ``devices.list`` lines as the kernel
  listed them, and the GPUs the isolator said each held -- with ``base``,
  the scratch directory every kept path starts with. The files hold
  absolute paths (the owner ``isolator:<BASE>/node/work``, the CDI specs'
  device paths): tests rewrite ``base`` to their own directory (and name
  the owner files after the rewritten owners), which is why nothing else
  of the machine is kept.
- Nothing is left on the machine: the cgroups are removed and the scratch
  directory too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile

from isolators import ContainerConfig, ContainerID, Resources
from isolators.simulated_node import SimulatedNode, host_document, remove_cgroup_tree
from runtime import Runtime


def gpus(count: int) -> ContainerConfig:
    return ContainerConfig(resources=Resources.parse(f"gpus:{count}"))


async def write(out: str, base: str) -> None:
    os.makedirs(os.path.join(base, "cdi"))
    node = SimulatedNode(os.path.join(base, "node"), "cgroups_v1", host=host_document(4),
                         root_prefix="gpu-isolator-fixture-",
                         extra={"gpu_allocation": "lowest", "node_ledger": os.path.join(base, "ledger"),
                                "cdi_spec_dir": os.path.join(base, "cdi")})
    node.create_files()
    cgroups = os.path.join(node.hierarchy, node.cgroups_root)
    try:
        async with Runtime():
            components, isolator = await node.start()
            await isolator.recover([], set())
            await isolator.prepare(ContainerID("c1"), gpus(1))
            await isolator.prepare(ContainerID("c2"), gpus(2))
            unhealthy = sorted(components.allocator.total())[3]
            await components.allocator.mark_unhealthy(unhealthy, "XID 79: fell off the bus (upgrade fixture)")
            held = await isolator.containers()
            await asyncio.sleep(0.3)  # the ledger link writes holders and health behind (0.2 s at most)
            kernel = {}
            for name in sorted(os.listdir(cgroups)):
                if os.path.isdir(os.path.join(cgroups, name)):
                    with open(os.path.join(cgroups, name, "devices.list")) as listed:
                        kernel[name] = listed.read().split("\n")[:-1]
            await node.stop()  # no cleanup: the containers run on, their leases stay
        shutil.copytree(os.path.join(base, "ledger"), os.path.join(out, "ledger"))
        shutil.copytree(os.path.join(base, "cdi"), os.path.join(out, "cdi"))
        shutil.copy(node.host_file, os.path.join(out, "host.json"))
        os.remove(os.path.join(out, "ledger", "lock"))  # the mutex: no content, made at open
        facts = {"base": base, "backend": "cgroups_v1", "owner": f"isolator:{node.work_dir}",
                 "work_dir": node.work_dir, "containers": held, "devices_list": kernel}
        with open(os.path.join(out, "facts.json"), "w") as handle:
            json.dump(facts, handle, indent=1, sort_keys=True)
    finally:
        remove_cgroup_tree(cgroups)


def main() -> None:
    out = sys.argv[1]
    base = tempfile.mkdtemp(prefix="gpu-isolator-fixture-")
    try:
        asyncio.run(write(out, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
