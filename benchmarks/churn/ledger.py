"""The node ledger in the churn benchmark: its directory, its jobs, one lease's cost.

Rules:
- ``node_ledger_dir()`` makes a fresh directory (0700) for one
  repetition's ledger: under ``/dev/shm`` when that is a memory filesystem
  (as ``/run``, the default ledger's home, is on a real node), else under
  the temp dir. ``removed(directory)`` removes it when the block ends.
- ``ledger_jobs(node)``: the executor jobs the node's allocator has run
  for the ledger so far (0 without one).
- ``lease_cost_us(count)``: the file work of one lease taken and returned,
  each alone in its batch (``actors.ledger.LedgerDirectory.apply``: the
  mutex, the read of every lease, the synced write or the removal), in µs,
  the median of ``count`` (200) in a fresh directory. Only public names of
  the project are used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from actors.ledger import Lease, LeaseBatch, LedgerDirectory, TakeRequest

__all__ = ["node_ledger_dir", "removed", "ledger_jobs", "lease_cost_us"]

_SHM = "/dev/shm"


def node_ledger_dir() -> str:
    """A fresh directory for one ledger (see module rules)."""
    parent = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None
    return tempfile.mkdtemp(prefix="gpu-isolator-bench-ledger-", dir=parent)


@contextlib.asynccontextmanager
async def removed(directory: str | None) -> AsyncIterator[None]:
    """Remove ``directory`` (when given) as the block ends."""
    try:
        yield
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


async def ledger_jobs(node: Any) -> int:
    """The node ledger jobs the node's allocator ran so far."""
    state = await node.components.allocator.ledger_state()
    return state.jobs if state is not None else 0


def lease_cost_us(count: int = 200) -> float:
    """µs of file work for one lease taken and returned (see module rules)."""
    directory = node_ledger_dir()
    ledger = LedgerDirectory.open(os.path.join(directory, "ledger"))
    owner = "isolator:/var/lib/gpu-isolator-bench"
    lease = Lease(unit="GPU-00000000-0000-0000-0000-000000000000", owner=owner, holders=("c0-0",), device="195:0")
    take = LeaseBatch(takes=(TakeRequest(leases=(lease,)),))
    give_back = LeaseBatch(returns=(lease.unit,))
    samples = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            ledger.apply(owner, take)
            ledger.apply(owner, give_back)
            samples.append(time.perf_counter() - started)
    finally:
        ledger.close()
        shutil.rmtree(directory, ignore_errors=True)
    return round(statistics.median(samples) * 1e6, 1)
