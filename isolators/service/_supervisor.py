"""The supervisor of one exec command: started by the service, inside the container, as root.

Rules (SPEC R-SC-2; Slurm's slurmstepd, systemd-run, conmon):
- The service starts one supervisor per command (``_launcher``), in a
  session of its own, with the launch spec on a pipe, the client's
  connection, the client's stdin/stdout/stderr and a status pipe to the
  service. It never reads anything a client sent except that connection.
- In this order, as root: it writes itself into the container's cgroup
  (``cgroup.procs`` of the v1 devices cgroup or of the v2 unified one) and
  reads ``/proc/self/cgroup`` back (not there: it stops, running
  nothing); it sets ``PR_SET_NO_NEW_PRIVS``; then it forks the command
  through ``subprocess`` (C-level fork and exec): the child, born inside
  the cgroup and without the power to gain privileges, takes the caller's
  supplementary groups, gid and uid, changes to the caller's directory
  as the caller, and execs the command (looked up in the caller's
  ``PATH``) with the caller's environment, in a session and process group
  of its own. So the command's first instruction runs in the cgroup, as
  the caller, unable to become root again through a setuid program.
- It tells the service the command's pid (or why it could not start) on
  the status pipe, then the client ``started`` (or ``exited`` with the
  error: 127 not found, 126 not executable, 125 anything else), and closes
  its copies of the client's stdio.
- While the command runs: ``signal`` frames from the client are sent on
  (``group``: to its process group, as a terminal does); the client's
  connection closing (the client killed, or gone) kills the command's
  process group (SIGKILL). When the command has exited the supervisor
  goes back to the cgroup it came from, asks the service (on its socket,
  as root) to release the container -- so when ``exec`` returns its GPUs
  are free again, unless the command left processes behind -- and then
  tells the client ``exited`` with the command's status (128 + N for
  signal N) and how many processes it left, and exits. A service that
  cannot be reached then (restarting) releases the container itself once
  it is empty.
- It outlives a service restart (the new service finds the container by
  its records and the kernel); being root, the caller can neither ptrace
  nor signal it.
- ``main`` runs in a fresh interpreter (``python -I``): standard library
  and ``_frames`` only.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys

from ._frames import FrameError, FrameReader, encode, received_fds

PR_SET_NO_NEW_PRIVS = 38
SEND_TIMEOUT = 10.0
NOT_FOUND, NOT_EXECUTABLE, NOT_STARTED = 127, 126, 125


def _say(container_id: str, text: str) -> None:
    try:
        os.write(2, f"gpu-isolator supervisor of {container_id}: {text}\n".encode())
    except OSError:
        pass


def exit_status(status: int) -> tuple[int, int | None]:
    """A wait status as a shell reports it, and the signal that ended it (if one did)."""
    code = os.waitstatus_to_exitcode(status)
    return (128 - code, -code) if code < 0 else (code, None)


def join_cgroup(procs: list[str], controller: str, suffix: str) -> None:
    """Write this process into each ``cgroup.procs``, then read the kernel back."""
    for path in procs:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
    with open("/proc/self/cgroup") as lines:
        for line in lines:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            ours = (controller in controllers.split(",")) if controller else (number == "0" and controllers == "")
            if ours:
                if path == suffix or path.endswith(suffix):
                    return
                raise OSError(errno.EPERM, f"the kernel says this process is in {path!r}, not the container")
    raise OSError(errno.ENOENT, "no line of the container's hierarchy in /proc/self/cgroup")


def no_new_privileges() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")


def _send(conn: socket.socket, verb: str, body: dict) -> bool:
    try:
        conn.settimeout(SEND_TIMEOUT)
        conn.sendall(encode(verb, body))
        return True
    except OSError:
        return False
    finally:
        conn.setblocking(False)


def _count_left(procs: list[str]) -> int:
    me = str(os.getpid())
    try:
        with open(procs[-1]) as listed:
            return sum(1 for line in listed if line.strip() and line.strip() != me)
    except OSError:
        return 0


def own_cgroup(controller: str) -> str | None:
    """This process's cgroup on the hierarchy of ``controller`` (``""``: the unified one)."""
    with open("/proc/self/cgroup") as lines:
        for line in lines:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if (controller in controllers.split(",")) if controller else (number == "0" and controllers == ""):
                return path
    return None


def leave(spec: dict, back_to: str | None) -> None:
    """Go back to the cgroup this process came from (best effort: staying only delays the release)."""
    if back_to is None:
        return
    hierarchy = spec["cgroup"][:-len(spec["suffix"])] if spec["cgroup"].endswith(spec["suffix"]) else None
    if hierarchy is None:
        return
    try:
        fd = os.open(os.path.join(hierarchy + back_to, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
    except OSError as error:
        _say(spec["container_id"], f"cannot go back to {back_to}: {error.strerror}; the service releases the"
                                   " container once this supervisor has exited")


def ask_release(spec: dict) -> int | None:
    """Ask the service to release the container now; the processes left in it (None: no answer)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as service:
            service.settimeout(SEND_TIMEOUT)
            service.connect(spec["socket"])
            service.sendall(encode("cleanup", {"request": f"supervisor-{os.getpid()}",
                                               "container_id": spec["container_id"]}))
            reader = FrameReader()
            while True:
                frame = reader.next()
                if frame is not None:
                    break
                data = service.recv(65536)
                if not data:
                    return None
                reader.feed(data)
    except (OSError, FrameError):
        return None
    if frame.verb != "cleaned_up" or frame.body.get("error"):
        return None
    return 0 if frame.body.get("released", True) else int(frame.body.get("processes") or 0)


def start(spec: dict) -> tuple[subprocess.Popen | None, int, str | None]:
    """Join, drop, exec (see module rules): (the command, 0, None) or (None, status, why)."""
    argv, cwd = spec["argv"], spec["cwd"]
    try:
        join_cgroup(spec["procs"], spec["controller"], spec["suffix"])
        no_new_privileges()
    except OSError as error:
        return None, NOT_STARTED, f"cannot enter the container's cgroup: {error.strerror or error}"
    chdir_error = os.pipe()

    def as_the_caller() -> None:  # in the child, after setgroups/setgid/setuid, before exec
        try:
            os.chdir(cwd)
        except OSError as error:
            os.write(chdir_error[1], str(error.errno or 0).encode())
            raise

    try:
        command = subprocess.Popen(
            argv, env=spec["env"], user=spec["uid"], group=spec["gid"], extra_groups=spec["groups"],
            stdin=spec["stdio"][0], stdout=spec["stdio"][1], stderr=spec["stdio"][2], start_new_session=True,
            close_fds=True, restore_signals=True, preexec_fn=as_the_caller)  # close_fds comes after it
    except subprocess.SubprocessError:
        os.close(chdir_error[1])
        code = int(os.read(chdir_error[0], 16) or b"0")
        os.close(chdir_error[0])
        return None, NOT_STARTED, f"cannot change to the directory {cwd!r}: {os.strerror(code)}"
    except OSError as error:
        for fd in chdir_error:
            os.close(fd)
        status = NOT_FOUND if error.errno == errno.ENOENT else NOT_EXECUTABLE
        return None, status, f"cannot run {argv[0]!r}: {error.strerror or error}"
    for fd in chdir_error:
        os.close(fd)
    return command, 0, None


def supervise(spec: dict, conn: socket.socket, command: subprocess.Popen, back_to: str | None) -> int:
    """Forward signals, kill the group when the client goes, report the end (see module rules)."""
    name = spec["container_id"]
    pid = command.pid
    pidfd = os.pidfd_open(pid)
    reader = FrameReader()
    client = True
    conn.setblocking(False)
    while True:
        watched = [pidfd] + ([conn.fileno()] if client else [])
        ready, _, _ = select.select(watched, [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            os.close(pidfd)
            code, signo = exit_status(status)
            leave(spec, back_to)
            left = ask_release(spec)
            if left is None:
                left = _count_left(spec["procs"])
            if client:
                _send(conn, "exited", {"container_id": name, "status": code, "signal": signo, "left": left})
            return code
        try:
            data, ancillary, flags, _ = conn.recvmsg(65536, socket.CMSG_SPACE(16))
            for fd in received_fds(ancillary, flags):
                os.close(fd)
            if not data:
                raise EOFError
            reader.feed(data)
            while (frame := reader.next()) is not None:
                if frame.verb == "signal":
                    signo = frame.body.get("signo")
                    if isinstance(signo, int) and 0 < signo < signal.NSIG:
                        try:
                            (os.killpg if frame.body.get("group") else os.kill)(pid, signo)
                        except ProcessLookupError:
                            pass
        except BlockingIOError:
            continue
        except (EOFError, OSError, FrameError) as why:
            client = False  # gone (killed, or it broke the protocol): the command goes with it
            _say(name, f"its client is gone ({why or 'connection closed'}); killing the command's process group")
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> int:
    with os.fdopen(int(argv[0]), "rb") as source:
        spec = json.loads(source.read())
    conn = socket.socket(fileno=spec["conn"])
    status_fd = spec["status"]
    back_to = own_cgroup(spec["controller"])
    command, code, why = start(spec)
    for fd in spec["stdio"]:
        os.close(fd)
    report = {"pid": command.pid} if command is not None else {"error": why, "status": code}
    try:
        os.write(status_fd, json.dumps(report).encode() + b"\n")
    except OSError:
        pass
    os.close(status_fd)
    if command is None:
        leave(spec, back_to)
        ask_release(spec)
        _send(conn, "exited", {"container_id": spec["container_id"], "status": code, "error": why})
        return code
    _send(conn, "started", {"container_id": spec["container_id"], "pid": command.pid, "cgroup": spec["cgroup"]})
    return supervise(spec, conn, command, back_to)


if __name__ == "__main__":  # pragma: no cover - the launcher runs main() through -c
    sys.exit(main(sys.argv[1:]))
