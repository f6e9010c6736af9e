"""What the service recovers at ``create``, before it serves: its records and the kernel.

Rules (SPEC R-SV-1):
- ``recover(flags, isolator)`` loads the records
  (``<work_dir>/service/containers.json``, ``_records``) in a thread of
  its own; a record whose container id is not one is dropped with a
  warning. The isolator then recovers the containers the records name and
  finds the others under the cgroups root.
- ``recovered_records`` matches the two: records whose cgroup is gone are
  dropped, a container found without a record is kept as ``recovered``
  (root's, released only by ``cleanup``). The service writes what was
  kept once it runs, and releases exec containers once empty (its poll).
- A records file this release cannot read (``UnreadableFile``: truncated,
  garbage, a format version it does not know, another cgroups root) is
  moved aside (``actors.file_format.set_aside``; one that cannot be moved
  is replaced by the next write) and the start goes on with no records: an ERROR names the file, why, where it went and what
  follows -- every container the kernel shows under the cgroups root is
  recovered with the GPUs its cgroup is granted and kept as ``recovered``
  (root's, released only by ``cleanup``), since which ran exec commands is
  not known any more (SPEC R-SH-3: rebuilt from the kernel, never
  crash-looping on a file, no unit in use handed out). A records file that
  cannot be opened at all, or a directory nobody may trust
  (``RecordsError``, R-SC-7), stops the start.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
from typing import Any

from actors.file_format import UnreadableFile, set_aside
from actors.flags import Flags
from runtime import Executor

from .._types import ContainerID, ContainerState
from ._records import ContainerRecord, RecordsFile, records_file, recovered_records

__all__ = ["recover"]

logger = logging.getLogger(__name__)


async def recover(flags: Flags, isolator: Any) -> tuple[dict[str, ContainerRecord], RecordsFile]:
    """The records recovery kept, by container id, and their file (see module rules)."""
    records_io = RecordsFile(records_file(flags.work_dir), isolator.devices.root)
    reader = Executor(1, name="gpu-isolator-records")
    try:
        try:
            loaded = await reader.run(records_io.load)
        except UnreadableFile as error:
            try:
                where = "moved aside to " + await reader.run(set_aside, records_io.path)
            except OSError as failed:  # the first write of the records replaces it
                where = f"it could not be moved aside ({failed.strerror}) and is replaced by the next write"
            logger.error("The service's records %s cannot be read (%s): %s. Every container under the cgroups root"
                         " %s is recovered from the kernel with the GPUs its cgroup is granted, and kept until a"
                         " cleanup (which ran exec commands is not known any more)",
                         records_io.path, error.reason, where, records_io.root)
            loaded = []
    finally:
        reader.shutdown(wait=False)
    states, named = [], {}
    for record in loaded:
        try:
            cid = ContainerID(record.container_id)
        except ValueError as error:
            logger.warning("Record of container %r dropped: %s", record.container_id, error)
            continue
        states.append(ContainerState(cid))
        named[record.container_id] = record
    await isolator.recover(states, set())
    known = await isolator.containers()
    return recovered_records(named, known), records_io
