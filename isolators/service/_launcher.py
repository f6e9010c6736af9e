"""Starting an exec command's supervisor (the service side), and the client's signals.

Rules:
- ``launch(spec, conn_fd, stdio)`` (blocking: the service's executor)
  starts ``_supervisor`` in a fresh interpreter (``python -I``, a session
  of its own, a minimal environment: nothing of the caller's reaches the
  root process but the spec), hands it the spec on a pipe and the
  client's connection and stdio as inherited descriptors, and waits up to
  ``START_TIMEOUT`` seconds for its first word on the status pipe: the
  command's pid (``Launched.pid``), or why it did not start
  (``Launched.error``, with the exit status the client was told). The
  service closes its own copies of the descriptors afterwards.
- ``Launched.popen`` is the supervisor, a child of the service, which
  reaps it (``Popen.poll`` on every tick). After a restart the service is
  no longer its parent; the supervisor still asks it for the release.
- ``LaunchSpec`` is what the supervisor needs, all checked by the service
  before: the command, environment and directory the client sent, the
  caller's uid, gid and groups (from the kernel), the cgroup to join.
- ``exit_code(status)``: a wait status as a shell reports it.
- ``SignalForwarder`` (the exec client): blocks ``FORWARDED`` in the
  client (threads started later inherit the block) and takes them in a
  thread of its own (``sigwaitinfo``). Until ``forward`` is set each goes
  to ``before(signo)`` (``SIGWINCH`` is dropped then); once it is, to
  ``forward(signo, group)``: ``group`` when the terminal sent it
  (``SI_KERNEL``: Ctrl-C goes to the whole foreground group, so the
  command's whole process group gets it too), else the command alone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgspec

from ._frames import encode

__all__ = ["FORWARDED", "LaunchSpec", "Launched", "SignalForwarder", "exit_code", "launch"]

FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGALRM)
_SI_KERNEL = 0x80
START_TIMEOUT = 30.0
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); from isolators.service._supervisor import main;"
         " sys.exit(main(sys.argv[2:]))")
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class LaunchSpec(msgspec.Struct, kw_only=True):
    container_id: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    groups: list[int]
    procs: list[str]
    """The container's ``cgroup.procs`` file(s) to write the supervisor into."""
    controller: str
    """Which ``/proc/self/cgroup`` line to read back: ``devices`` (v1) or ``""`` (v2)."""
    suffix: str
    """How that line ends inside the container: ``/<cgroups_root>/<id>``."""
    cgroup: str
    """The container's cgroup directory (shown to the client)."""
    socket: str
    """The service's socket: the supervisor asks it to release the container when the command ends."""


class Launched(msgspec.Struct, kw_only=True):
    popen: Any = None
    pid: int | None = None
    """The command's pid."""
    error: str | None = None
    status: int | None = None
    """The exit status the client was told when the command did not start."""


def launch(spec: LaunchSpec, conn_fd: int, stdio: tuple[int, int, int]) -> Launched:
    """Start the supervisor and read its first word (see module rules)."""
    spec_read, spec_write = os.pipe()
    status_read, status_write = os.pipe()
    try:
        data = msgspec.json.encode(spec)
        document = json.loads(data)
        document.update(conn=conn_fd, stdio=list(stdio), status=status_write)
        popen = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, _PACKAGE_PARENT, str(spec_read)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=_ENV, cwd="/", start_new_session=True,
            close_fds=True, pass_fds=(spec_read, status_write, conn_fd, *stdio))
    except OSError as error:
        for fd in (spec_read, spec_write, status_read, status_write):
            os.close(fd)
        why = f"cannot start the command's supervisor: {error.strerror or error}"
        try:
            os.write(conn_fd, encode("exited", {"container_id": spec.container_id, "status": 125, "error": why}))
        except OSError:
            pass
        return Launched(error=why, status=125)
    os.close(spec_read)
    os.close(status_write)
    try:
        with os.fdopen(spec_write, "wb") as sink:
            sink.write(json.dumps(document).encode())
        word = read_line(status_read, START_TIMEOUT)
    except OSError as error:
        word = json.dumps({"error": f"cannot talk to the command's supervisor: {error.strerror}"}).encode()
    finally:
        os.close(status_read)
    try:
        report = json.loads(word)
    except ValueError:
        report = {"error": "the command's supervisor stopped before it said anything (see the service's log)"}
    if report.get("pid"):
        return Launched(popen=popen, pid=int(report["pid"]))
    return Launched(popen=popen, error=str(report.get("error")), status=int(report.get("status") or 125))


def read_line(fd: int, timeout: float) -> bytes:
    """The first line from a pipe, or what came before ``timeout`` / its end."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


class SignalForwarder:
    """Takes the forwarded signals in a thread (see module rules)."""

    def __init__(self) -> None:
        self.forward: Callable[[int, bool], None] | None = None
        self.before: Callable[[int], None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Block the signals (call before any other thread starts) and take them."""
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        self._thread = threading.Thread(target=self._take, name="gpu-isolator-signals", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        while True:
            info = signal.sigwaitinfo(FORWARDED)
            forward = self.forward
            if forward is not None:
                forward(info.si_signo, info.si_code == _SI_KERNEL)
            elif info.si_signo != signal.SIGWINCH and self.before is not None:
                self.before(info.si_signo)
