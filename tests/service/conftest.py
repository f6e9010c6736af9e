"""Fixtures for ``serve`` / ``exec`` / ``status`` (helpers live in ``tests.support.services``).

- ``kernel_service`` (module scope, over cgroups v1 and v2; skips with the
  reason where a backend cannot run): one ``ServeProcess`` on a simulated
  4-GPU node with its own cgroups root, its socket in a directory every
  user may reach, listening on loopback too (``SECRET`` is its bearer
  credential), shared by the tests of a module; each test leaves it with
  no container. Torn down (service stopped, clients killed, the cgroups
  root removed) even when a test fails.
- ``memory_service`` (module scope): the same on the in-memory backend.
- ``serve_factory(backend, host=None, **options)``: a node (``host``: its
  host document, default 4 plain GPUs) and a (not yet started)
  ServeProcess of one test's own, torn down after it.
- ``gpu_nodes``: mknod'ed 195:0..3 (the GPUs) and 195:255 (nvidiactl), as
  {minor: path}, mode 0666 in a directory every user may reach (root only).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Iterator

import pytest

from tests.support.kernel import KERNEL_BACKENDS, skip_reason
from tests.support.nodes import TEST_ROOT_PREFIX, Node
from tests.support.probes import mknod_nodes
from tests.support.services import ServeProcess, remove_native_tools
from tests.support.users import public_dir

SECRET = "test-bearer-secret"


def _service(directory: Any, backend: str, host: dict[str, Any] | None = None,
             **options: Any) -> tuple[Node, ServeProcess]:
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    node = Node(directory / "node", backend, 4, host=host, root_prefix=TEST_ROOT_PREFIX)
    return node, ServeProcess(node, directory, **options)


def _module_service(tmp_path_factory: Any, backend: str) -> Iterator[ServeProcess]:
    node, service = _service(tmp_path_factory.mktemp(f"serve-{backend}"), backend, listen="127.0.0.1:0",
                             credential=SECRET)
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

    def make(backend: str, host: dict[str, Any] | None = None, **options: Any) -> ServeProcess:
        directory = tmp_path / f"service{len(made)}"
        directory.mkdir()
        node, service = _service(directory, backend, host, **options)
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
def gpu_nodes() -> Iterator[dict[int, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = public_dir("gpu-isolator-nodes-")
    try:
        nodes = mknod_nodes(directory, [("c", 195, minor) for minor in (0, 1, 2, 3, 255)])
        for path in nodes.paths.values():
            os.chmod(path, 0o666)  # any user may open them: the device cgroup alone decides
        yield {minor: path for (_kind, _major, minor), path in nodes.paths.items()}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _native_tools() -> Iterator[None]:
    yield
    remove_native_tools()
