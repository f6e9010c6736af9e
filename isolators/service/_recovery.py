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
- A records file that cannot be read (``RecordsError``) stops the start:
  the records are never read as empty.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
from typing import Any

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
        loaded = await reader.run(records_io.load)
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
