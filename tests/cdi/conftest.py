"""Fixtures for the CDI and engine tests.

- ``busybox_rootfs`` (session): a busybox root filesystem with the probe
  (``tests.support.engines.PROBE`` at ``/bin/probe``).
- ``podman`` (session): a ``PodmanEngine`` of its own with the rootfs
  imported once as ``localhost/gpu-isolator-test/busybox``; closed (every
  container, image, storage dir and cgroup removed) at the end.
- ``runc``: a ``RuncEngine`` of its own, closed after the test.
- ``gpu_dev``: a dev dir with mknod'd nodes: nvidia0..3 (195:0..3),
  nvidiactl 195:255, nvidia-modeset 195:254, nvidia-uvm 235:0 and
  nvidia-uvm-tools 235:1 (no driver behind any: opening an allowed one
  gives ENXIO).
Each skips with the reason where root, an engine or busybox-static is missing.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.support.engines import PodmanEngine, RuncEngine, build_rootfs, engine_skip_reason, make_device_nodes

GPU_NODES = {f"nvidia{i}": (195, i) for i in range(4)}
CONTROL_NODES = {"nvidiactl": (195, 255), "nvidia-modeset": (195, 254), "nvidia-uvm": (235, 0),
                 "nvidia-uvm-tools": (235, 1)}


def _skip_unless(*engines: str) -> None:
    reason = engine_skip_reason(*engines)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def busybox_rootfs(tmp_path_factory: pytest.TempPathFactory) -> str:
    _skip_unless()
    return build_rootfs(str(tmp_path_factory.mktemp("busybox-rootfs")))


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory, busybox_rootfs: str) -> Iterator[PodmanEngine]:
    _skip_unless("podman")
    directory = tmp_path_factory.mktemp("podman")
    engine = PodmanEngine(str(directory / "engine"), str(directory / "cdi"))
    try:
        engine.import_rootfs(busybox_rootfs, "localhost/gpu-isolator-test/busybox:latest")
        yield engine
    finally:
        engine.close()


@pytest.fixture
def runc(tmp_path) -> Iterator[RuncEngine]:
    _skip_unless("runc")
    engine = RuncEngine(str(tmp_path / "runc"))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def gpu_dev(tmp_path) -> str:
    _skip_unless()
    directory = str(tmp_path / "dev")
    make_device_nodes(directory, {**GPU_NODES, **CONTROL_NODES})
    os.makedirs(os.path.join(directory, "nvidia-caps"))  # a directory: never granted
    return directory
