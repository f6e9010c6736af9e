"""Fixtures of the reliability tests (issue 9); the kit itself — nodes, the
kernel as judge, probes, teardown — is ``tests.support``.

Rules:
- Nodes made here (``node_factory``, tests/conftest.py) have cgroups roots
  named ``gpu-isolator-test-rel<pid>-<hex>``, so the session check below
  finds whatever they leave.
- ``kit`` is the ``tests.support`` package, for tests written against it
  (``kit.judge``, ``kit.Node``, ``kit.skip_reason``); new tests import the
  names instead.
- ``gpu_nodes``: mknod'ed char nodes 195:0..3 and 195:255 by minor (root only).
- After each test (autouse) no eBPF program fd and no child process it
  opened may be left (what existed before the test is frozen out of the
  collection that judges it: a full collection of the whole suite's heap
  cost 0.2-0.45 s a test); after the session no cgroup root of this session, no
  in-memory table, and no eBPF program seen on a test cgroup may outlive
  the tests.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Iterator

import pytest

import tests.support as support
from actors.devices import MemoryBackend
from tests.support.kernel import SEEN_PROGRAMS, V1_HIERARCHY, V2_HIERARCHY, bpf_fds, children
from tests.support.kernel import remove_test_cgroups, wait_until_freed
from tests.support.probes import mknod_nodes

SESSION_PREFIX = f"gpu-isolator-test-rel{os.getpid()}-"


@pytest.fixture
def node_root_prefix() -> str:
    return SESSION_PREFIX


@pytest.fixture(scope="session")
def kit() -> Any:
    return support


@pytest.fixture(scope="session")
def gpu_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """mknod'ed char nodes 195:0..3 and 195:255 in a temp dir, by minor (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = str(tmp_path_factory.mktemp("gpu-nodes"))
    nodes = mknod_nodes(directory, [("c", 195, minor) for minor in (0, 1, 2, 3, 255)], name="nvidia{minor}")
    return {minor: path for (_kind, _major, minor), path in nodes.paths.items()}


@pytest.fixture(autouse=True)
def _no_leaked_fds_or_children() -> Iterator[None]:
    gc.freeze()  # what exists now is not this test's: the collection below walks only what the test made
    before_children, before_fds = children(), bpf_fds()
    yield
    gc.collect()  # a dropped v2 backend closes its cached program fds when collected
    assert bpf_fds() <= before_fds, "eBPF program fds left open by the test"
    assert children() <= before_children, "child processes left running by the test"


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    leftovers = [
        os.path.join(h, name)
        for h in (V1_HIERARCHY, V2_HIERARCHY)
        if h and os.path.isdir(h)
        for name in os.listdir(h)
        if name.startswith(SESSION_PREFIX)
    ]
    tables = [root for root in MemoryBackend.shared_roots() if SESSION_PREFIX in root]
    for path in leftovers:  # clean up anyway, then fail
        remove_test_cgroups(path, v2=not path.startswith(V1_HIERARCHY))
    for root in tables:
        MemoryBackend.drop_shared(root)
    gc.unfreeze()  # everything the tests froze is judged once more
    gc.collect()
    alive = wait_until_freed(sorted(SEEN_PROGRAMS))
    assert not leftovers, f"cgroups left behind: {leftovers}"
    assert not tables, f"in-memory cgroup tables left behind: {tables}"
    assert not alive, f"eBPF programs outlived their test cgroups: {alive}"
