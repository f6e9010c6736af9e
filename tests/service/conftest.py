"""Fixtures for ``serve`` / ``exec`` / ``status`` (helpers live in ``tests.support.services``).

- ``kernel_service`` (module scope, over cgroups v1 and v2; skips with the
  reason where a backend cannot run): one ``ServeProcess`` on a simulated
  4-GPU node with its own cgroups root, shared by the tests of a module;
  each test leaves it with no container. Torn down (service stopped,
  clients killed, the cgroups root removed) even when a test fails.
- ``memory_service`` (module scope): the same on the in-memory backend.
- ``serve_factory(backend, host=None, **flags)``: a node (``host``: its
  host document, default 4 plain GPUs) and a (not yet started)
  ServeProcess of one test's own, torn down after it.
- ``gpu_nodes``: mknod'ed 195:0..3 (the GPUs) and 195:255 (nvidiactl), as
  {minor: path} (root only).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import pytest

from tests.support.kernel import KERNEL_BACKENDS, skip_reason
from tests.support.nodes import TEST_ROOT_PREFIX, Node
from tests.support.probes import mknod_nodes
from tests.support.services import ServeProcess


def _service(directory: Any, backend: str, host: dict[str, Any] | None = None,
             **flags: Any) -> tuple[Node, ServeProcess]:
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    node = Node(directory / "node", backend, 4, host=host, root_prefix=TEST_ROOT_PREFIX)
    return node, ServeProcess(node, directory, **flags)


def _module_service(tmp_path_factory: Any, backend: str) -> Iterator[ServeProcess]:
    node, service = _service(tmp_path_factory.mktemp(f"serve-{backend}"), backend)
    try:
        yield service.start()
    finally:
        try:
            service.close()
        finally:
            node.teardown()


@pytest.fixture(scope="module", params=KERNEL_BACKENDS)
def kernel_service(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[ServeProcess]:
    yield from _module_service(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory: Any) -> Iterator[ServeProcess]:
    yield from _module_service(tmp_path_factory, "memory")


@pytest.fixture
def serve_factory(tmp_path: Any) -> Iterator[Callable[..., ServeProcess]]:
    made: list[tuple[Node, ServeProcess]] = []

    def make(backend: str, host: dict[str, Any] | None = None, **flags: Any) -> ServeProcess:
        directory = tmp_path / f"service{len(made)}"
        directory.mkdir()
        node, service = _service(directory, backend, host, **flags)
        made.append((node, service))
        return service

    try:
        yield make
    finally:
        for node, service in made:
            try:
                service.close()
            finally:
                node.teardown()


@pytest.fixture(scope="module")
def gpu_nodes(tmp_path_factory: Any) -> dict[int, str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = tmp_path_factory.mktemp("gpu-nodes")
    nodes = mknod_nodes(str(directory), [("c", 195, minor) for minor in (0, 1, 2, 3, 255)])
    return {minor: path for (_kind, _major, minor), path in nodes.paths.items()}
