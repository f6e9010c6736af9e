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

from actors import DeviceControl
from isolators import load_script_file, run_script
from runtime import Runtime

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPTS = sorted([*HERE.glob("*.yaml"), *HERE.glob("*.json")]) + sorted((REPO / "examples").glob("*.yaml")) + [
    REPO / "isolators" / "demo" / "demo.yaml"
]
CGROUP_MOUNT = "/sys/fs/cgroup"


def hierarchy(backend: str) -> str | None:
    """Where ``backend`` keeps its cgroups (as the device layer picks it)."""
    if backend == "cgroups_v1":
        return os.path.join(CGROUP_MOUNT, "devices")
    if backend == "cgroups_v2":
        if os.path.isfile(os.path.join(CGROUP_MOUNT, "cgroup.controllers")):
            return CGROUP_MOUNT
        return os.path.join(CGROUP_MOUNT, "unified")
    return None


def skip_reason(backend: str) -> str | None:
    if backend == "memory":
        return None
    if os.geteuid() != 0:
        return f"{backend} needs root"
    marker = "devices.allow" if backend == "cgroups_v1" else "cgroup.controllers"
    if not os.path.isfile(os.path.join(hierarchy(backend), marker)):
        return f"no {backend} hierarchy at {hierarchy(backend)}"
    return None


def remove_tree(path: str) -> None:
    """Remove a cgroup directory tree, deepest first (cgroups only rmdir)."""
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda entry: -entry[0].count("/")):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


@pytest.fixture(params=["memory", "cgroups_v1", "cgroups_v2"])
def backend(request: pytest.FixtureRequest) -> str:
    reason = skip_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def cgroups_root(backend: str):
    root = f"gpu-isolator-test-scripts-{uuid.uuid4().hex[:12]}"
    yield root
    base = hierarchy(backend)
    if base is not None and os.path.isdir(os.path.join(base, root)):
        remove_tree(os.path.join(base, root))


@pytest.mark.asyncio
@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
async def test_script(path: Path, backend: str, cgroups_root: str) -> None:
    script = load_script_file(str(path))
    lines: list[str] = []
    async with Runtime():
        report = await run_script(script, backend, echo=lines.append, cgroups_root=cgroups_root)
        # Nothing is left: no cgroup below the run's root, and not the root.
        if backend == "memory":
            devices = await DeviceControl.create(backend="memory", cgroups_root=cgroups_root)
            try:
                assert await devices.list_cgroups() == []
                await devices.remove_root()
            finally:
                await devices.close()
    assert report.passed, "\n".join(lines)
    assert report.results and len(report.results) == len(script.steps)
    assert lines[-1].startswith(f"{script.name} on {backend}: ") and lines[-1].endswith("every expectation held")
    if backend != "memory":
        assert not os.path.exists(os.path.join(hierarchy(backend), cgroups_root)), "the run left cgroups behind"


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
    base = hierarchy(backend)
    if base is not None:
        assert not os.path.exists(os.path.join(base, cgroups_root))
