"""JobOutcomes: what the ledger link learns from each of its jobs, done, failed or cancelled.

Rules (SPEC R-NL-1..3, R-SH-3, R-SH-4; the link's own rules are in ``_ledger_link``):
- Mixed into ``LedgerLink`` (its state is the link's; called only from
  the link's job loop, on the allocator's process).
- ``_done(result, takes)``: a job that ran. ``ours`` becomes exactly what
  the ledger says the owner holds (a lease an earlier job left is adopted
  and returned once unused), a lease file re-taken from the kernel's proof
  is logged with where it was moved, what other owners hold is learnt
  (``_learn``: a change wakes ``since`` waiters and tells the allocator),
  and each take hears its outcome.
- ``_failed(batch, takes, refreshes, error)``: its takes and refreshes
  fail with one ``AllocatorError`` naming the ledger; its returns and
  health report are pending again (``_requeue``: the next job re-reads
  the ledger); the error is logged once while it stays the same, and a
  retry comes after ``RETRY_FIRST`` seconds, doubling up to
  ``RETRY_MOST`` (none once the link is closing).
- ``_cancelled(batch, takes, refreshes)``: a job whose outcome nobody
  will hear (the process terminated) puts all its work back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runtime import Promise, delay

from actors.ledger import BatchResult, Lease, LeaseBatch, LeaseConflict, TakeRequest, TakeResult, blocking
from actors.mig import Unit

from ._errors import AllocatorError

if TYPE_CHECKING:
    from ._process import GpuAllocatorProcess

__all__ = ["JobOutcomes", "OnResult", "RETRY_FIRST", "RETRY_MOST"]

logger = logging.getLogger(__name__)

RETRY_FIRST = 0.1
"""Seconds before the first retry after a failed job (doubling while jobs fail)."""
RETRY_MOST = 5.0
"""The longest wait between two retries of a failing ledger."""


OnResult = Callable[[TakeResult], Any]
"""Called on the allocator with a take's result (or an AllocatorError when its job failed)."""


class JobOutcomes:
    """The ledger link's handling of its jobs' outcomes (see module rules)."""

    def _done(self, result: BatchResult, takes: list[tuple[TakeRequest, OnResult]]) -> None:
        self.returning = set()
        if self.failures:
            logger.warning("Node ledger %s: jobs of %s work again (after %d failed)", self.path, self.owner,
                           self.failures)
            self.failures, self._failure_text = 0, ""
            if self._retry_timer is not None:
                self._retry_timer.cancel()
                self._retry_timer = None
        ours: set[Unit] = set()
        unmanaged: set[str] = set()
        for uuid, lease in result.leases.items():
            if lease.owner != self.owner:
                continue
            unit = self.unit_of.get(uuid)
            if unit is None:
                unmanaged.add(uuid)
                continue
            ours.add(unit)
            self.written[unit] = lease.holders
        for unit in self.ours - ours:
            self.written.pop(unit, None)
            self.idle_since.pop(unit, None)
        allocated = self.allocator.allocated
        for unit in ours - self.ours:  # adopted (a lease an earlier job left): returned once unused
            if unit not in allocated and unit not in self.inherited:
                self.idle_since.setdefault(unit, self.epoch)
        self.ours = ours
        self.ours_unmanaged = unmanaged - set(self.unit_of)
        for uuid, (file, moved, why) in sorted(result.set_aside.items()):
            logger.error("Node ledger %s: the lease file %s could not be read (%s); %s uses unit %s (the kernel"
                         " grants it to its containers), so it took the unit again: the file was moved aside to %s",
                         self.path, file, why, self.owner, uuid, moved)
        self._learn(result.leases, result.alive)
        for (_take, on_result), outcome in zip(takes, result.takes):
            on_result(outcome)
        if self.idle_since or self._rewrites():
            self._wake()

    def _requeue(self, batch: LeaseBatch) -> None:
        """A job that failed or was cancelled: its returns and health report are pending again, and the
        next job reads the ledger (one stopped half-way may have left leases)."""
        self.returning = set()
        self._return_due |= {self.unit_of[uuid] for uuid in batch.returns if uuid in self.unit_of}
        if batch.health is not None and self._health is None:
            self._health = batch.health
            self._reported = {}
        self._reread = True

    def _cancelled(self, batch: LeaseBatch, takes: list[tuple[TakeRequest, OnResult]],
                   refreshes: list[Promise]) -> None:
        """A job whose outcome nobody will hear (cancelled): all its work is pending again."""
        self._requeue(batch)
        self._takes[:0] = takes
        self._refreshes[:0] = refreshes

    def _failed(self, batch: LeaseBatch, takes: list[tuple[TakeRequest, OnResult]], refreshes: list[Promise],
                error: BaseException) -> None:
        self._requeue(batch)
        self.failures += 1
        wait = min(RETRY_FIRST * 2 ** (self.failures - 1), RETRY_MOST)
        key = f"{type(error).__name__} {error.errno}" if isinstance(error, OSError) else str(error)
        if key != self._failure_text:  # the same error again (on another file, say) is not logged again
            self._failure_text = key
            logger.error("Node ledger %s: a job of %s failed: %s (retried in %.1f s, doubling up to %.0f s while"
                         " it fails)", self.path, self.owner, error, wait, RETRY_MOST)
        failure = AllocatorError(f"The node ledger {self.path} could not be changed: {error}")
        failure.__cause__ = error
        for _take, on_result in takes:
            on_result(failure)
        for promise in refreshes:
            promise.fail(failure)
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        self._retry_timer = None if self._closing else delay(wait, self.allocator.pid, _retry)
        self._wake()

    def _learn(self, leases: dict[str, Lease], alive: dict[str, bool]) -> None:
        """What other owners hold, per managed unit."""
        elsewhere: dict[Unit, LeaseConflict] = {}
        for unit, name in self.names.items():
            found = blocking(leases, name.uuid, name.parent, self.owner)
            if found:
                lease = found[0]
                elsewhere[unit] = LeaseConflict(unit=name.uuid, device=name.device, lease=lease,
                                                alive=alive.get(lease.owner))
        if elsewhere != self.elsewhere:
            self.elsewhere = elsewhere
            self.allocator.elsewhere_changed(frozenset(elsewhere))
            self.generation += 1
            waiters, self._waiters = self._waiters, []
            if waiters:
                state = self.state()
                for promise in waiters:
                    promise.set_value(state)


def _retry(process: "GpuAllocatorProcess") -> None:
    link = process.ledger_link
    if link is not None:
        link.retry()
