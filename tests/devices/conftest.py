"""Fixtures for device control tests (helpers live in ``tests.support``).

Kernel tests run only as root with the hierarchy present (else they skip
with the reason). Each creates its cgroups under a parent of its own named
``gpu-isolator-test-<pid>-<random>`` (a ``CgroupSandbox``) and its teardown
removes everything, even when the test failed: probe processes are killed
first, v2 programs on those cgroups are detached (and checked to be freed),
then the cgroups are removed deepest first.

``device_nodes``: mknod'ed nodes the probes open, by (type, major, minor):
major 195 (NVIDIA, no driver here) and the unassigned major 240, char and
block. Judged by ``tests.support.probes.verdict``: DENIED iff EPERM, else
GRANTED (ENXIO here, no driver; 0 or ENODEV where a driver serves the major).
"""

from __future__ import annotations

import gc
import os
import uuid
from typing import Any, Iterator

import pytest

from tests.support.kernel import V1_HIERARCHY, V2_HIERARCHY, attached_programs, program_infos
from tests.support.kernel import remove_test_cgroups, skip_reason, wait_until_freed
from tests.support.probes import DeviceNodes, DeviceProbe, mknod_nodes

CHAR_NODES = [(195, 0), (195, 1), (195, 2), (195, 3), (195, 255), (240, 0), (240, 1)]
BLOCK_NODES = [(240, 0), (240, 1)]


@pytest.fixture(scope="session")
def device_nodes(tmp_path_factory: pytest.TempPathFactory) -> DeviceNodes:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    return mknod_nodes(str(tmp_path_factory.mktemp("device-nodes")),
                       [("c", *n) for n in CHAR_NODES] + [("b", *n) for n in BLOCK_NODES])


class CgroupSandbox:
    """A test parent cgroup (the ``cgroups_root``) and the probes spawned for it."""

    def __init__(self, hierarchy: str, v2: bool) -> None:
        self.hierarchy = hierarchy
        self.v2 = v2
        self.cgroups_root = f"gpu-isolator-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root = os.path.join(hierarchy, self.cgroups_root)
        self.probes: list[DeviceProbe] = []
        self.program_ids: list[int] = []

    def probe(self, cgroup: str | None = None) -> DeviceProbe:
        """A new probe process, moved into ``cgroup`` (relative) when given."""
        probe = DeviceProbe()
        self.probes.append(probe)
        if cgroup is not None:
            probe.move_to(os.path.join(self.root, cgroup))
        return probe

    def attached(self, cgroup: str) -> list[int]:
        """Ids of the device programs attached to ``cgroup``."""
        ids = attached_programs(os.path.join(self.root, cgroup))
        self.program_ids.extend(ids)
        return ids

    def programs(self, cgroup: str) -> list[Any]:
        """What the kernel says of each device program attached to ``cgroup``."""
        infos = program_infos(os.path.join(self.root, cgroup))
        self.program_ids.extend(info.id for info in infos)
        return infos

    def teardown(self) -> None:
        for probe in self.probes:
            probe.close()
        detached = remove_test_cgroups(self.root, self.v2)
        if self.v2:
            gc.collect()  # backends that went out of scope close their cached program fds
            alive = wait_until_freed(detached + self.program_ids)
            assert not alive, f"device programs {alive} outlived the test cgroups"


def _sandbox(backend: str, hierarchy: str | None) -> Iterator[CgroupSandbox]:
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    assert hierarchy is not None
    sandbox = CgroupSandbox(hierarchy, v2=backend == "cgroups_v2")
    try:
        yield sandbox
    finally:
        sandbox.teardown()


@pytest.fixture
def v1_sandbox() -> Iterator[CgroupSandbox]:
    yield from _sandbox("cgroups_v1", V1_HIERARCHY)


@pytest.fixture
def v2_sandbox() -> Iterator[CgroupSandbox]:
    yield from _sandbox("cgroups_v2", V2_HIERARCHY)


@pytest.fixture(params=["v1", "v2"])
def kernel(request: pytest.FixtureRequest) -> str:
    """Each kernel test that takes it runs on cgroups v1 and on cgroups v2."""
    return request.param


@pytest.fixture
def sandbox(kernel: str, request: pytest.FixtureRequest) -> CgroupSandbox:
    """The ``v1_sandbox`` or the ``v2_sandbox``, as ``kernel`` says."""
    return request.getfixturevalue(f"{kernel}_sandbox")
