"""Fixtures for the NVIDIA GPU isolator tests (helpers live in ``tests.support``).

- ``node`` (parametrized over ``backend``: memory, cgroups_v1, cgroups_v2)
  is a ``tests.support.nodes.Node`` in ``tmp_path``: a simulated node of 4
  GPUs with usage readings, its own cgroups root. ``await node.start()``
  builds components and an isolator from its flags (inside
  ``async with Runtime():``). Kernel backends run only as root with the
  hierarchy present (else they skip with the reason). Teardown removes the
  whole root, even when the test failed.
- ``kernel_node`` is the same over the two kernel backends only;
  ``memory_node`` the in-memory one; ``node_factory(backend)`` (tests/conftest.py)
  makes more, and ``probes`` spawns ``DeviceProbe`` children that open device
  nodes from inside a cgroup, judged by ``tests.support.probes.verdict``
  (DENIED iff EPERM, else GRANTED).
- ``char_nodes`` are mknod'ed 195:0..3 and 195:255 in a temp directory, by
  (major, minor).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest

from tests.support.kernel import BACKENDS, KERNEL_BACKENDS
from tests.support.nodes import Node
from tests.support.probes import mknod_nodes


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def node(backend: str, node_factory: Callable[[str], Node]) -> Node:
    return node_factory(backend)


@pytest.fixture
def kernel_node(kernel_backend: str, node_factory: Callable[[str], Node]) -> Node:
    return node_factory(kernel_backend)


@pytest.fixture
def memory_node(node_factory: Callable[[str], Node]) -> Node:
    return node_factory("memory")


@pytest.fixture
def char_nodes(tmp_path: Any) -> dict[tuple[int, int], str]:
    """mknod'ed char nodes 195:0..3 and 195:255 (nvidiactl), by (major, minor)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = tmp_path / "probe-nodes"
    directory.mkdir()
    nodes = mknod_nodes(str(directory), [("c", 195, minor) for minor in (0, 1, 2, 3, 255)])
    return {(major, minor): path for (_kind, major, minor), path in nodes.paths.items()}
