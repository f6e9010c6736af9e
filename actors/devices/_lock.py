"""The work-directory lock: one agent (and its device worker) per work directory.

Rules:
- Device control holds an exclusive ``flock`` on ``<work_dir>/agent.lock``
  from before it reads or writes any device state until it can no
  longer touch the kernel. Its device worker process inherits the
  descriptor, that is the same open file, so the lock stays held while
  either of them lives: an agent that starts while a stale worker of an
  earlier one could still apply a batch does not get it.
- ``acquire`` waits for the lock up to ``timeout`` seconds (blocking: run it
  in an executor), then refuses with a ``DeviceControlError`` that names the
  directory, the lock file and who holds it, and what to do.
- The holder writes who it is into the file (its process id, then its
  device worker's), so that such an error can say.
- The lock file is opened ``O_NOFOLLOW`` (SPEC R-SC-7): a symbolic link
  planted at its name is refused (ELOOP), never followed to truncate the
  file it names; a name that is not a regular file is refused too.
- ``release()`` closes this process's descriptor (an exiting process's
  closes by itself); a worker that still runs keeps the lock until it exits.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time

from ._errors import DeviceControlError

logger = logging.getLogger(__name__)

LOCK_TIMEOUT = 10.0
"""Seconds a starting agent waits for the work directory's lock by default."""

_POLL = 0.05


def lock_file(work_dir: str) -> str:
    """The lock file of ``work_dir``."""
    return os.path.join(work_dir, "agent.lock")


class WorkDirLock:
    """An exclusive lock on one work directory (see module rules)."""

    def __init__(self, work_dir: str, fd: int) -> None:
        self.work_dir = work_dir
        self.file = lock_file(work_dir)
        self.fd = fd

    @classmethod
    def acquire(cls, work_dir: str, timeout: float = LOCK_TIMEOUT) -> "WorkDirLock":
        """Take the lock, waiting up to ``timeout`` seconds (blocking)."""
        file = lock_file(work_dir)
        try:
            os.makedirs(work_dir, mode=0o700, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK
            fd = os.open(file, flags, 0o600)
        except OSError as error:
            raise DeviceControlError(
                f"Cannot lock the work directory {work_dir}: {file}: {error.strerror}"
                + (" (a symbolic link: the lock is never followed through one; remove it)"
                   if error.errno == errno.ELOOP else "")
            ) from error
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DeviceControlError(f"Cannot lock the work directory {work_dir}: {file} is not a regular file")
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise DeviceControlError(
                            f"Another agent holds the work directory {work_dir}: its lock {file} is held by"
                            f" {_holders(fd)}; waited {timeout:g} s. Stop that agent and its device worker"
                            " before starting another on this work directory, or give this one a work"
                            " directory of its own."
                        ) from None
                    time.sleep(_POLL)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(work_dir, fd)
        lock.record()
        return lock

    def record(self, worker: int | None = None) -> None:
        """Write the holders into the lock file: this process, and its device worker."""
        text = f"agent {os.getpid()}\n" + (f"worker {worker}\n" if worker is not None else "")
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text.encode(), 0)
        except OSError as error:  # the lock holds either way; only the error message would lack names
            logger.warning("Could not record the holders of %s: %s", self.file, error)

    def release(self) -> None:
        """Close this process's descriptor of the lock (see module rules)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _holders(fd: int) -> str:
    """Who the lock file says holds it, and whether each still runs."""
    try:
        text = os.pread(fd, 4096, 0).decode("ascii", "replace")
    except OSError:
        text = ""
    names = {"agent": "agent process", "worker": "its device worker process"}
    found = []
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] in names and words[1].isdigit():
            pid = int(words[1])
            found.append(f"{names[words[0]]} {pid} ({'running' if _running(pid) else 'gone'})")
    return " and ".join(found) if found else "a process that did not record itself"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
