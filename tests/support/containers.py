"""Containers in isolator tests: their ids and configs, the usual start with
two of them, a bounded cleanup of a lingering one, and the end of a test.

Rules:
- ``C(name)`` is a top-level ``ContainerID``; ``config(resources, **fields)``
  a ``ContainerConfig`` asking for ``resources``: a number of GPUs, or
  resources text (``"gpus:1;mig-1g.18gb:1"``; none: nothing), with
  ``fields`` (``rootfs``, ...).
- ``started_with(node, **asked)`` starts the node's isolator and prepares
  each container named in ``asked`` with its ``config`` (``a="gpus:2"``),
  in that order; ``(components, isolator)``.
- ``two_containers(node, **flags)`` starts the node's isolator (``flags``
  go to ``node.start``), recovers nothing and prepares ``c1`` and ``c2``
  with one GPU each: GPU 0 and GPU 1 (lowest-first allocation).
- ``two_containers_probed(node, probes)`` (async context manager): in a
  Runtime, ``two_containers(node)``, c1's cgroup directory and a probe
  process (from the ``probes`` factory) in it; a body that ends without
  raising ends with ``finish(node, probe)``.
- ``free_gpus(node)``: the minors of the GPUs the node's allocator has free.
- ``cleanup_until_removed`` repeats ``cleanup`` of a lingering container
  until the kernel lets its cgroup go, bounded (a hang fails the test).
- ``finish(node, *probes)`` closes the probes (so their cgroups can be
  removed), cleans every container up (the root must be gone) and stops
  the node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from isolators import ContainerConfig, ContainerID, Resources
from runtime import Runtime

from .nodes import Node
from .probes import DeviceProbe

__all__ = ["C", "config", "started_with", "two_containers", "two_containers_probed", "free_gpus", "cleanup_until_removed", "finish"]


def C(name: str) -> ContainerID:
    return ContainerID(name)


def config(resources: int | str | None = None, **fields: Any) -> ContainerConfig:
    """A config asking for ``resources`` (see the module rules)."""
    if isinstance(resources, int):
        asked = Resources.parse(f"gpus:{resources}")
    else:
        asked = Resources.parse(resources) if resources else Resources()
    return ContainerConfig(resources=asked, **fields)


async def started_with(node: Node, **asked: int | str) -> tuple[Any, Any]:
    """The node's components and isolator, started, with each container of
    ``asked`` (name=resources) prepared in turn."""
    components, isolator = await node.start()
    for name, resources in asked.items():
        await isolator.prepare(C(name), config(resources))
    return components, isolator


async def two_containers(node: Node, **flags: Any) -> Any:
    """The node's isolator, recovered empty, with ``c1`` on GPU 0 and ``c2`` on GPU 1."""
    _components, isolator = await node.start(**flags)
    await isolator.recover([], set())
    await isolator.prepare(C("c1"), config(1))
    await isolator.prepare(C("c2"), config(1))
    return isolator


@asynccontextmanager
async def two_containers_probed(node: Node, probes: Callable[[], DeviceProbe],
                                **flags: Any) -> AsyncIterator[tuple[Node, Any, str, DeviceProbe]]:
    """In a Runtime: ``node``, the isolator ``two_containers(node, **flags)``
    leaves, c1's cgroup directory and a probe process in it; once the body
    is done (not when it raised), ``finish(node, probe)``."""
    async with Runtime():
        isolator = await two_containers(node, **flags)
        c1 = node.cgroup_dir("c1")
        probe = probes()
        probe.move_to(c1)
        yield node, isolator, c1, probe
        await finish(node, probe)


async def free_gpus(node: Node) -> set[int]:
    """The minors of the GPUs free in the node's allocator."""
    return {g.minor for g in await node.components.allocator.available()}


async def cleanup_until_removed(node: Node, isolator: Any, cid: ContainerID | str, timeout: float = 10.0) -> None:
    """Clean ``cid`` up until its cgroup is gone (its processes gone, the kernel lets it go), bounded."""
    container = cid if isinstance(cid, ContainerID) else C(cid)
    with anyio.fail_after(timeout):
        while node.cgroup_exists(str(container)):
            await isolator.cleanup(container)
            await anyio.sleep(0.01)


async def finish(node: Node, *probes: DeviceProbe) -> None:
    """Close ``probes``, clean up every container (the root must be gone), stop the node."""
    for probe in probes:
        probe.close()
    await node.clean_all()
    await node.stop()
