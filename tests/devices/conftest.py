"""Fixtures for device control tests.

Kernel tests run only as root with the hierarchy present (else they skip
with the reason). Each creates its cgroups under a parent of its own named
``gpu-isolator-test-<pid>-<random>`` and its teardown removes everything,
even when the test failed: probe processes are killed first, v2 programs on
those cgroups are detached (and checked to be freed), then the cgroups are
removed deepest first.
"""

from __future__ import annotations

import errno
import gc
import os
import stat
import subprocess
import sys
import time
import uuid
from typing import Iterator

import pytest

from actors.devices import _bpf

V1_HIERARCHY = "/sys/fs/cgroup/devices"


def v2_hierarchy() -> str | None:
    for candidate in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if os.path.isfile(os.path.join(candidate, "cgroup.controllers")):
            return candidate
    return None


V2_HIERARCHY = v2_hierarchy()

# Device nodes the probes open: major 195 (NVIDIA, no driver here) and the
# unassigned major 240, char and block. Allowed -> ENXIO, denied -> EPERM.
CHAR_NODES = [(195, 0), (195, 1), (195, 2), (195, 3), (195, 255), (240, 0), (240, 1)]
BLOCK_NODES = [(240, 0), (240, 1)]

_PROBE_SCRIPT = r"""
import os, sys
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "exit":
        break
    try:
        if words[0] == "open":
            os.close(os.open(words[1], int(words[2])))
        else:
            path, kind, major, minor = words[1], words[2], int(words[3]), int(words[4])
            mode = (0o20000 if kind == "c" else 0o60000) | 0o600
            os.mknod(path, mode, os.makedev(major, minor))
            os.unlink(path)
        print(0, flush=True)
    except OSError as error:
        print(error.errno, flush=True)
"""


class DeviceProbe:
    """A child process that opens device nodes on request, from inside a cgroup."""

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

    def _ask(self, line: str) -> int:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        """0 when the open succeeded, else its errno."""
        return self._ask(f"open {path} {flags}")

    def mknod(self, directory: str, kind: str, major: int, minor: int) -> int:
        """0 when mknod of a ``kind`` node ``major:minor`` succeeded, else its errno."""
        return self._ask(f"mknod {directory}/mknod-{uuid.uuid4().hex} {kind} {major} {minor}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream:
                stream.close()


class DeviceNodes:
    """mknod'ed nodes in a temporary directory, by (type, major, minor)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.paths: dict[tuple[str, int, int], str] = {}
        for kind, nodes, mode in (("c", CHAR_NODES, stat.S_IFCHR), ("b", BLOCK_NODES, stat.S_IFBLK)):
            for major, minor in nodes:
                path = os.path.join(directory, f"{kind}{major}_{minor}")
                os.mknod(path, mode | 0o666, os.makedev(major, minor))
                self.paths[(kind, major, minor)] = path

    def __getitem__(self, key: tuple[str, int, int]) -> str:
        return self.paths[key]


@pytest.fixture(scope="session")
def device_nodes(tmp_path_factory: pytest.TempPathFactory) -> DeviceNodes:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    return DeviceNodes(str(tmp_path_factory.mktemp("device-nodes")))


def _kill_members(cgroup_dir: str) -> None:
    """Kill processes left in a test cgroup (only test probes can be there)."""
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as procs:
            pids = [int(line) for line in procs if line.strip()]
    except OSError:
        return
    for pid in pids:
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
        except OSError as error:  # a killed probe may take a moment to leave
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            _kill_members(path)
            time.sleep(0.01)


def _detach_all(cgroup_dir: str) -> list[int]:
    """Detach every device program on a test cgroup; their ids."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _flags, ids = _bpf.prog_query(fd)
        for prog_id in ids:
            try:
                prog_fd = _bpf.prog_get_fd_by_id(prog_id)
            except OSError:
                continue
            try:
                _bpf.prog_detach(fd, prog_fd)
            finally:
                os.close(prog_fd)
        return ids
    finally:
        os.close(fd)


def program_exists(prog_id: int) -> bool:
    try:
        fd = _bpf.prog_get_fd_by_id(prog_id)
    except OSError as error:
        if error.errno == errno.ENOENT:
            return False
        raise
    os.close(fd)
    return True


def wait_until_freed(prog_ids: list[int], timeout: float = 5.0) -> list[int]:
    """Wait (bounded) for the kernel to free programs; those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in prog_ids if program_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [p for p in alive if program_exists(p)]
    return alive


class CgroupSandbox:
    """A test parent cgroup (the ``cgroups_root``) and the probes spawned for it."""

    def __init__(self, hierarchy: str, v2: bool) -> None:
        self.hierarchy = hierarchy
        self.v2 = v2
        self.cgroups_root = f"gpu-isolator-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root = os.path.join(hierarchy, self.cgroups_root)
        self.probes: list[DeviceProbe] = []
        self.program_ids: list[int] = []

    def probe(self, cgroup: str | None = None) -> DeviceProbe:
        """A new probe process, moved into ``cgroup`` (relative) when given."""
        probe = DeviceProbe()
        self.probes.append(probe)
        if cgroup is not None:
            probe.move_to(os.path.join(self.root, cgroup))
        return probe

    def attached(self, cgroup: str) -> list[int]:
        """Ids of the device programs attached to ``cgroup``."""
        fd = os.open(os.path.join(self.root, cgroup), os.O_RDONLY | os.O_DIRECTORY)
        try:
            ids = _bpf.prog_query(fd)[1]
        finally:
            os.close(fd)
        self.program_ids.extend(ids)
        return ids

    def teardown(self) -> None:
        for probe in self.probes:
            probe.close()
        if not os.path.isdir(self.root):
            return
        directories = sorted(
            (os.path.join(d, name) for d, subdirs, _ in os.walk(self.root) for name in subdirs),
            key=lambda p: p.count("/"),
            reverse=True,
        ) + [self.root]
        detached: list[int] = []
        for directory in directories:
            _kill_members(directory)
            if self.v2:
                detached += _detach_all(directory)
            _rmdir_retrying(directory)
        if self.v2:
            gc.collect()  # backends that went out of scope close their cached program fds
            alive = wait_until_freed(detached + self.program_ids)
            assert not alive, f"device programs {alive} outlived the test cgroups"


@pytest.fixture
def v1_sandbox() -> Iterator[CgroupSandbox]:
    if os.geteuid() != 0:
        pytest.skip("cgroups v1 kernel tests need root")
    if not os.path.isfile(os.path.join(V1_HIERARCHY, "devices.allow")):
        pytest.skip(f"no cgroups v1 devices hierarchy at {V1_HIERARCHY}")
    sandbox = CgroupSandbox(V1_HIERARCHY, v2=False)
    try:
        yield sandbox
    finally:
        sandbox.teardown()


def _bpf_usable() -> str | None:
    try:
        fd = _bpf.prog_load(bytes.fromhex("b7000000000000009500000000000000"), "gpuiso_probe")
    except OSError as error:
        return f"cannot load a cgroup device program: {error}"
    os.close(fd)
    return None


@pytest.fixture
def v2_sandbox() -> Iterator[CgroupSandbox]:
    if os.geteuid() != 0:
        pytest.skip("cgroups v2 kernel tests need root")
    if V2_HIERARCHY is None:
        pytest.skip("no cgroup2 hierarchy mounted")
    reason = _bpf_usable()
    if reason:
        pytest.skip(reason)
    sandbox = CgroupSandbox(V2_HIERARCHY, v2=True)
    try:
        yield sandbox
    finally:
        sandbox.teardown()
