"""R-IS-3/4/6 on the real kernel (root, cgroups v1 and v2): a child process
moved into the container's cgroup opens mknod'ed nodes — its GPUs and
nvidiactl give ENXIO (allowed; no driver), the other GPUs EPERM — across
prepare -> update up -> update down -> cleanup."""

from __future__ import annotations

import os

import pytest

import runtime
from isolators import ContainerConfig, ContainerID, Resources
from tests.support.probes import DENIED, GRANTED


def access(probe, char_nodes) -> dict[str, str]:
    """The verdict on opening each GPU node and nvidiactl, by name."""
    seen = {f"gpu{m}": probe.access(char_nodes[195, m]) for m in range(4)}
    seen["nvidiactl"] = probe.access(char_nodes[195, 255])
    return seen


def expect(granted: set[int]) -> dict[str, str]:
    wanted = {f"gpu{m}": GRANTED if m in granted else DENIED for m in range(4)}
    wanted["nvidiactl"] = GRANTED
    return wanted


@pytest.mark.asyncio
async def test_a_process_in_the_container_sees_exactly_its_gpus(kernel_node, char_nodes, probes) -> None:
    cid = ContainerID("job")
    async with runtime.Runtime():
        components, isolator = await kernel_node.start()
        # Another container holds GPU 0 throughout.
        await isolator.prepare(ContainerID("other"), ContainerConfig(resources=Resources.parse("gpus:1")))
        await isolator.prepare(cid, ContainerConfig(resources=Resources.parse("gpus:1")))
        path = isolator.devices.path("job")
        expected_root = {"cgroups_v1": "/sys/fs/cgroup/devices", "cgroups_v2": kernel_node.hierarchy}
        assert path == os.path.join(expected_root[kernel_node.backend], kernel_node.cgroups_root, "job")
        probe = probes()
        probe.move_to(path)
        with open(os.path.join(path, "cgroup.procs")) as procs:
            assert str(probe.pid) in procs.read().split()
        assert access(probe, char_nodes) == expect({1})
        assert probe.access("/dev/null") == GRANTED

        await isolator.update(cid, Resources.parse("gpus:3"))
        assert await isolator.containers() == {"other": [0], "job": [1, 2, 3]}
        assert access(probe, char_nodes) == expect({1, 2, 3})

        await isolator.update(cid, Resources.parse("gpus:1"))
        assert await isolator.containers() == {"other": [0], "job": [1]}
        assert access(probe, char_nodes) == expect({1})

        await isolator.update(cid, Resources.parse("gpus:0"))
        assert access(probe, char_nodes) == expect(set())

        await isolator.update(cid, Resources.parse("gpus:2"))
        assert access(probe, char_nodes) == expect({1, 2})

        # Cleanup with the process inside: it keeps nvidiactl, loses the GPUs.
        await isolator.cleanup(cid)
        assert access(probe, char_nodes) == expect(set())
        probe.close()
        await isolator.cleanup(cid)
        assert not os.path.isdir(path)
        await isolator.cleanup(ContainerID("other"))
        assert await isolator.devices.list_cgroups() == []


@pytest.mark.asyncio
async def test_a_process_outside_the_container_is_not_restricted(kernel_node, char_nodes, probes) -> None:
    async with runtime.Runtime():
        components, isolator = await kernel_node.start()
        await isolator.prepare(ContainerID("job"), ContainerConfig(resources=Resources.parse("gpus:1")))
        outside = probes()
        assert access(outside, char_nodes) == expect({0, 1, 2, 3})
        await isolator.cleanup(ContainerID("job"))
