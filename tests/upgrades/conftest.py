"""Fixtures of the upgrade tests (helpers: ``tests.support.upgrades``).

- ``gpu_nodes``: mknod'ed 195:0..3 (the simulated node's GPUs), as
  {minor: path}, in a directory of the test's own (root only): a probe in
  a container's cgroup opens them and the kernel judges.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.probes import mknod_nodes


@pytest.fixture
def gpu_nodes(tmp_path: Path) -> Iterator[dict[int, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = tmp_path / "devices"
    directory.mkdir()
    nodes = mknod_nodes(str(directory), [("c", 195, minor) for minor in range(4)])
    yield {minor: path for (_kind, _major, minor), path in nodes.paths.items()}
