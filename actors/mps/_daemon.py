"""One unit's MPS control daemon, as blocking operations (run them in an Executor).

Rules:
- Facts from NVIDIA's MPS documentation (docs/guides/mps.md cites them):
  ``nvidia-cuda-mps-control -d`` starts the control daemon in the
  background; it reads ``CUDA_MPS_PIPE_DIRECTORY`` (its pipes and sockets,
  and ``nvidia-cuda-mps-control.pid`` with its PID),
  ``CUDA_MPS_LOG_DIRECTORY`` (its ``control.log``) and
  ``CUDA_VISIBLE_DEVICES`` (the devices its servers get; a UUID names one
  without ambiguity) from its environment; the same program run without
  ``-d`` is a client that sends the commands on its stdin to the daemon
  of ``CUDA_MPS_PIPE_DIRECTORY`` and prints the answers.
- ``DaemonPaths.under(runtime_dir, uuid)``: ``<runtime_dir>/mps/<uuid>/pipe``,
  ``.../log`` and ``.../shm`` (the unit's shared memory, which a share's
  containers get at ``/dev/shm``, ``isolators.cdi.mps_edits``).
  ``prepare(paths)`` makes the three: pipe and log 0755 (as NVIDIA's DRA
  driver makes its MPS directories), shm 1777 (sticky and open to all, as
  ``/dev/shm`` is: a container's user of any uid makes its segments
  there) and refuses, naming the path
  and the reason, a directory it cannot make or write, and a pipe
  directory too long for a unix socket (108 bytes with ``/control``).
  Where SELinux is on (``SELINUX_ENFORCE``, selinuxfs' ``enforce`` file,
  exists: enforcing or permissive) the pipe and shm directories are
  labeled ``CONTAINER_FILE_LABEL`` (``security.selinux``), as NVIDIA's
  plugins label their MPS directories: a container's processes may open
  only files of that type, and an unlabeled pipe directory is what most
  often leaves a client "waiting for MPS daemon". A label that cannot be
  set is ``MpsError`` naming the directory.
- ``start(control, paths, uuid, timeout_s, cgroup_procs=())`` runs ``control -d`` with the
  three variables (the unit's UUID alone visible), its stdin /dev/null and
  its output captured, for at most ``timeout_s``. As root it runs in a
  mount namespace of its own (util-linux ``unshare --mount --propagation
  private``) where the unit's shm directory is bound over ``/dev/shm``:
  the daemon, the servers it forks and the share's containers (which get
  the same directory at ``/dev/shm``) share memory there and nowhere else,
  as NVIDIA's DRA driver gives each MPS daemon a tmpfs of its own; and
  first the launcher writes itself into each of ``cgroup_procs`` (the
  daemons' cgroups, ``_cgroup.procs_files``), so the daemon and its servers
  are born out of the front door's cgroup (one it cannot enter fails the
  start naming it, exit 125). Not
  root, it sees the front door's ``/dev/shm`` (and says so in the log):
  without root there is no mount namespace, and no real MPS either
  (compute mode needs root). a non-zero exit, a
  timeout, or no live PID in the pid file within ``timeout_s`` after it is
  ``MpsDaemonFailed`` with the exit and the tail of ``control.log``. What
  a dead daemon left in the pipe directory (its pid file, pipes, sockets,
  lock) is removed first (the caller starts one only when none lives), so
  an old PID is never taken for the new daemon and the new one finds the
  directory as a first start does; the directory itself stays (the
  containers of interrupted shares have it mounted). Returns the daemon's PID (not a child of this
  process: ``-d`` forks it away).
- ``running_pid(paths)``: the PID in the pid file when that process lives
  and is not a zombie (a daemon left by an earlier life of the front door),
  else None. ``running_units(runtime_dir)``: the UUIDs of the units under
  ``<runtime_dir>/mps`` whose pid file names such a process.
- ``send(control, paths, commands, timeout_s)`` runs the client once with
  the commands as its stdin and returns its stdout; a non-zero exit or a
  timeout is ``MpsError`` naming the commands and what the client said.
  ``configure`` sends ``set_*`` commands and treats any answer as a
  refusal (they answer nothing when they are accepted).
- ``wait_gone(pid, timeout_s)`` waits (``poll`` on a pidfd) until the
  process has exited; False when it still runs at the timeout.
- ``log_tail(paths, lines)``: the last lines of ``control.log`` ("" when
  there is none yet).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from ._errors import MpsDaemonFailed, MpsError

__all__ = [
    "DaemonPaths",
    "PID_FILE",
    "CONTROL_LOG",
    "prepare",
    "start",
    "running_pid",
    "running_units",
    "send",
    "configure",
    "wait_gone",
    "log_tail",
]

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_LOG = "control.log"
_SOCKET = "control"
_SUN_PATH_MAX = 108
"""``sizeof(sockaddr_un.sun_path)`` on Linux, the terminating NUL included."""
_TAIL_LINES = 8

logger = logging.getLogger(__name__)


class DaemonPaths(msgspec.Struct, frozen=True):
    """Where one unit's daemon keeps its pipes and its log."""

    root: str
    pipe: str
    log: str
    shm: str

    @classmethod
    def under(cls, runtime_dir: str | os.PathLike[str], uuid: str) -> "DaemonPaths":
        root = os.path.join(os.fspath(runtime_dir), "mps", uuid)
        return cls(root=root, pipe=os.path.join(root, "pipe"), log=os.path.join(root, "log"),
                   shm=os.path.join(root, "shm"))

    @property
    def control_log(self) -> str:
        return os.path.join(self.log, CONTROL_LOG)

    @property
    def pid_file(self) -> str:
        return os.path.join(self.pipe, PID_FILE)


SELINUX_ENFORCE = "/sys/fs/selinux/enforce"
"""selinuxfs' mode file: present where SELinux is on (enforcing or permissive)."""
CONTAINER_FILE_LABEL = "system_u:object_r:container_file_t:s0"
"""The SELinux label of files a container may use (container-selinux's type)."""


def prepare(paths: DaemonPaths) -> None:
    """Make the pipe and log directories (see module rules)."""
    socket = os.path.join(paths.pipe, _SOCKET)
    if len(os.fsencode(socket)) >= _SUN_PATH_MAX:
        raise MpsError(
            f"the MPS pipe directory {paths.pipe} is too long: its socket {socket} needs"
            f" {len(os.fsencode(socket)) + 1} bytes, a unix socket takes {_SUN_PATH_MAX};"
            " give the front door a shorter runtime directory"
        )
    for directory, what in ((paths.pipe, "pipe"), (paths.log, "log"), (paths.shm, "shared-memory")):
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise MpsError(
                f"cannot create the MPS {what} directory {directory}: {exc.strerror or exc};"
                " make the front door's runtime directory writable by it"
            ) from None
        mode = 0o1777 if directory == paths.shm else 0o755  # not left to the umask
        try:
            os.chmod(directory, mode)
        except OSError as exc:
            raise MpsError(f"cannot set the MPS {what} directory {directory} to mode {mode:o}:"
                           f" {exc.strerror or exc}") from None
        probe = os.path.join(directory, ".writable")
        try:
            with open(probe, "w"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise MpsError(
                f"cannot write in the MPS {what} directory {directory}: {exc.strerror or exc};"
                " make the front door's runtime directory writable by it"
            ) from None
    if os.path.exists(SELINUX_ENFORCE):
        for directory in (paths.pipe, paths.shm):
            try:
                os.setxattr(directory, "security.selinux", CONTAINER_FILE_LABEL.encode() + b"\0")
            except OSError as exc:
                raise MpsError(
                    f"cannot label the MPS directory {directory} {CONTAINER_FILE_LABEL} for containers (SELinux is"
                    f" on): {exc.strerror or exc}; containers could not reach the daemon through it"
                ) from None


def _daemon_env(paths: DaemonPaths, uuid: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_MPS_PIPE_DIRECTORY"] = paths.pipe
    env["CUDA_MPS_LOG_DIRECTORY"] = paths.log
    if uuid is not None:
        env["CUDA_VISIBLE_DEVICES"] = uuid
    return env


def log_tail(paths: DaemonPaths, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of the daemon's control.log ("" without one)."""
    try:
        with open(paths.control_log, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            text = handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"(cannot read it: {exc.strerror or exc})"
    return "\n".join(text.splitlines()[-lines:])


def _alive(pid: int) -> bool:
    """The process lives and is not a zombie (a daemon's parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"")


def _read_pid(paths: DaemonPaths) -> int | None:
    try:
        text = Path(paths.pid_file).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def running_pid(paths: DaemonPaths) -> int | None:
    """The PID of a live daemon in the pid file, or None (see module rules)."""
    pid = _read_pid(paths)
    return pid if pid is not None and _alive(pid) else None


def running_units(runtime_dir: str) -> list[str]:
    """The units under ``runtime_dir`` whose daemon runs (see module rules)."""
    try:
        names = sorted(os.listdir(os.path.join(runtime_dir, "mps")))
    except OSError:
        return []
    return [name for name in names if running_pid(DaemonPaths.under(runtime_dir, name)) is not None]


_LAUNCH = r"""
shm=$1; control=$2; shift 2
for procs in "$@"; do
    echo $$ 2>/dev/null >"$procs" || { echo "cannot move the MPS control daemon into the cgroup of $procs" >&2; exit 125; }
done
mount --bind "$shm" /dev/shm && exec "$control" -d
"""
"""The launcher ``unshare`` runs as root: into the daemons' cgroups (``cgroup_procs``), the unit's shm at
``/dev/shm``, then the daemon (see module rules)."""


def start(control: str, paths: DaemonPaths, uuid: str, timeout_s: float, cgroup_procs: Sequence[str] = ()) -> int:
    """Start the unit's daemon with ``control -d``; its PID (see module rules)."""
    for name in os.listdir(paths.pipe):
        stale = os.path.join(paths.pipe, name)
        try:
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale)
            else:
                os.unlink(stale)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise MpsError(f"cannot remove {stale}, left by a dead MPS control daemon: {exc.strerror or exc}") from None
    if shutil.which(control) is None:
        raise MpsError(
            f"cannot run the MPS control program {control!r}: not found or not executable; install the NVIDIA"
            " driver's nvidia-cuda-mps-control or name it with --mps_control=PATH"
        )
    argv = [control, "-d"]
    if os.geteuid() == 0:
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _LAUNCH, "sh", paths.shm,
                shutil.which(control), *cgroup_procs]
    else:
        logger.warning("MPS control daemon of %s: not root, so it shares the front door's /dev/shm"
                       " (no mount namespace of its own)", uuid)
    deadline = time.monotonic() + timeout_s
    try:
        done = subprocess.run(
            argv,
            env=_daemon_env(paths, uuid),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            cwd=paths.root,
        )
    except OSError as exc:
        raise MpsError(f"cannot run {argv[0]!r} to start the MPS control daemon: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise MpsDaemonFailed(uuid, f"did not start: '{control} -d' ran past {timeout_s:g} s", None,
                              log_tail(paths), paths.control_log) from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode("utf-8", "replace").strip()
        what = f"did not start: '{control} -d' exited {_status(done.returncode)}"
        if said:
            what += f" saying {said.splitlines()[-1]!r}"
        raise MpsDaemonFailed(uuid, what, done.returncode, log_tail(paths), paths.control_log)
    while True:
        pid = running_pid(paths)
        if pid is not None:
            return pid
        if time.monotonic() >= deadline:
            raise MpsDaemonFailed(
                uuid, f"did not start: '{control} -d' exited 0 but no live daemon is in {paths.pid_file}"
                f" after {timeout_s:g} s", 0, log_tail(paths), paths.control_log)
        time.sleep(0.005)


def _status(returncode: int) -> str:
    return f"on signal {-returncode}" if returncode < 0 else f"with status {returncode}"


def send(control: str, paths: DaemonPaths, commands: list[str], timeout_s: float) -> str:
    """Send ``commands`` through the client; its stdout (see module rules)."""
    text = "".join(f"{command}\n" for command in commands)
    try:
        done = subprocess.run(
            [control],
            env=_daemon_env(paths, None),
            input=text.encode(),
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise MpsError(f"the MPS control client ran past {timeout_s:g} s sending {commands} to {paths.pipe}") from None
    except OSError as exc:
        raise MpsError(f"cannot run the MPS control program {control!r}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode("utf-8", "replace").strip()
        raise MpsError(
            f"the MPS control client exited {_status(done.returncode)} sending {commands} to {paths.pipe}:"
            f" {said or '(it said nothing)'}"
        )
    return done.stdout.decode("utf-8", "replace")


def configure(control: str, paths: DaemonPaths, commands: list[str], timeout_s: float) -> None:
    """Send ``set_*`` commands; any answer is a refusal (see module rules)."""
    answer = send(control, paths, commands, timeout_s).strip()
    if answer:
        raise MpsError(f"the MPS control daemon of {paths.pipe} refused {commands}: {answer}")


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited; False if it still runs at the timeout."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError as exc:  # pragma: no cover - kernels before 5.3
        if exc.errno != errno.ENOSYS:
            raise
        deadline = time.monotonic() + timeout_s
        while _alive(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))
    finally:
        os.close(fd)
