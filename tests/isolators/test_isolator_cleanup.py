"""R-IS-6: cleanup — nested and unknown ids succeed silently; it is
idempotent, removes the container cgroup and frees the GPUs; with a process
still inside the cgroup (kernel), the GPUs are denied to it and released,
a warning says so, and the cgroup stays."""

from __future__ import annotations

import logging
import os

import pytest

import runtime
from isolators import ContainerConfig, ContainerID, Resources
from tests.support.probes import DENIED, GRANTED
from tests.support.containers import cleanup_until_removed, started_with
from tests.support.errors import isolator_failure

NO_MANIFEST = "The 'ContainerConfig' for docker is missing a manifest"


def still_busy(cid: ContainerID) -> str:
    return (f"Container {cid}: the cgroup '{cid}' of an earlier container with this id still has processes; it"
            " cannot be prepared again until it is gone")


@pytest.mark.asyncio
async def test_cleanup_of_nested_and_unknown_ids_succeeds_silently(node, caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with runtime.Runtime():
        components, isolator = await started_with(node, c1="gpus:1")
        assert await isolator.cleanup(ContainerID("nested", ContainerID("c1"))) is None
        assert await isolator.cleanup(ContainerID("nested", ContainerID("nobody"))) is None
        assert await isolator.cleanup(ContainerID("nobody")) is None
        assert await isolator.containers() == {"c1": [0]}
        assert await isolator.devices.exists("c1")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_cleanup_removes_the_cgroup_frees_gpus_and_is_idempotent(node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(node, c1="gpus:3", c2="gpus:1")
        assert await components.allocator.available() == set()
        assert node.cgroup_exists("c1")
        await isolator.cleanup(ContainerID("c1"))
        assert not node.cgroup_exists("c1") and not await isolator.devices.exists("c1")
        assert {g.minor for g in await components.allocator.available()} == {0, 1, 2}
        assert await isolator.containers() == {"c2": [3]}
        await isolator.cleanup(ContainerID("c1"))  # again: nothing to do
        assert await isolator.containers() == {"c2": [3]}
        assert {g.minor for g in await components.allocator.available()} == {0, 1, 2}
        await isolator_failure(isolator.update(ContainerID("c1"), Resources.parse("gpus:1")), "Unknown container")
        await isolator.cleanup(ContainerID("c2"))
        assert await components.allocator.available() == components.allocator.total()
        assert await isolator.devices.list_cgroups() == []
        assert await isolator.devices.remove_root()


@pytest.mark.asyncio
async def test_cleanup_with_a_process_inside_denies_and_releases(kernel_node, char_nodes, probes, caplog) -> None:
    caplog.set_level(logging.WARNING)
    cid = ContainerID("busy")
    async with runtime.Runtime():
        components, isolator = await kernel_node.start()
        await isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:2")))
        probe = probes()
        probe.move_to(isolator.devices.path("busy"))
        assert probe.access(char_nodes[195, 0]) == GRANTED
        assert probe.access(char_nodes[195, 1]) == GRANTED

        await isolator.cleanup(cid)
        assert any("still has processes" in r.getMessage() and "busy" in r.getMessage() for r in caplog.records)
        # The GPUs went back to the pool, and the process lost them.
        assert await components.allocator.available() == components.allocator.total()
        assert await isolator.containers() == {}
        assert os.path.isdir(isolator.devices.path("busy"))
        for minor in range(4):
            assert probe.access(char_nodes[195, minor]) == DENIED, minor
        assert probe.access(char_nodes[195, 255]) == GRANTED
        assert probe.access("/dev/null") == GRANTED
        state = await isolator.devices.state("busy")
        assert not any(state.is_granted("c", 195, m, "r") for m in range(4))

        # The id cannot be prepared again while the old processes are inside.
        await isolator_failure(isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:1"))),
                               still_busy(cid))
        assert await components.allocator.available() == components.allocator.total()
        assert probe.access(char_nodes[195, 0]) == DENIED

        # Once they are gone, a cleanup removes it and the id is usable again.
        probe.close()
        await isolator.cleanup(cid)
        assert not os.path.isdir(isolator.devices.path("busy"))
        await isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:1")))
        assert await isolator.containers() == {"busy": [0]}
        await isolator.cleanup(cid)
        assert not os.path.isdir(isolator.devices.path("busy"))


@pytest.mark.asyncio
async def test_failed_prepare_onto_an_occupied_cgroup_takes_the_gpus_back(kernel_node, char_nodes, probes) -> None:
    """A cgroup of that id already exists with a process inside (nobody
    recovered it): the prepare grants, fails later (rootfs without manifest),
    and its undo must leave that process without GPUs, not with them."""
    cid = ContainerID("taken")
    async with runtime.Runtime():
        components, isolator = await kernel_node.start()
        await isolator.prepare(ContainerID("seed"), ContainerConfig())  # creates the root
        os.mkdir(isolator.devices.path("taken"))
        probe = probes()
        probe.move_to(isolator.devices.path("taken"))
        rootfs = os.path.join(kernel_node.tmp, "rootfs")
        os.makedirs(rootfs)
        await isolator_failure(isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:2"), rootfs=rootfs)),
                               NO_MANIFEST)
        assert await components.allocator.available() == components.allocator.total()
        assert await isolator.containers() == {"seed": []}
        for minor in range(4):
            assert probe.access(char_nodes[195, minor]) == DENIED, minor
        await isolator_failure(isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:1"))),
                               still_busy(cid))
        probe.close()
        await isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:1")))
        assert await isolator.containers() == {"seed": [], "taken": [0]}
        for name in ("taken", "seed"):
            await isolator.cleanup(ContainerID(name))
        assert await isolator.devices.list_cgroups() == []


# -- an unknown id whose cgroup someone else made (issue 20 item 6) ----------------------------
def outsider_makes(node, name: str) -> None:
    """A cgroup under the isolator's root that the isolator never made (it grants every device)."""
    if node.kernel:
        os.mkdir(node.cgroup_dir(name))
    else:
        node.inner_backend().configure(name, ["a *:* rwm"], [])


@pytest.mark.asyncio
async def test_cleanup_of_an_unknown_id_removes_a_cgroup_someone_else_made(node, caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with runtime.Runtime():
        components, isolator = await started_with(node, keep="gpus:1")
        outsider_makes(node, "ghost")
        assert node.cgroup_exists("ghost")
        assert await isolator.cleanup(ContainerID("ghost")) is None
        assert not node.cgroup_exists("ghost")
        assert any("Container ghost: cleanup of an unknown container found its cgroup 'ghost'" in r.getMessage()
                   and "removed it" in r.getMessage() for r in caplog.records)
        assert await isolator.devices.list_cgroups() == ["keep"]
        await isolator.cleanup(ContainerID("keep"))


@pytest.mark.asyncio
async def test_cleanup_of_an_unknown_id_whose_cgroup_has_processes_denies_every_gpu(
    kernel_node, char_nodes, probes
) -> None:
    node = kernel_node
    async with runtime.Runtime():
        components, isolator = await started_with(node, keep="gpus:1")
        outsider_makes(node, "ghost")
        probe = probes()
        probe.move_to(node.cgroup_dir("ghost"))
        assert probe.access(char_nodes[(195, 0)]) == GRANTED  # granted every device
        await isolator.cleanup(ContainerID("ghost"))
        assert node.cgroup_exists("ghost")
        assert [probe.access(char_nodes[(195, m)]) for m in range(4)] == [DENIED] * 4
        assert probe.access(char_nodes[(195, 255)]) == GRANTED  # nvidiactl stays, as for a lingering container
        await isolator_failure(isolator.prepare(ContainerID("ghost"), ContainerConfig(resources=Resources.parse("gpus:1"))),
                               still_busy(ContainerID("ghost")))
        probe.close()
        await cleanup_until_removed(node, isolator, "ghost")  # its processes gone: a cleanup removes it
        await isolator.cleanup(ContainerID("keep"))
        assert await components.allocator.available() == components.allocator.total()
