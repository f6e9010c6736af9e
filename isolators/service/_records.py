"""The service's records of its containers, checkpointed in its work dir.

Rules:
- A ``ContainerRecord`` is what the kernel cannot tell after a restart:
  the command, who asked (client PID, uid), the process moved in, whether
  it is an exec container and whether it is being released. The GPUs a
  container holds are the isolator's (recovered from the kernel), never
  taken from here.
- ``RecordsFile`` keeps every record in one JSON file,
  ``<work_dir>/service/containers.json``, written whole and atomically (a
  new temporary file, ``fsync``, ``rename``, ``fsync`` of the directory): a
  reader sees the old file or the new one. A record is written before the
  isolator prepares its container, and again after every change.
- Nothing is followed through a link a user may have planted (SPEC
  R-SC-7; the work dir and its parents are checked at start, ``_trust``):
  the ``service`` directory is opened ``O_NOFOLLOW`` and must be a
  directory owned by the service's user that no one else may write; the
  temporary file is a new one (``O_CREAT|O_EXCL|O_NOFOLLOW``, a name of
  its own) created in that directory by descriptor, and renamed there;
  the records are read ``O_NOFOLLOW`` too. Temporary files a crash left
  are removed when the records are loaded.
- A container belongs to the uid that asked for it when it runs a
  command (an exec container); one without a command, as an agent
  prepares it or as found at start, is root's (``owner``).
- ``recovered_records`` matches the records with what the isolator
  recovered from the kernel: records of vanished cgroups are dropped, a
  cgroup without a record gets one (``recovered``: released only by a
  cleanup).
- A missing file is a first start. Its format version is ``VERSION``
  (release 0.1.0 wrote version 1 too; ``READ_VERSIONS``), read through
  ``actors.file_format.decode_versioned``. A file that is empty, garbled,
  of a version this release does not read, or of another cgroups root
  raises ``UnreadableFile`` (the file and why): it is never read as empty
  here. The service's recovery moves it aside and rebuilds from the
  kernel (``_recovery``). A file that cannot be opened, or a directory
  nobody may trust, raises ``RecordsError`` with what to do.
- ``load``/``write`` block: the service runs them through its executor (one
  writer thread, so writes land in the order they were made).
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import time

import msgspec

from actors.file_format import UnreadableFile, decode_versioned
from runtime import Failure

from .._durable import write_all
from ._messages import ContainerView

logger = logging.getLogger(__name__)

__all__ = ["ContainerRecord", "RecordsFile", "RecordsError", "records_file", "recovered_records"]

VERSION = 1
"""The records' format version this release writes."""
READ_VERSIONS = (1,)
"""The versions it reads (release 0.1.0 wrote version 1)."""


class RecordsError(Failure):
    """The records file cannot be read; the message says what to do."""


class ContainerRecord(msgspec.Struct, kw_only=True):
    container_id: str
    command: list[str] | None = None
    """Set for exec containers (released once empty, see the service's rules)."""
    client: str | None = None
    """The PID of whoever prepared it (``id@host:port``)."""
    uid: int | None = None
    user: str | None = None
    pid: int | None = None
    """The command's process (exec containers)."""
    supervisor: int | None = None
    """The command's supervisor (it lives in the container while the command runs)."""
    since: float = 0.0
    releasing: bool = False
    """Its owner asked for cleanup, or its command ended leaving processes behind: released once none is left."""
    recovered: bool = False
    """Found under the cgroups root at start without a record (an orphan)."""

    @property
    def is_exec(self) -> bool:
        return self.command is not None

    @property
    def owner(self) -> int | None:
        """Whose container it is: an exec container its caller's uid, any other root's (0)."""
        return self.uid if self.is_exec else 0

    def view(self, gpus: list[int], uuids: list[str | None], mig_devices: list[str] | None = None,
             mig_uuids: list[str | None] | None = None) -> ContainerView:
        """The container as ``GET /gpu-isolator/state`` shows it."""
        state = ("releasing" if self.releasing else "recovered" if self.recovered
                 else "running" if self.pid is not None or not self.is_exec else "prepared")
        return ContainerView(gpus=gpus, uuids=uuids, mig_devices=mig_devices or [], mig_uuids=mig_uuids or [],
                             command=self.command, user=self.user, uid=self.uid,
                             client=self.client, pid=self.pid, since=self.since or None, state=state)


def recovered_records(named: dict[str, ContainerRecord], known: dict[str, list[int]]) -> dict[str, ContainerRecord]:
    """After the isolator recovered: the records of the containers it knows
    (``known``: id -> GPUs); records of vanished cgroups are dropped, and a
    container found without a record gets one (``recovered``)."""
    records: dict[str, ContainerRecord] = {}
    for name, record in named.items():
        if name in known:
            records[name] = record
            logger.info("Container %s: recovered with GPUs %s%s", name, known[name],
                        f" running {record.command}" if record.command else "")
        else:
            logger.warning("Container %s: its cgroup is gone; its record is dropped", name)
    for name in sorted(set(known) - set(records)):
        records[name] = ContainerRecord(container_id=name, since=time.time(), recovered=True)
        logger.warning("Container %s: found under the cgroups root without a record; kept with GPUs %s until"
                       " a cleanup", name, known[name])
    return records


class _File(msgspec.Struct):
    version: int
    root: str
    containers: list[ContainerRecord]


_writes = itertools.count()
_encoder = msgspec.json.Encoder()


def records_file(work_dir: str) -> str:
    return os.path.join(work_dir, "service", "containers.json")


class RecordsFile:
    """One records file for the cgroups root ``root`` (see module rules)."""

    def __init__(self, path: str, root: str) -> None:
        self.path = path
        self.root = root

    def _error(self, reason: str) -> RecordsError:
        return RecordsError(
            f"The service's records {self.path} are unreadable: {reason}. They say which containers under"
            f" {self.root} run commands of 'gpu-isolator exec' (released when they end). Restore the file, or"
            " delete it to start afresh: containers still running are then recovered without their"
            " commands and are released only by an explicit cleanup."
        )

    def _directory(self) -> int:
        """The records' directory, opened without following links (see module rules)."""
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, 0o700)
        except FileExistsError:
            pass
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            raise self._error(f"cannot open {directory} ({error.strerror}; a symbolic link is never followed)") from None
        info = os.fstat(fd)
        if info.st_uid not in (0, os.geteuid()) or info.st_mode & 0o022:
            os.close(fd)
            raise self._error(f"{directory} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):04o};"
                              f" it must be owned by root and writable by no one else (chown root {directory};"
                              f" chmod 700 {directory})")
        return fd

    def load(self) -> list[ContainerRecord]:
        """The records (none: a first start); ``UnreadableFile`` or ``RecordsError`` (see module rules)."""
        directory = self._directory()
        name = os.path.basename(self.path)
        try:
            for stale in os.listdir(directory):
                if stale.startswith(name + ".") and stale.endswith(".tmp"):
                    os.unlink(stale, dir_fd=directory)
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            except FileNotFoundError:
                return []
            except OSError as error:
                raise self._error(f"cannot read it ({error.strerror})") from None
            try:
                data = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
            finally:
                os.close(fd)
        finally:
            os.close(directory)
        decoded = decode_versioned(data, _File, self.path, READ_VERSIONS)
        if decoded.root != self.root:
            raise UnreadableFile(self.path, f"it holds the records of the cgroups root {decoded.root!r}, not of"
                                            f" {self.root!r} (the service's cgroups root changed?)")
        return decoded.containers

    def encode(self, records: list[ContainerRecord]) -> bytes:
        """The file's bytes for ``records`` (cheap: encode on the loop, write in a thread)."""
        return _encoder.encode(_File(VERSION, self.root, sorted(records, key=lambda r: r.container_id)))

    def write(self, data: bytes) -> None:
        """Replace the file with ``data``, atomically and durably (see module rules)."""
        directory = self._directory()
        name = os.path.basename(self.path)
        temporary = f"{name}.{os.getpid()}.{next(_writes)}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=directory)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
            os.fsync(directory)
        finally:
            os.close(directory)
