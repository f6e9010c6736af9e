"""The kernel as tests meet it: hierarchies, skip reasons, teardown, eBPF programs.

Rules:
- Kernel tests run only as root with the hierarchy present; ``skip_reason``
  says why not (for v2 also when no cgroup device program can be loaded).
- Tests create cgroups only under a root of their own and remove it even
  when they fail: ``remove_test_cgroups`` kills what is inside (only test
  probes can be there), detaches v2 programs, and removes the cgroups
  deepest first, waiting (bounded) for killed probes to leave.
- Every eBPF program id a test sees on a test cgroup goes into
  ``SEEN_PROGRAMS``, so a session check can find programs that outlived
  their cgroups.
- A "container" of the test's own, as a runtime makes one: ``in_cgroups(name)``
  is an argv prefix that starts a command in ``<hierarchy>/<name>`` of every
  cgroup hierarchy (made, under a test root), born there;
  ``stop_cgroups(name)`` SIGKILLs every process there, in every hierarchy,
  until none is left (bounded), as a runtime stops a container and the
  kubelet its pod. The caller removes the test root
  (``tests.support.engines.remove_cgroup_trees``).
- ``children()`` are this process's children; ``zombies_left(before)`` the
  zombies among them a test made (not in ``before``), once the bounded wait
  for them to be reaped is over: the session's other work (the image
  build's thread) has children of its own, on their way out at any time.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from actors.devices import Policy, bpf, build_device_program, default_hierarchy, read_policy
from actors.flags import KERNEL_BACKENDS
from actors.flags import NODE_BACKENDS as BACKENDS
from isolators.simulated_node import backend_unavailable, remove_cgroup_tree

NVIDIA = 195

V1_HIERARCHY = default_hierarchy("cgroups_v1")
V2_HIERARCHY = next((h for h in [default_hierarchy("cgroups_v2")]
                     if h is not None and os.path.isfile(os.path.join(h, "cgroup.controllers"))), None)
"""The mounted cgroup2 hierarchy, None when there is none."""

SEEN_PROGRAMS: set[int] = set()
"""Ids of every eBPF program seen attached to a test cgroup."""

_RETURN_ZERO = bytes.fromhex("b7000000000000009500000000000000")  # r0 = 0; exit


def hierarchy_of(backend: str) -> str | None:
    """Where ``backend`` keeps its cgroups (None in memory)."""
    return {"memory": None, "cgroups_v1": V1_HIERARCHY, "cgroups_v2": V2_HIERARCHY}[backend]


def bpf_unusable() -> str | None:
    """Why no cgroup device program can be loaded here; None when one can."""
    try:
        fd = bpf.prog_load(_RETURN_ZERO, "gpuiso_probe")
    except OSError as error:
        return f"cannot load a cgroup device program: {error}"
    os.close(fd)
    return None


def skip_reason(backend: str) -> str | None:
    """Why ``backend`` cannot be tested here (None when it can)."""
    reason = backend_unavailable(backend)
    if reason is None and backend == "cgroups_v2":
        reason = bpf_unusable()
    return reason


def available_backends() -> list[str]:
    return [b for b in BACKENDS if skip_reason(b) is None]


def members(cgroup_dir: str) -> list[int]:
    """The processes in a cgroup ([] when it is gone)."""
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as procs:
            return [int(line) for line in procs if line.strip()]
    except OSError:
        return []


def kill_members(cgroup_dir: str) -> None:
    """SIGKILL the processes in a test cgroup (only test probes can be there)."""
    for pid in members(cgroup_dir):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def attached_programs(cgroup_dir: str) -> list[int]:
    """Ids of the device programs attached to a cgroup (kept in ``SEEN_PROGRAMS``)."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ids = bpf.prog_query(fd)[1]
    finally:
        os.close(fd)
    SEEN_PROGRAMS.update(ids)
    return ids


def program_infos(cgroup_dir: str) -> list[bpf.ProgInfo]:
    """What the kernel says of each device program attached to a cgroup."""
    infos = []
    for prog_id in attached_programs(cgroup_dir):
        fd = bpf.prog_get_fd_by_id(prog_id)
        try:
            infos.append(bpf.prog_info(fd))
        finally:
            os.close(fd)
    return infos


def program_policy(prog_id: int) -> "Policy | None":
    """The policy a device program holds, read back from the kernel: its
    instructions read as a policy, which must compile to the program the
    kernel tagged (else None: not one of ours)."""
    fd = bpf.prog_get_fd_by_id(prog_id)
    try:
        info = bpf.prog_info(fd)
        policy = read_policy(bpf.prog_xlated(fd, info.xlated_len))
    finally:
        os.close(fd)
    if policy is None or info.tag not in bpf.program_tags(build_device_program(policy)):
        return None
    return policy


def attach_program(cgroup_dir: str, code: bytes, name: str, flags: int = bpf.BPF_F_ALLOW_MULTI) -> int:
    """Load ``code`` as a device program called ``name`` and attach it to a
    cgroup with ``flags`` (by default beside what is there:
    ``BPF_F_ALLOW_MULTI``); its id."""
    prog_fd = bpf.prog_load(code, name)
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.prog_attach(fd, prog_fd, flags)
        prog_id = bpf.prog_info(prog_fd).id
    finally:
        os.close(fd)
        os.close(prog_fd)
    SEEN_PROGRAMS.add(prog_id)
    return prog_id


def detach_program(cgroup_dir: str, prog_id: int) -> None:
    """Detach one device program from a cgroup."""
    prog_fd = bpf.prog_get_fd_by_id(prog_id)
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.prog_detach(fd, prog_fd)
    finally:
        os.close(fd)
        os.close(prog_fd)


def detach_programs(cgroup_dir: str) -> list[int]:
    """Detach every device program on a test cgroup; their ids ([] when it is gone)."""
    try:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        ids = bpf.prog_query(fd)[1]
        SEEN_PROGRAMS.update(ids)
        for prog_id in ids:
            try:
                prog_fd = bpf.prog_get_fd_by_id(prog_id)
            except OSError:
                continue
            try:
                bpf.prog_detach(fd, prog_fd)
            except OSError:
                pass
            finally:
                os.close(prog_fd)
        return ids
    finally:
        os.close(fd)


def remove_test_cgroups(root: str, v2: bool) -> list[int]:
    """Remove a test root and everything below it (see module rules); the ids
    of the programs detached on the way."""
    detached: list[int] = []

    def evict(directory: str) -> None:
        kill_members(directory)
        if v2:
            detached.extend(detach_programs(directory))

    remove_cgroup_tree(root, evict, busy_timeout=5.0)
    return detached


def program_exists(prog_id: int) -> bool:
    try:
        fd = bpf.prog_get_fd_by_id(prog_id)
    except OSError as error:
        if error.errno == errno.ENOENT:
            return False
        raise
    os.close(fd)
    return True


def wait_until_freed(prog_ids: list[int], timeout: float = 5.0) -> list[int]:
    """Wait (bounded) for the kernel to free programs (it does so a little
    after their cgroup goes); those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in prog_ids if program_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [p for p in alive if program_exists(p)]
    return alive


def bpf_fds() -> set[str]:
    """The eBPF program fds this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog":
                found.add(fd)
        except OSError:
            pass
    return found


def children(parent: int | None = None, *, zombies: bool = False) -> set[int]:
    """Live (not zombie) child processes of ``parent`` (default: this process);
    with ``zombies``, only those that exited and were never reaped."""
    me = os.getpid() if parent is None else parent
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and (fields[0] == "Z") == zombies:
            found.add(int(entry))
    return found


def zombies_left(before: set[int], timeout: float = 10.0) -> set[int]:
    """This process's zombie children that were not its children at all when ``before`` (``children() |
    children(zombies=True)``) was taken, once none is left or after ``timeout`` (bounded): what a test left
    unreaped, not what other work of the session (the image build's thread, an earlier test's process on its
    way out) has yet to reap."""
    deadline = time.monotonic() + timeout
    while (left := children(zombies=True) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, or going as we read
        return None


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Wait (bounded) until ``pid`` has exited (gone or a zombie); whether it has."""
    deadline = time.monotonic() + timeout
    while process_state(pid) not in (None, "Z"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def wait_blocked_writing_a_pipe(pid: int, timeout: float = 10.0) -> bool:
    """Wait (bounded) until ``pid`` sleeps in the kernel writing to a full pipe
    (``/proc/<pid>/wchan`` is the kernel's pipe-write wait); whether it does.
    A process held there applies nothing more until its pipe is read."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/wchan") as handle:
                if "pipe_write" in handle.read() and process_state(pid) == "S":
                    return True
        except OSError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until the kernel shows it stopped:
    the signal takes effect as the kernel delivers it, not as ``kill`` returns."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while process_state(pid) not in ("T", "t"):
        if time.monotonic() >= deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout:g}s of SIGSTOP")
        time.sleep(0.001)


def in_cgroups(name: str) -> list[str]:
    """An argv prefix that runs a command born in ``<hierarchy>/<name>`` of every hierarchy (see module rules)."""
    from actors.mps._cgroup import procs_files

    return ["sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"', "sh",
            *procs_files(name), "--"]


def stop_cgroups(name: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``<hierarchy>/<name>`` of every hierarchy until none is left (see module rules)."""
    from actors.mps._cgroup import cgroup_mounts

    directories = [os.path.join(mount, name) for mount, _ in cgroup_mounts()]
    deadline = time.monotonic() + timeout
    while any(members(d) for d in directories):
        assert time.monotonic() < deadline, f"processes left in {name} after {timeout} s"
        for directory in directories:
            kill_members(directory)
        time.sleep(0.01)
