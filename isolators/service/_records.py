"""The service's records of its containers, checkpointed in its work dir.

Rules:
- A ``ContainerRecord`` is what the kernel cannot tell after a restart:
  the command, who asked (client PID, uid), the process moved in, whether
  it is an exec container and whether it is being released. The GPUs a
  container holds are the isolator's (recovered from the kernel), never
  taken from here.
- ``RecordsFile`` keeps every record in one JSON file,
  ``<work_dir>/service/containers.json``, written whole and atomically (a
  temporary file, ``fsync``, ``rename``, ``fsync`` of the directory): a
  reader sees the old file or the new one. A record is written before the
  isolator prepares its container, and again after every change.
- ``recovered_records`` matches the records with what the isolator
  recovered from the kernel: records of vanished cgroups are dropped, a
  cgroup without a record gets one (``recovered``: released only by a
  cleanup).
- A missing file is a first start. A file that is empty, garbled or of
  another version raises ``RecordsError`` with what to do: it is never read
  as empty, since exec containers would then never be released.
- ``load``/``write`` block: the service runs them through its executor (one
  writer thread, so writes land in the order they were made).
"""

from __future__ import annotations

import logging
import os
import time

import msgspec

from runtime import Failure

from ._messages import ContainerView

logger = logging.getLogger(__name__)

__all__ = ["ContainerRecord", "RecordsFile", "RecordsError", "records_file", "recovered_records"]

VERSION = 1


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
    """The process an exec client moved in."""
    since: float = 0.0
    releasing: bool = False
    """Its sender asked for cleanup or went away: released once no process is left."""
    recovered: bool = False
    """Found under the cgroups root at start without a record (an orphan)."""

    @property
    def is_exec(self) -> bool:
        return self.command is not None

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


_decoder = msgspec.json.Decoder(_File)
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

    def load(self) -> list[ContainerRecord]:
        try:
            with open(self.path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return []
        except OSError as error:
            raise self._error(f"cannot read it ({error.strerror})") from None
        if not data:
            raise self._error("it is empty (truncated)")
        try:
            decoded = _decoder.decode(data)
        except msgspec.DecodeError as error:
            raise self._error(f"{error} (truncated or garbled)") from None
        if decoded.version != VERSION:
            raise self._error(f"unknown version {decoded.version} (this build reads version {VERSION})")
        if decoded.root != self.root:
            raise self._error(f"they belong to the cgroups root {decoded.root!r}, not {self.root!r}")
        return decoded.containers

    def encode(self, records: list[ContainerRecord]) -> bytes:
        """The file's bytes for ``records`` (cheap: encode on the loop, write in a thread)."""
        return _encoder.encode(_File(VERSION, self.root, sorted(records, key=lambda r: r.container_id)))

    def write(self, data: bytes) -> None:
        """Replace the file with ``data``, atomically and durably."""
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        temporary = self.path + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, self.path)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
