"""Fixtures for the NVIDIA GPU isolator tests.

- ``node`` (parametrized over ``backend``: memory, cgroups_v1, cgroups_v2)
  is a simulated node in ``tmp_path``: a host file, a dev dir, runtime,
  work and volume dirs, and a ``cgroups_root`` of its own named
  ``gpu-isolator-test-<hex>``. ``await node.start()`` builds components and
  an isolator from its flags (call it inside ``async with Runtime():``).
  Kernel backends run only as root with the hierarchy present (else they
  skip with the reason). Teardown removes the whole root, even when the
  test failed: processes still in a test cgroup (only our probes can be
  there) are killed, then the cgroups are removed deepest first; the
  in-memory backend's shared table for the root is dropped.
- ``kernel_node`` is the same over the two kernel backends only.
- ``probes`` spawns ``DeviceProbe`` children (killed at teardown) that open
  device nodes on request from inside a cgroup: allowed -> ENXIO (no
  driver), denied -> EPERM. ``char_nodes`` are mknod'ed 195:0..3 and
  195:255 in a temp directory.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from actors.devices import _bpf
from actors.devices import _memory
from isolators import Flags, NvidiaComponents, NvidiaGpuIsolatorProcess

V1_HIERARCHY = "/sys/fs/cgroup/devices"


def _v2_hierarchy() -> str | None:
    for candidate in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if os.path.isfile(os.path.join(candidate, "cgroup.controllers")):
            return candidate
    return None


V2_HIERARCHY = _v2_hierarchy()
BACKENDS = ["memory", "cgroups_v1", "cgroups_v2"]
KERNEL_BACKENDS = ["cgroups_v1", "cgroups_v2"]


def _bpf_unusable() -> str | None:
    try:
        fd = _bpf.prog_load(bytes.fromhex("b7000000000000009500000000000000"), "gpuiso_probe")
    except OSError as error:
        return f"cannot load a cgroup device program: {error}"
    os.close(fd)
    return None


def skip_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run here (None when it can)."""
    if backend == "memory":
        return None
    if os.geteuid() != 0:
        return f"{backend} kernel tests need root"
    if backend == "cgroups_v1":
        if not os.path.isfile(os.path.join(V1_HIERARCHY, "devices.allow")):
            return f"no cgroups v1 devices hierarchy at {V1_HIERARCHY}"
        return None
    if V2_HIERARCHY is None:
        return "no cgroup2 hierarchy mounted"
    return _bpf_unusable()


def hierarchy_of(backend: str) -> str | None:
    return {"memory": None, "cgroups_v1": V1_HIERARCHY, "cgroups_v2": V2_HIERARCHY}[backend]


def default_host(gpus: int = 4) -> dict[str, Any]:
    """A host file with usage readings per GPU (values derived from the index)."""
    return {
        "driver_version": "550.54.15",
        "gpus": [
            {
                "minor": i,
                "memory_total_mib": 16384,
                "memory_used_mib": 100 * (i + 1),
                "utilization_gpu": 10 + i,
                "utilization_memory": 20 + i,
                "power_mw": 50000 + i,
                "temperature_c": 40 + i,
            }
            for i in range(gpus)
        ],
    }


# -- kernel cleanup -------------------------------------------------------------


def _members(cgroup_dir: str) -> list[int]:
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as procs:
            return [int(line) for line in procs if line.strip()]
    except OSError:
        return []


def _kill_members(cgroup_dir: str) -> None:
    """Kill processes left in a test cgroup (only our probes can be there)."""
    for pid in _members(cgroup_dir):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _rmdir_retrying(path: str) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as error:  # a killed probe takes a moment to leave
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            _kill_members(path)
            time.sleep(0.01)


def remove_cgroup_tree(root: str) -> None:
    """Remove ``root`` and every cgroup below it, killing members first."""
    if not os.path.isdir(root):
        return
    directories = sorted(
        (os.path.join(d, name) for d, subdirs, _ in os.walk(root) for name in subdirs),
        key=lambda p: p.count("/"),
        reverse=True,
    ) + [root]
    for directory in directories:
        _kill_members(directory)
        _rmdir_retrying(directory)


# -- the node --------------------------------------------------------------------


class Node:
    """A simulated node for one test (see the module docstring)."""

    def __init__(self, tmp_path: Any, backend: str) -> None:
        self.backend = backend
        self.hierarchy = hierarchy_of(backend)
        self.tmp = str(tmp_path)
        self.cgroups_root = f"gpu-isolator-test-{uuid.uuid4().hex[:12]}"
        self.dev_dir = os.path.join(self.tmp, "dev")
        self.runtime_dir = os.path.join(self.tmp, "run")
        self.work_dir = os.path.join(self.tmp, "work")
        self.volume_dir = os.path.join(self.tmp, "volume")
        os.makedirs(self.dev_dir, exist_ok=True)
        self.host_file = self.write_host(default_host())
        self.extra: dict[str, Any] = {}

    # files
    def write_host(self, data: dict[str, Any] | None = None, *, toml: str | None = None,
                   name: str = "host.json") -> str:
        """Write a host file (JSON from ``data``, or TOML text) and use it."""
        if toml is not None:
            name = name if name.endswith(".toml") else "host.toml"
            path = os.path.join(self.tmp, name)
            with open(path, "w") as handle:
                handle.write(toml)
        else:
            path = os.path.join(self.tmp, name)
            with open(path, "w") as handle:
                json.dump(data, handle)
        self.host_file = path
        return path

    def flags(self, **changes: Any) -> Flags:
        values: dict[str, Any] = dict(
            host_file=self.host_file,
            dev_dir=self.dev_dir,
            runtime_dir=self.runtime_dir,
            work_dir=self.work_dir,
            volume_dir=self.volume_dir,
            device_backend=self.backend,
            cgroups_hierarchy=self.hierarchy,
            cgroups_root=self.cgroups_root,
            gpu_allocation="lowest",
        )
        values.update(self.extra)
        values.update(changes)
        return Flags(**values)

    async def start(self, **changes: Any) -> tuple[NvidiaComponents, Any]:
        """Components and an isolator for this node (inside a Runtime)."""
        flags = self.flags(**changes)
        components = await NvidiaComponents.create(flags)
        try:
            isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
        except BaseException:
            await components.close()
            raise
        return components, isolator

    @staticmethod
    async def crash(components: NvidiaComponents, isolator: Any) -> None:
        """Drop every actor without cleaning anything up (an agent crash)."""
        await isolator.close()
        await components.close()

    # kernel views
    @property
    def kernel(self) -> bool:
        return self.backend != "memory"

    @property
    def root(self) -> str | None:
        """The absolute cgroup root (kernel backends only)."""
        if self.hierarchy is None:
            return None
        return os.path.join(self.hierarchy, self.cgroups_root)

    def cgroup_dir(self, name: str) -> str:
        assert self.root is not None
        return os.path.join(self.root, name)

    def cgroup_exists(self, name: str) -> bool:
        if self.root is None:
            table = _memory._PRETEND_KERNEL.get(f"memory:/{self.cgroups_root}", {})
            return name in table
        return os.path.isdir(self.cgroup_dir(name))

    def teardown(self) -> None:
        for key in [k for k in _memory._PRETEND_KERNEL if k.endswith("/" + self.cgroups_root)]:
            _memory._PRETEND_KERNEL.pop(key, None)
        if self.root is not None:
            remove_cgroup_tree(self.root)


@pytest.fixture
def node_factory(tmp_path: Any) -> Iterator[Callable[[str], Node]]:
    nodes: list[Node] = []

    def make(backend: str) -> Node:
        reason = skip_reason(backend)
        if reason:
            pytest.skip(reason)
        sub = tmp_path / f"node{len(nodes)}"
        sub.mkdir()
        made = Node(sub, backend)
        nodes.append(made)
        return made

    try:
        yield make
    finally:
        errors = []
        for made in nodes:
            try:
                made.teardown()
            except Exception as error:  # keep tearing down the others
                errors.append(error)
        if errors:
            raise errors[0]


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


# -- device nodes and probes ------------------------------------------------------


def mknod_char(path: str, major: int, minor: int, mode: int = 0o600) -> str:
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    return path


@pytest.fixture
def char_nodes(tmp_path: Any) -> dict[tuple[int, int], str]:
    """mknod'ed char nodes 195:0..3 and 195:255 (nvidiactl), by (major, minor)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = tmp_path / "probe-nodes"
    directory.mkdir()
    nodes = {}
    for major, minor in [(195, 0), (195, 1), (195, 2), (195, 3), (195, 255)]:
        nodes[(major, minor)] = mknod_char(str(directory / f"c{major}_{minor}"), major, minor, 0o666)
    return nodes


_PROBE_SCRIPT = r"""
import os, sys
for line in sys.stdin:
    words = line.split()
    if len(words) != 2:
        break
    try:
        os.close(os.open(words[0], int(words[1])))
        print(0, flush=True)
    except OSError as error:
        print(error.errno, flush=True)
"""


class DeviceProbe:
    """A child process that opens device nodes on request (copied from tests/devices)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-u", "-c", _PROBE_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid

    def move_to(self, cgroup_dir: str) -> None:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(self.pid))

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        """0 when the open succeeded, else its errno."""
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(f"{path} {flags}\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream:
                stream.close()


@pytest.fixture
def probes() -> Iterator[Callable[[], DeviceProbe]]:
    spawned: list[DeviceProbe] = []

    def spawn_probe() -> DeviceProbe:
        probe = DeviceProbe()
        spawned.append(probe)
        return probe

    try:
        yield spawn_probe
    finally:
        for probe in spawned:
            probe.close()
