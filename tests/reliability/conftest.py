"""The reliability kit (issue 9): simulated nodes, the kernel as judge, probes.

Rules:
- ``kit`` (a fixture) is this module: tests reach ``Node``, ``judge``,
  ``skip_reason`` … through it (test modules cannot import a conftest).
- A ``Node`` is a simulated node in a temp dir (host file, dev, run, work and
  volume dirs) with a cgroups root of its own, ``gpu-isolator-test-rel<pid>-<hex>``.
  Kernel backends run only as root with the hierarchy present. ``teardown()``
  removes the whole root even when the test failed: processes in it (only our
  probes can be there) are killed, v2 programs on it detached, the cgroups
  removed deepest first; the in-memory backend's shared table is dropped.
- ``judge(node)`` reads the KERNEL, not the isolator: v1 ``devices.list`` of
  every cgroup under the root; v2 the programs attached to each cgroup
  (``BPF_PROG_QUERY``: none attached = every device allowed; exactly one of
  ours whose tag is that of the checkpointed policy, else a failure) and the
  checkpoint file; in-memory the shared pretend kernel. Then it checks that
  every GPU is either free in the allocator or granted to exactly one
  container, never both, never two; that the isolator's records, the
  allocator and the kernel agree; that no cgroup exists for a container the
  isolator does not know.
- The session check (autouse) fails when a cgroup root of this session, an
  in-memory table, a child process, an eBPF program seen on a test cgroup, or
  an open eBPF program fd outlives the tests.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import stat
import subprocess
import sys
import time
import uuid
from typing import Any, Iterable, Iterator

import pytest

from actors.devices import (
    PROGRAM_NAME,
    CgroupDeviceAccess,
    CgroupsV1Backend,
    CgroupsV2Backend,
    DeviceControl,
    DeviceRule,
    FaultInjectingBackend,
    MemoryBackend,
    build_device_program,
    checkpoint_file,
)
from actors.devices import _bpf, _memory
from isolators import ContainerID, Flags, NvidiaComponents, NvidiaGpuIsolatorProcess

V1_HIERARCHY = "/sys/fs/cgroup/devices"
V2_HIERARCHY = next(
    (h for h in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified") if os.path.isfile(os.path.join(h, "cgroup.controllers"))),
    None,
)
BACKENDS = ["memory", "cgroups_v1", "cgroups_v2"]
KERNEL_BACKENDS = ["cgroups_v1", "cgroups_v2"]
SESSION_PREFIX = f"gpu-isolator-test-rel{os.getpid()}-"
NVIDIA = 195

SEEN_PROGRAMS: set[int] = set()
"""Ids of every eBPF program the judge saw attached to a test cgroup."""


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


def available_backends() -> list[str]:
    return [b for b in BACKENDS if skip_reason(b) is None]


def hierarchy_of(backend: str) -> str | None:
    return {"memory": None, "cgroups_v1": V1_HIERARCHY, "cgroups_v2": V2_HIERARCHY}[backend]


# -- kernel cleanup ---------------------------------------------------------------


def members(cgroup_dir: str) -> list[int]:
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as procs:
            return [int(line) for line in procs if line.strip()]
    except OSError:
        return []


def _detach_all(cgroup_dir: str) -> None:
    try:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for prog_id in _bpf.prog_query(fd)[1]:
            SEEN_PROGRAMS.add(prog_id)
            try:
                prog_fd = _bpf.prog_get_fd_by_id(prog_id)
            except OSError:
                continue
            try:
                _bpf.prog_detach(fd, prog_fd)
            except OSError:
                pass
            finally:
                os.close(prog_fd)
    finally:
        os.close(fd)


def remove_cgroup_tree(root: str, v2: bool) -> None:
    """Remove ``root`` and every cgroup below it (members killed, programs detached)."""
    if not os.path.isdir(root):
        return
    directories = sorted(
        (os.path.join(d, name) for d, subdirs, _ in os.walk(root) for name in subdirs),
        key=lambda p: p.count("/"),
        reverse=True,
    ) + [root]
    for directory in directories:
        if v2:
            _detach_all(directory)
        deadline = time.monotonic() + 5
        while True:
            for pid in members(directory):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError as error:  # a killed probe takes a moment to leave
                if error.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


# -- the node -------------------------------------------------------------------------


class Node:
    """A simulated node for one test (see the module rules)."""

    def __init__(self, tmp: str, backend: str, gpus: int = 4, **extra: Any) -> None:
        self.backend = backend
        self.hierarchy = hierarchy_of(backend)
        self.tmp = tmp
        self.gpus = gpus
        self.cgroups_root = SESSION_PREFIX + uuid.uuid4().hex[:10]
        self.dev_dir = os.path.join(tmp, "dev")
        self.work_dir = os.path.join(tmp, "work")
        os.makedirs(self.dev_dir, exist_ok=True)
        self.host_file = os.path.join(tmp, "host.json")
        with open(self.host_file, "w") as handle:
            json.dump({"gpu_count": gpus, "driver_version": "550.54.15"}, handle)
        self.extra = extra
        self.components: NvidiaComponents | None = None
        self.isolator: Any = None
        self.fault: FaultInjectingBackend | None = None

    def flags(self, **changes: Any) -> Flags:
        values: dict[str, Any] = dict(
            host_file=self.host_file,
            dev_dir=self.dev_dir,
            runtime_dir=os.path.join(self.tmp, "run"),
            work_dir=self.work_dir,
            volume_dir=os.path.join(self.tmp, "volume"),
            device_backend=self.backend,
            cgroups_hierarchy=self.hierarchy,
            cgroups_root=self.cgroups_root,
            gpu_allocation="lowest",
        )
        values.update(self.extra)
        values.update(changes)
        return Flags(**values)

    @property
    def root(self) -> str:
        """The cgroup root: a directory for kernel backends, the table key in memory."""
        if self.hierarchy is None:
            return f"memory:/{self.cgroups_root}"
        return os.path.join(self.hierarchy, self.cgroups_root)

    def inner_backend(self) -> Any:
        """A fresh device backend for this node's root (to wrap in a fault injector)."""
        if self.backend == "memory":
            return MemoryBackend(self.root, shared=True)
        if self.backend == "cgroups_v1":
            return CgroupsV1Backend(V1_HIERARCHY, self.cgroups_root)
        return CgroupsV2Backend(V2_HIERARCHY, self.cgroups_root, self.work_dir)

    async def start(self, *, fault: dict[str, Any] | None = None, **changes: Any) -> tuple[NvidiaComponents, Any]:
        """Components and an isolator (inside a Runtime). ``fault``: wrap the device
        backend in ``FaultInjectingBackend(**fault)`` (kept as ``self.fault``)."""
        flags = self.flags(**changes)
        components = await NvidiaComponents.create(flags)
        try:
            devices = None
            self.fault = None
            if fault is not None:
                self.fault = FaultInjectingBackend(self.inner_backend(), **fault)
                devices = await DeviceControl.create(backend_impl=self.fault)
            isolator = await NvidiaGpuIsolatorProcess.create(flags, components, devices=devices)
        except BaseException:
            await components.close()
            raise
        self.components, self.isolator = components, isolator
        return components, isolator

    async def stop(self) -> None:
        """Drop every actor, cleaning nothing up (an agent crash or restart)."""
        if self.isolator is not None:
            await self.isolator.close()
        if self.components is not None:
            await self.components.close()
        self.components = self.isolator = None

    async def restart(self, known: Iterable[str], **start: Any) -> tuple[NvidiaComponents, Any]:
        """Drop every actor, rebuild from the same flags, recover ``known`` containers."""
        from isolators import ContainerState

        await self.stop()
        components, isolator = await self.start(**start)
        await isolator.recover([ContainerState(ContainerID(c)) for c in sorted(known)], set())
        return components, isolator

    async def clean_all(self) -> None:
        """Clean up every container the isolator knows and remove the root."""
        if self.isolator is None:
            return
        for cid in sorted(await self.isolator.containers()):
            await self.isolator.cleanup(ContainerID(cid))
        assert await self.isolator.devices.remove_root() is True, "the root still has cgroups"

    def teardown(self) -> None:
        """Remove the root and everything below it, whatever state it is in."""
        teardown_node(self)

    # -- kernel views ---------------------------------------------------------------

    def cgroups(self) -> list[str]:
        """Every cgroup under the root, as the kernel lists it."""
        if self.hierarchy is None:
            return sorted(_memory._PRETEND_KERNEL.get(self.root, {}))
        if not os.path.isdir(self.root):
            return []
        return sorted(
            os.path.relpath(os.path.join(d, name), self.root) for d, subdirs, _ in os.walk(self.root) for name in subdirs
        )

    def cgroup_exists(self, name: str) -> bool:
        return name in self.cgroups()

    def root_exists(self) -> bool:
        if self.hierarchy is None:
            return self.root in _memory._PRETEND_KERNEL
        return os.path.isdir(self.root)

    def checkpoint(self) -> dict[str, CgroupDeviceAccess]:
        """The v2 checkpoint file as written (raw JSON; {} when absent)."""
        try:
            with open(checkpoint_file(self.work_dir), "rb") as handle:
                document = json.loads(handle.read())
        except FileNotFoundError:
            return {}
        return {
            name: CgroupDeviceAccess(
                tuple(DeviceRule.parse(line) for line in entry["allow"]),
                tuple(DeviceRule.parse(line) for line in entry["deny"]),
            )
            for name, entry in document["cgroups"].items()
        }

    def kernel_grants(self) -> dict[str, set[int]]:
        """cgroup -> the minors of this node's GPUs the kernel lets it read and write."""
        minors = range(self.gpus)
        grants: dict[str, set[int]] = {}
        if self.backend == "memory":
            table = _memory._PRETEND_KERNEL.get(self.root, {})
            for name, access in table.items():
                grants[name] = {m for m in minors if access.is_granted("c", NVIDIA, m, "rw")}
            return grants
        if self.backend == "cgroups_v1":
            for name in self.cgroups():
                with open(os.path.join(self.root, name, "devices.list")) as handle:
                    lines = handle.read().split()
                grants[name] = {m for m in minors if _v1_grants(lines, m)}
            return grants
        checkpoint = self.checkpoint()
        for name in self.cgroups():
            path = os.path.join(self.root, name)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _flags, ids = _bpf.prog_query(fd)
            finally:
                os.close(fd)
            SEEN_PROGRAMS.update(ids)
            infos = []
            for prog_id in ids:
                prog_fd = _bpf.prog_get_fd_by_id(prog_id)
                try:
                    infos.append(_bpf.prog_info(prog_fd))
                finally:
                    os.close(prog_fd)
            if not infos:
                grants[name] = set(minors)  # no program: the kernel allows every device
                continue
            own = [info for info in infos if info.name == PROGRAM_NAME]
            assert len(own) == len(infos), f"{path}: foreign device programs attached: {infos}"
            assert len(own) == 1, f"{path}: {len(own)} device programs of ours attached: {own}"
            access = checkpoint.get(name)
            assert access is not None, f"{path}: a program is attached but the checkpoint has no entry"
            assert own[0].tag in _bpf.program_tags(build_device_program(access)), (
                f"{path}: the attached program is not the checkpointed policy {access.lines()}"
            )
            grants[name] = {m for m in minors if access.is_granted("c", NVIDIA, m, "rw")}
        return grants


def _v1_grants(words: list[str], minor: int) -> bool:
    """Whether a devices.list (split in words) lets a process read and write 195:minor."""
    for i in range(0, len(words) - 2, 3):
        kind, numbers, access = words[i : i + 3]
        major_text, minor_text = numbers.split(":")
        if (
            kind in ("a", "c")
            and major_text in ("*", str(NVIDIA))
            and minor_text in ("*", str(minor))
            and "r" in access
            and "w" in access
        ):
            return True
    return False


async def judge(node: Node, model: dict[str, int] | None = None, *, extra_cgroups: Iterable[str] = ()) -> dict[str, list[int]]:
    """Check the invariants with the kernel as judge (see module rules); the
    minors each container holds. ``model``: container -> expected GPU count.
    ``extra_cgroups``: cgroups the isolator may have forgotten on purpose
    (kept because processes were inside): they must grant no GPU."""
    isolator, allocator = node.isolator, node.components.allocator
    grants = node.kernel_grants()
    records = await isolator.containers()
    free = {g.minor for g in await allocator.available()}
    allocated = {g.minor for g in await allocator.allocated()}
    extra = set(extra_cgroups)
    where = f"[{node.backend}] kernel {sorted((k, sorted(v)) for k, v in grants.items())}, records {records}, free {sorted(free)}"
    for minor in range(node.gpus):
        holders = [name for name, minors in grants.items() if minor in minors]
        assert len(holders) <= 1, f"GPU {minor} is granted to {holders}: {where}"
        assert (minor in free) != (minor in allocated), f"GPU {minor} free and allocated: {where}"
        if minor in free:
            assert not holders, f"GPU {minor} is free but granted to {holders}: {where}"
        else:
            assert holders, f"GPU {minor} is allocated but no cgroup is granted it: {where}"
    assert set(grants) - extra == set(records), f"cgroups and records differ: {where}"
    for name in extra & set(grants):
        assert not grants[name], f"forgotten cgroup {name} still grants GPUs: {where}"
    for name, minors in records.items():
        assert set(minors) == grants[name], f"container {name}: record {minors} != kernel: {where}"
    assert allocated == {m for minors in records.values() for m in minors}, f"allocator != records: {where}"
    if node.backend == "cgroups_v2":
        checkpoint = node.checkpoint()
        for name in records:
            assert await isolator.devices.state(name) == checkpoint.get(name), f"{name}: device state != checkpoint"
    if model is not None:
        assert {k: len(v) for k, v in records.items()} == model, f"model {model}: {where}"
    return records


# -- probes (a child process in a cgroup opens device nodes) -----------------------------

_PROBE = r"""
import os, sys
for line in sys.stdin:
    words = line.split()
    if not words:
        break
    try:
        os.close(os.open(words[0], os.O_RDWR))
        print(0, flush=True)
    except OSError as error:
        print(error.errno, flush=True)
"""


class Probe:
    """A child that opens a device node on request: allowed -> ENXIO (no driver), denied -> EPERM."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-u", "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def move_to(self, cgroup_dir: str) -> None:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(self.process.pid))

    def open(self, path: str) -> int:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(path + "\n")
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
def probes() -> Iterator[Any]:
    started: list[Probe] = []

    def spawn() -> Probe:
        probe = Probe()
        started.append(probe)
        return probe

    try:
        yield spawn
    finally:
        for probe in started:
            probe.close()


@pytest.fixture(scope="session")
def gpu_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """mknod'ed char nodes 195:0..3 and 195:255 in a temp dir, by minor (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = str(tmp_path_factory.mktemp("gpu-nodes"))
    nodes = {}
    for minor in (0, 1, 2, 3, 255):
        path = os.path.join(directory, f"nvidia{minor}")
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(NVIDIA, minor))
        nodes[minor] = path
    return nodes


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kit() -> Any:
    return sys.modules[__name__]


@pytest.fixture
def node_factory(tmp_path: Any) -> Iterator[Any]:
    """``make(backend, gpus=4, **flags)`` -> Node; every node is torn down after the test."""
    made: list[Node] = []

    def make(backend: str, gpus: int = 4, **extra: Any) -> Node:
        reason = skip_reason(backend)
        if reason:
            pytest.skip(reason)
        sub = tmp_path / f"node{len(made)}"
        sub.mkdir()
        node = Node(str(sub), backend, gpus, **extra)
        made.append(node)
        return node

    try:
        yield make
    finally:
        for node in made:
            teardown_node(node)


def teardown_node(node: Node) -> None:
    _memory._PRETEND_KERNEL.pop(node.root, None)
    if node.hierarchy is not None:
        remove_cgroup_tree(node.root, v2=node.backend == "cgroups_v2")


# -- nothing left behind ------------------------------------------------------------------


def _bpf_fds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog":
                found.add(fd)
        except OSError:
            pass
    return found


def _children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry))
    return found


def _program_alive(prog_id: int) -> bool:
    try:
        fd = _bpf.prog_get_fd_by_id(prog_id)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.fixture(autouse=True)
def _no_leaked_fds_or_children() -> Iterator[None]:
    children, fds = _children(), _bpf_fds()
    yield
    gc.collect()  # a dropped v2 backend closes its cached program fds when collected
    assert _bpf_fds() <= fds, "eBPF program fds left open by the test"
    assert _children() <= children, "child processes left running by the test"


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    leftovers = [
        os.path.join(h, name)
        for h in (V1_HIERARCHY, V2_HIERARCHY)
        if h and os.path.isdir(h)
        for name in os.listdir(h)
        if name.startswith(SESSION_PREFIX)
    ]
    tables = [key for key in _memory._PRETEND_KERNEL if SESSION_PREFIX in key]
    for path in leftovers:  # clean up anyway, then fail
        remove_cgroup_tree(path, v2=not path.startswith(V1_HIERARCHY))
    for key in tables:
        _memory._PRETEND_KERNEL.pop(key, None)
    gc.collect()
    deadline = time.monotonic() + 5  # the kernel frees a removed cgroup's programs a little later
    alive = [p for p in SEEN_PROGRAMS if _program_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if _program_alive(p)]
    assert not leftovers, f"cgroups left behind: {leftovers}"
    assert not tables, f"in-memory cgroup tables left behind: {tables}"
    assert not alive, f"eBPF programs outlived their test cgroups: {alive}"
