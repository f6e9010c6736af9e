"""``isolators.simulated_node``: the simulated node that tests, message scripts and
the churn benchmark share, and its helpers. Kernel backends run as root with
their hierarchy (else they skip with the reason)."""

from __future__ import annotations

import errno
import json
import os
from typing import Any

import pytest

from actors.devices import MemoryBackend
from actors.volume import DEFAULT_LD_CACHE, read_ld_cache
from isolators import ContainerID, Flags
from isolators.simulated_node import DRIVER_VERSION, SimulatedNode, backend_unavailable, host_document
from isolators.simulated_node import remove_cgroup_tree
from runtime import Runtime
from tests.support.containers import config
from tests.support.kernel import BACKENDS, KERNEL_BACKENDS, hierarchy_of, skip_reason, remove_test_cgroups


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Any:
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


async def running(node: SimulatedNode, **changes: Any) -> Any:
    """The node's files, an isolator on it (lowest-first), recovered empty."""
    await node.setup()
    _components, isolator = await node.start(gpu_allocation="lowest", **changes)
    await isolator.recover([], set())
    return isolator


@pytest.fixture
def made(tmp_path: Any) -> Any:
    """``make(backend, gpus)``: a node in ``tmp_path`` (or ``make(node)``:
    that one); their cgroups are removed whatever happened."""
    nodes: list[SimulatedNode] = []

    def make(backend: str | SimulatedNode, gpus: int = 2) -> SimulatedNode:
        node = backend if isinstance(backend, SimulatedNode) else SimulatedNode(
            tmp_path, backend, gpus=gpus, root_prefix="gpu-isolator-test-sim-")
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        MemoryBackend.drop_shared(node.root)
        if node.backend != "memory":
            remove_test_cgroups(node.root, v2=node.backend == "cgroups_v2")


def test_the_flags_are_the_nodes_paths_then_extra_then_changes(tmp_path: Any) -> None:
    node = SimulatedNode(tmp_path, "memory", gpus=3, cgroups_root="gpu-isolator-test-flags",
                         extra={"gpu-allocation": "lowest", "device_worker": "thread"})
    assert not os.listdir(tmp_path), "construction does no I/O"
    node.create_files()
    with open(node.host_file) as handle:
        assert json.load(handle) == host_document(3) == {"driver_version": DRIVER_VERSION, "gpu_count": 3}
    assert sorted(os.listdir(tmp_path)) == ["dev", "host.json", "ld.so.cache", "proc"]
    assert os.listdir(node.dev_dir) == [] and os.listdir(node.proc_dir) == []
    flags = node.flags(device_worker="process", reconcile_interval="30s")
    assert isinstance(flags, Flags)
    assert (flags.host_file, flags.dev_dir, flags.runtime_dir, flags.work_dir, flags.volume_dir) == (
        str(tmp_path / "host.json"), str(tmp_path / "dev"), str(tmp_path / "run"), str(tmp_path / "work"),
        str(tmp_path / "volume"))
    assert (flags.device_backend, flags.cgroups_hierarchy, flags.cgroups_root) == (
        "memory", None, "gpu-isolator-test-flags")
    assert (flags.gpu_allocation, flags.device_worker, flags.reconcile_interval) == ("lowest", "process", 30.0)
    assert node.root == "memory:/gpu-isolator-test-flags"


@pytest.mark.asyncio
async def test_a_node_reads_no_host_facts_unless_asked(tmp_path: Any) -> None:
    """Its loader cache and proc dir are its own (an empty cache, no ``devices``):
    its volume copies no library of the host (on a GPU host the host's cache
    lists the driver's, 300 MB a volume) and its control devices are never
    judged by the host's /proc/devices; ``extra`` may name the host's on purpose."""
    node = SimulatedNode(tmp_path / "own", "memory", gpus=1).create_files()
    flags = node.flags()
    assert flags.ld_cache == node.ld_cache == str(tmp_path / "own" / "ld.so.cache")
    assert flags.ld_cache != Flags().ld_cache == DEFAULT_LD_CACHE
    assert read_ld_cache(flags.ld_cache) == []
    assert flags.proc_dir == node.proc_dir != Flags().proc_dir and os.listdir(node.proc_dir) == []
    async with Runtime():
        components, _isolator = await node.start()
        try:
            volume = components.volume.host_path
            assert volume.startswith(node.volume_dir)
            assert {d: os.listdir(os.path.join(volume, d)) for d in ("lib", "lib64")} == {"lib": [], "lib64": []}
        finally:
            await node.stop()
    on_purpose = SimulatedNode(tmp_path / "host", "memory", extra={"ld_cache": DEFAULT_LD_CACHE, "proc_dir": "/proc"})
    assert (on_purpose.create_files().flags().ld_cache, on_purpose.flags().proc_dir) == (DEFAULT_LD_CACHE, "/proc")


def test_an_existing_host_file_and_a_fresh_root_of_its_own(tmp_path: Any) -> None:
    host = tmp_path / "mine.toml"
    host.write_text("gpu_count = 2\n")
    first = SimulatedNode(tmp_path / "a", "memory", host=str(host), root_prefix="gpu-isolator-test-pfx-")
    second = SimulatedNode(tmp_path / "b", "memory", host=str(host), root_prefix="gpu-isolator-test-pfx-")
    first.create_files()
    assert first.host_file == str(host) and host.read_text() == "gpu_count = 2\n"
    assert first.cgroups_root.startswith("gpu-isolator-test-pfx-") and first.cgroups_root != second.cgroups_root
    with pytest.raises(ValueError, match="Unknown backend 'zfs'"):
        SimulatedNode(tmp_path, "zfs")


@pytest.mark.asyncio
async def test_async_with_runs_an_isolator_and_leaves_nothing(made: Any) -> None:
    async with Runtime():
        async with SimulatedNode(gpus=2) as node:
            made(node)
            directory = node.tmp
            assert os.path.isdir(directory) and node.isolator is not None
            await node.isolator.prepare(ContainerID("c1"), config(2))
            assert await node.isolator.containers() == {"c1": [0, 1]}
            assert node.cgroups() == ["c1"] and node.root_exists()
        assert node.isolator is None and node.components is None
        assert not os.path.exists(directory), "the temp dir it made is removed"
        assert not node.root_exists() and MemoryBackend.shared_table(node.root) is None


@pytest.mark.asyncio
async def test_restart_recovers_what_the_isolator_held(backend: str, made: Any) -> None:
    node = made(backend, gpus=4)
    async with Runtime():
        isolator = await running(node)
        await isolator.prepare(ContainerID("c1"), config(1))
        await isolator.prepare(ContainerID("c2"), config(2))
        _components, again = await node.restart(gpu_allocation="lowest")
        assert again is node.isolator and again is not isolator
        assert await again.containers() == {"c1": [0], "c2": [1, 2]} and again.recovery_report == []
        free = await node.components.allocator.available()
        assert sorted(g.minor for g in free) == [3]
        _components, third = await node.restart(recover=False, gpu_allocation="lowest")
        assert await third.containers() == {} and node.cgroups() == ["c1", "c2"]
        _components, fourth = await node.restart(["c1", "c2"], gpu_allocation="lowest")
        assert await fourth.containers() == {"c1": [0], "c2": [1, 2]}
        assert await node.clean_all() is True
        assert node.cgroups() == [] and not node.root_exists()
        await node.stop()


@pytest.mark.asyncio
async def test_close_after_a_crash_cleans_up_what_the_kernel_still_holds(backend: str, tmp_path: Any,
                                                                          made: Any) -> None:
    node = made(backend)
    async with Runtime():
        await (await running(node)).prepare(ContainerID("c1"), config(1))
        await node.stop()  # the agent dies; c1's cgroup stays
        assert node.cgroups() == ["c1"] and node.isolator is None
        await node.close()  # starts an isolator, recovers, cleans up, removes the root
    assert not node.root_exists() and node.cgroups() == []
    assert os.path.isdir(tmp_path), "a directory it was given is kept"


@pytest.mark.asyncio
async def test_discard_removes_whatever_is_left(backend: str, made: Any) -> None:
    node = made(backend)
    async with Runtime():
        isolator = await running(node)
        await isolator.prepare(ContainerID("c1"), config(1))
        await isolator.prepare(ContainerID.parse("c1.child"), config(0))
        await node.stop()
    assert node.root_exists()
    node.discard()
    assert not node.root_exists() and node.cgroups() == []
    node.discard()  # nothing left: nothing to do


def test_backend_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_unavailable("memory") is None
    assert backend_unavailable("zfs") == "unknown backend 'zfs' (expected one of memory, cgroups_v1, cgroups_v2)"
    for backend in KERNEL_BACKENDS:
        if os.geteuid() == 0 and hierarchy_of(backend) is not None:
            assert backend_unavailable(backend) is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert backend_unavailable("cgroups_v1") == "cgroups_v1 needs root"
    assert backend_unavailable("memory") is None


def test_remove_cgroup_tree_goes_deepest_first_and_evicts_each(tmp_path: Any) -> None:
    root = tmp_path / "root"
    for sub in ("a/b/c", "a/d", "e"):
        (root / sub).mkdir(parents=True)
    evicted: list[str] = []
    remove_cgroup_tree(str(root), evicted.append)
    assert not root.exists()
    depths = [p.count("/") for p in evicted]
    assert depths == sorted(depths, reverse=True) and evicted[-1] == str(root)
    assert sorted(os.path.relpath(p, tmp_path) for p in evicted) == ["root", "root/a", "root/a/b", "root/a/b/c",
                                                                     "root/a/d", "root/e"]
    remove_cgroup_tree(str(root))  # a missing root: nothing to do


def test_remove_cgroup_tree_retries_busy_then_raises(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "root").mkdir()
    busy = {"left": 3}
    real_rmdir = os.rmdir

    def rmdir(path: str) -> None:
        if busy["left"]:
            busy["left"] -= 1
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        real_rmdir(path)

    monkeypatch.setattr(os, "rmdir", rmdir)
    calls: list[str] = []
    remove_cgroup_tree(str(tmp_path / "root"), calls.append, busy_timeout=5.0)
    assert len(calls) == 4 and not (tmp_path / "root").exists()  # evicted before each try
    (tmp_path / "root").mkdir()
    busy["left"] = 1
    with pytest.raises(OSError) as caught:
        remove_cgroup_tree(str(tmp_path / "root"))  # no time to wait: the first EBUSY is raised
    assert caught.value.errno == errno.EBUSY
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    with pytest.raises(OSError) as caught:
        remove_cgroup_tree(str(tmp_path / "full"), busy_timeout=5.0)
    assert caught.value.errno == errno.ENOTEMPTY
