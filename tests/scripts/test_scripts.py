"""Every message script, on every backend this machine has (R-MS-2).

The Mesos scenarios in this directory, the README's examples and the
built-in demo run on the in-memory backend always, and on cgroups v1 and v2
when root (they skip with the reason otherwise). Each run gets a cgroups root
of its own (``gpu-isolator-test-scripts-<random>``); afterwards nothing may
be left under it — and the fixture removes whatever a failed run left.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from actors.devices import MemoryBackend, default_hierarchy
from isolators import load_script_file, run_script
from isolators.simulated_node import backend_unavailable, remove_cgroup_tree
from runtime import Runtime
from tests.support.kernel import BACKENDS

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPTS = sorted([*HERE.glob("*.yaml"), *HERE.glob("*.json")]) + sorted((REPO / "examples").glob("*.yaml")) + [
    REPO / "isolators" / "demo" / "demo.yaml"
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    reason = backend_unavailable(request.param)
    if reason is not None:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def cgroups_root(backend: str):
    root = f"gpu-isolator-test-scripts-{uuid.uuid4().hex[:12]}"
    yield root
    base = default_hierarchy(backend)
    if base is not None:
        remove_cgroup_tree(os.path.join(base, root))
    else:
        MemoryBackend.drop_shared(f"memory:/{root}")


@pytest.mark.asyncio
@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
async def test_script(path: Path, backend: str, cgroups_root: str) -> None:
    script = load_script_file(str(path))
    lines: list[str] = []
    async with Runtime():
        report = await run_script(script, backend, echo=lines.append, cgroups_root=cgroups_root)
    # Nothing is left: no cgroup below the run's root, and not the root.
    if backend == "memory":
        assert MemoryBackend.shared_table(f"memory:/{cgroups_root}") is None, "the run left cgroups behind"
    assert report.passed, "\n".join(lines)
    assert report.results and len(report.results) == len(script.steps)
    assert lines[-1].startswith(f"{script.name} on {backend}: ") and lines[-1].endswith("every expectation held")
    if backend != "memory":
        assert not os.path.exists(os.path.join(default_hierarchy(backend), cgroups_root)), "the run left cgroups behind"


@pytest.mark.asyncio
async def test_a_failing_run_still_removes_its_cgroups(backend: str, cgroups_root: str, tmp_path: Path) -> None:
    (tmp_path / "fails.yaml").write_text(
        "node: {gpus: 2}\n"
        "steps:\n"
        "  - prepare: {id: a, resources: 'gpus:1'}\n"
        "  - prepare: {id: b, resources: 'gpus:1'}\n"
        "    expect: {gpus: [0]}\n"
    )
    script = load_script_file(str(tmp_path / "fails.yaml"))
    lines: list[str] = []
    async with Runtime():
        report = await run_script(script, backend, echo=lines.append, cgroups_root=cgroups_root)
    assert not report.passed
    assert [r.ok for r in report.results] == [True, False]
    failure = report.results[1]
    assert (failure.line, failure.expected, failure.actual) == (4, "b holds GPUs [0]", "b holds GPUs [1]")
    assert "  FAIL   2  line 4    prepare b (gpus:1) -> other GPUs than expected" in lines
    assert lines[-1].endswith("FAILED (line 4)")
    base = default_hierarchy(backend)
    if base is not None:
        assert not os.path.exists(os.path.join(base, cgroups_root))
    else:
        assert MemoryBackend.shared_table(f"memory:/{cgroups_root}") is None


@pytest.mark.asyncio
async def test_an_isolator_call_failing_with_another_error_type_breaks_its_step(monkeypatch, tmp_path: Path) -> None:
    """SPEC 11: every failure of an isolator method is an IsolatorError. A call
    that fails otherwise breaks its step even when the text is the expected one
    (alone and inside ``concurrent``)."""
    from actors.allocator import AllocatorError
    from isolators._handle import NvidiaGpuIsolator
    from runtime import Future

    def refuse(self, container_id, *args):
        return Future.failed(AllocatorError("Requested 1 gpus but only 0 available"))

    (tmp_path / "types.yaml").write_text(
        "node: {gpus: 2}\n"
        "steps:\n"
        "  - prepare: {id: a, resources: 'gpus:1'}\n"
        "    expect: {error: 'only 0 available'}\n"
        "  - concurrent: {steps: [{update: {id: a, resources: 'gpus:1'}, expect: {error: 'only 0 available'}}]}\n"
        "  - cleanup: {id: a}\n"
    )
    script = load_script_file(str(tmp_path / "types.yaml"))
    monkeypatch.setattr(NvidiaGpuIsolator, "prepare", refuse)
    monkeypatch.setattr(NvidiaGpuIsolator, "update", refuse)
    lines: list[str] = []
    async with Runtime():
        report = await run_script(script, "memory", echo=lines.append)
    assert [r.ok for r in report.results] == [False, False, True], "\n".join(lines)
    wrong = "AllocatorError (not an IsolatorError): Requested 1 gpus but only 0 available"
    prepare, concurrent = report.results[:2]
    assert (prepare.expected, prepare.actual) == ("an IsolatorError containing 'only 0 available'", f"error: {wrong}")
    assert (concurrent.expected, concurrent.actual) == ("update a to gpus:1: an IsolatorError",
                                                        f"update a to gpus:1: error: {wrong}")
