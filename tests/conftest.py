"""Fixtures every test directory shares; the helpers behind them are in
``tests.support`` (import them, never copy them).

- ``node_factory(backend, gpus=4, **flags)`` -> a ``tests.support.nodes.Node``
  in its own sub-directory of ``tmp_path``, its cgroups root named
  ``<node_root_prefix><hex>``; skips with the reason when ``backend`` cannot
  run here. Every node made is torn down after the test (its whole cgroups
  root removed), also when the test failed.
- ``node_root_prefix``: ``gpu-isolator-test-<pid>-`` (a directory's conftest
  may narrow it).
- ``probes()`` spawns a ``DeviceProbe`` (killed at teardown).
- ``fake_nvml_lib`` (session): the fake NVML (``tests/native/fake_nvml.c``)
  built once with gcc into ``libnvidia-ml.so.1``; skips when gcc is absent.
- ``mps_control`` (session): the stand-in ``nvidia-cuda-mps-control``
  (``actors.mps.testing``) built once with gcc; skips when gcc is absent.
- Every test is watched (``tests.support.host_facts``): opening the host's
  ``/etc/ld.so.cache`` or ``/proc/devices`` fails it unless it is marked
  ``@pytest.mark.host_facts`` (it reads the host's own on purpose); so does
  touching the host's node ledger (``/run/gpu-isolator/ledger``), or making
  it from a child process: a test's front doors have a ledger of their own.
- The project's bytecode (``tests.support.bytecode.compile_project``) is
  written once as the session is configured, so the Python processes the
  tests start read it instead of compiling the project again each time
  (the environment may say ``PYTHONDONTWRITEBYTECODE=1``); the session's
  own process keeps what it compiles (``keep_bytecode``: pytest's rewritten
  test modules), for the next session to read.
- The image tests' build (``tests.support.image.session_build``) starts in
  the background as the first test outside ``tests/benchmarks`` starts and
  the image tests run last, so the build overlaps the suite,
  where the session holds image tests and the image can be built here; a
  session that ends before they took it still waits for it and removes it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from tests.support import host_facts
from tests.support.bytecode import compile_project, keep_bytecode
from tests.support.fake_nvml import NO_GCC, build_fake_nvml
from tests.support.kernel import skip_reason
from tests.support.nodes import TEST_ROOT_PREFIX, Node
from tests.support.probes import DeviceProbe


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{host_facts.MARKER}: the test reads the host's own loader cache or"
                            " /proc/devices on purpose")
    host_facts.watch()
    keep_bytecode()
    compile_project()


_IMAGE_TESTS = "tests/image/"
_image_wanted = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.startswith(_IMAGE_TESTS))  # stable: image tests last


def pytest_collection_finish(session: pytest.Session) -> None:
    global _image_wanted
    from tests.support.image import image_skip_reason
    _image_wanted = (any(item.nodeid.startswith(_IMAGE_TESTS) and "image" in getattr(item, "fixturenames", ())
                         for item in session.items) and image_skip_reason() is None)


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _image_wanted and not nodeid.startswith("tests/benchmarks/"):
        from tests.support.image import session_build
        session_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _image_wanted:
        from tests.support.image import session_build
        build = session_build(start=False)
        if build is not None and not build.taken:
            build.close()


@pytest.fixture(autouse=True)
def _reads_no_host_facts(request: pytest.FixtureRequest) -> Iterator[None]:
    host_facts.forget()
    ledger_existed = host_facts.ledger_before()
    yield
    seen = host_facts.opened()
    host_facts.forget()
    if seen and request.node.get_closest_marker(host_facts.MARKER) is None:
        pytest.fail(f"the test opened the host's {sorted(set(seen))}: give its node its own"
                    " (SimulatedNode's ld_cache and proc_dir; --node_ledger for a front door on the real NVML)"
                    " or mark it host_facts", pytrace=False)
    if host_facts.ledger_made(ledger_existed):
        pytest.fail(f"a front door of the test (a child process?) made the host's node ledger"
                    f" {host_facts.HOST_LEDGER}: give each front door on the real NVML a ledger of its own"
                    " (--node_ledger / Flags.node_ledger)", pytrace=False)


@pytest.fixture
def node_root_prefix() -> str:
    return TEST_ROOT_PREFIX


@pytest.fixture
def node_factory(tmp_path: Any, node_root_prefix: str) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(backend: str, gpus: int = 4, **extra: Any) -> Node:
        reason = skip_reason(backend)
        if reason:
            pytest.skip(reason)
        sub = tmp_path / f"node{len(made)}"
        sub.mkdir()
        node = Node(sub, backend, gpus, root_prefix=node_root_prefix, **extra)
        made.append(node)
        return node

    try:
        yield make
    finally:
        errors = []
        for node in made:
            try:
                node.teardown()
            except Exception as error:  # keep tearing down the others
                errors.append(error)
        if errors:
            raise errors[0]


@pytest.fixture
def probes() -> Iterator[Callable[[], DeviceProbe]]:
    spawned: list[DeviceProbe] = []

    def spawn() -> DeviceProbe:
        probe = DeviceProbe()
        spawned.append(probe)
        return probe

    try:
        yield spawn
    finally:
        for probe in spawned:
            probe.close()


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The fake NVML, built with gcc (skips when gcc is absent)."""
    lib = build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))
    if lib is None:
        pytest.skip(NO_GCC)
    return lib


@pytest.fixture(scope="session")
def mps_control(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The stand-in MPS control daemon, built with gcc (skips when gcc is absent)."""
    from actors.mps.testing import build_mps_control
    built = build_mps_control(tmp_path_factory.mktemp("mps-control"))
    if built is None:
        pytest.skip(NO_GCC)
    return built
