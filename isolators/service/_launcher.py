"""The command of ``gpu-isolator exec``: forked early, run only once it is inside its cgroup.

Rules:
- ``PendingCommand.fork(argv)`` forks before the client starts any thread
  or event loop. The child blocks the forwarded signals, waits on a pipe
  and never runs the command by itself: the parent moves it into the
  container's cgroup first (through the service), then ``run(env)``
  sends the environment to add, and only then does the child restore
  every signal to its default, unblock them (a signal forwarded meanwhile
  is delivered now, as if the command had got it) and ``execvp`` the
  command. The command therefore never runs outside the cgroup.
- The pipe closing without a word (``abort()``, or the parent killed)
  makes the child exit at once with status 125, running nothing.
- ``run`` returns None when ``execvp`` succeeded (a close-on-exec pipe
  closes), else the ``OSError`` it raised (the child then exits 127 when
  the command was not found, 126 otherwise, as shells do).
- ``wait()`` reaps the child; ``exit_code(status)`` is its exit status, or
  128 + N when a signal N killed it.
- ``SignalForwarder`` blocks ``FORWARDED`` in the client (every thread
  started later inherits the block) and takes them in a thread of its own
  (``sigwaitinfo``). While no command runs, each goes to ``before(signo)``
  (the client gives up); once ``target`` is set it is sent on to the
  command -- except a signal the terminal sent to our process group
  (``SI_KERNEL``, e.g. Ctrl-C): the command, in the same group, got it
  already. ``SIGWINCH`` before the command runs is ignored.
- ``run``, ``wait`` block: the client calls them through its executor.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
from typing import Callable

__all__ = ["FORWARDED", "PendingCommand", "SignalForwarder", "exit_code"]

FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGALRM)
_RESTORED = (*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ)  # Python ignores the last two; a command expects defaults
_SI_KERNEL = 0x80
ABORTED = 125


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class PendingCommand:
    """A forked child that runs ``argv`` only when told to (see module rules)."""

    def __init__(self, pid: int, go: int, exec_error: int, argv: list[str]) -> None:
        self.pid = pid
        self.argv = argv
        self._go = go
        self._exec_error = exec_error
        self.status: int | None = None

    @classmethod
    def fork(cls, argv: list[str]) -> "PendingCommand":
        if not argv:
            raise ValueError("no command to run")
        go_read, go_write = os.pipe()
        error_read, error_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                os.close(go_write)
                os.close(error_read)
                _child(go_read, error_write, argv)
            finally:
                os._exit(ABORTED)
        os.close(go_read)
        os.close(error_write)
        return cls(pid, go_write, error_read, list(argv))

    def run(self, env: dict[str, str]) -> OSError | None:
        """Let the child exec the command with ``env`` added; its exec error, if any."""
        data = json.dumps(env).encode()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._go, view):]
        finally:
            self.abort()
        chunks = []
        while True:
            chunk = os.read(self._exec_error, 64)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._exec_error)
        self._exec_error = -1
        if not chunks:
            return None
        code = int(b"".join(chunks) or b"0")
        return OSError(code, os.strerror(code))

    def abort(self) -> None:
        """Close the pipe: a child not yet told to run exits without running anything."""
        if self._go >= 0:
            os.close(self._go)
            self._go = -1

    def wait(self) -> int:
        """Reap the child (blocking); its wait status."""
        if self.status is None:
            while True:
                try:
                    _, self.status = os.waitpid(self.pid, 0)
                    break
                except InterruptedError:  # pragma: no cover - PEP 475 retries already
                    continue
        return self.status

    def close(self) -> None:
        """Abort if not yet run, close what is left open."""
        self.abort()
        if self._exec_error >= 0:
            os.close(self._exec_error)
            self._exec_error = -1


def _child(go: int, exec_error: int, argv: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    chunks = []
    while True:
        try:
            chunk = os.read(go, 65536)
        except InterruptedError:  # pragma: no cover
            continue
        if not chunk:
            break
        chunks.append(chunk)
    if not chunks:
        os._exit(ABORTED)
    env = json.loads(b"".join(chunks))
    os.environ.update(env)
    for signo in _RESTORED:
        signal.signal(signo, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    try:
        os.execvp(argv[0], argv)
    except OSError as error:
        os.write(exec_error, str(error.errno or 0).encode())
        os._exit(127 if error.errno == errno.ENOENT else 126)


class SignalForwarder:
    """Takes the forwarded signals in a thread (see module rules)."""

    def __init__(self) -> None:
        self.target: int | None = None
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
            signo = info.si_signo
            target = self.target
            if target is not None:
                if info.si_code == _SI_KERNEL and os.getpgid(0) == _pgid(target):
                    continue  # the terminal sent it to the whole group: the command has it
                try:
                    os.kill(target, signo)
                except ProcessLookupError:
                    pass
            elif signo != signal.SIGWINCH and self.before is not None:
                self.before(signo)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
