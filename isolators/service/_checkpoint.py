"""The service's records, checkpointed in its work dir in the order they change.

Rules:
- The service holds what the kernel cannot tell: a ``ContainerRecord``
  per container (command, owner, the command's process and supervisor),
  by container id; the isolator holds the GPUs. ``Checkpoint.save()``
  writes every record to the records file (``_records.RecordsFile``)
  before the isolator prepares a container and after every change.
- A save is encoded at once (the file holds the records as they were at
  the call), then written by one thread of its own, so writes land in the
  order they were made. It is a Future of whether the write succeeded; a
  failure is logged (a restart may then forget which containers run exec
  commands), never raised.
- The write runs as an event of the service (``actor``), so a save may be
  made where nothing can be awaited (``initialize``).
- Nothing saved is lost when the service stops: ``close()`` (awaited at
  finalize) writes the newest records saved whose write has not landed
  -- its event dropped by the termination, or its job still queued --
  after any write already in its thread, then stops the writer. (Every
  save holds every record, so the newest is all that must land.)
"""

from __future__ import annotations

import logging

from runtime import Executor, Future, Process, defer

from ._records import ContainerRecord, RecordsFile

__all__ = ["Checkpoint"]

logger = logging.getLogger(__name__)


class Checkpoint:
    """Ordered writes of ``records`` to ``file`` (see module rules)."""

    def __init__(self, records: dict[str, ContainerRecord], file: RecordsFile, actor: Process) -> None:
        self.records = records
        self.file = file
        self._actor = actor
        self._writer = Executor(1, name="gpu-isolator-records")
        self._unwritten: bytes | None = None
        """The newest records saved, until a write of them has landed."""

    def save(self) -> Future[bool]:
        """Checkpoint every record (see module rules)."""
        data = self._unwritten = self.file.encode(list(self.records.values()))
        return defer(self._actor.pid, self._write)(data)

    async def _write(self, data: bytes) -> bool:
        if not await self._land(data):
            return False
        if self._unwritten is data:
            self._unwritten = None
        return True

    async def _land(self, data: bytes) -> bool:
        try:
            await self._writer.run(self.file.write, data)
        except Exception as error:
            logger.error("Cannot write the service's records %s: %s; a restart may forget which containers"
                         " run exec commands", self.file.path, error)
            return False
        return True

    async def close(self) -> None:
        """At finalize: the newest records land, then the writer stops (see module rules)."""
        data, self._unwritten = self._unwritten, None
        try:
            if data is not None:
                await self._land(data)
        finally:
            self._writer.shutdown(wait=False)
