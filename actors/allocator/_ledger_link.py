"""LedgerLink: the allocator's part that takes and returns its node ledger leases.

Rules (SPEC R-NL-1..3; DESIGN.md "One node, one ledger"):
- Owned by the allocator process once it joins a ledger
  (``GpuAllocatorProcess.join_ledger``), it is the only code that asks the
  node ledger (``actors.ledger.LedgerDirectory``) for anything. Every file
  call runs in the link's own executor (one thread: jobs land in the order
  made), ONE job per batch: the grants, holder changes and returns pending
  when a job starts go together (group commit, as device control's thread
  driver does), never a job per lease.
- Take before any effect: a grant is answered only once the ledger holds
  the owner's lease on each of its units (written and synced). A unit the
  owner leases already (and is not returning) is answered at once, with no
  file work: the owner keeps its lease while it uses the unit again and
  again (container churn costs no ledger work).
- Return after: a unit the allocator got back (``deallocate``, ``let_go``:
  the isolator does so only once the kernel no longer grants it) stays
  leased, with no holder, until a tick finds it unused for a whole
  ``linger`` period (between one and two periods after its last holder let
  it go); that tick's job returns it. Ticks run on the runtime Clock while
  there is something to write. The holders a lease names are written by the
  next job, and by a job of their own at most every ``HOLDER_TICKS`` ticks
  while they change: under churn they lag the allocator by at most 0.2 s
  (one job each 0.2 s, not one each tick).
- Conflicts: a take of a unit another owner holds (or of a MIG device whose
  parent GPU it holds, or a GPU one of whose MIG devices it holds) writes
  nothing of that take, and its ``on_result`` hears the conflicts (the
  allocator then refuses naming unit, owner and holder, or picks other
  units for a count). What other owners hold is ``elsewhere``: kept out of
  the allocator's ``available()`` until a job sees it free (every job reads
  every lease; ``refresh()`` runs one). A change of ``elsewhere`` adds one
  to ``generation`` and answers ``since(generation)`` waiters.
- Crashes (R-NL-3): opening takes the owner's lock (refused while another
  process of that owner runs) and reads the ledger: units the owner leases
  from an earlier life are ``inherited``, out of the allocator's pool until
  the front door has reconciled from its own truth (``reclaim`` keeps those
  its containers hold, and ``hold`` those a plugin's pods or claims hold;
  ``release_unclaimed`` returns the rest, with any unit it leased then that
  this allocator no longer manages, in a job of their own at once: its
  ``returned`` Future is done once that job has run, so a front door's
  recovery answers with them back in the ledger).
- Files nobody can read (SPEC R-SH-3): at open, every lease file the
  ledger cannot read is logged as an ERROR naming it, why, and that its
  unit stays out of everyone's reach; the owner's own health file, if
  unreadable, is moved aside (an ERROR saying where) and its health is
  written again with the next report. Recovery's take is ``proven`` for the
  units the kernel grants its containers: an unreadable lease of such a
  unit is re-taken and its file moved aside, an ERROR naming the file,
  where it went, why, and the unit.
- After every job (its outcome is ``JobOutcomes``'s, in
  ``_ledger_outcomes``), ``ours`` is exactly what the ledger says the owner
  holds: a lease a failed job left behind is adopted (and returned once
  unused), so nothing leaks.
- A job that fails (the ledger unreadable or full, its mutex held past the
  bound) fails the grants in it (nothing was answered; the units go back to
  the allocator's pool) and keeps its returns and holder changes. The link
  then backs off: no job runs until a retry after ``RETRY_FIRST`` seconds,
  doubling up to ``RETRY_MOST`` while jobs keep failing (a grant or a
  refresh asked meanwhile still runs its own job: its caller hears the
  error). The retry re-reads the ledger even with nothing to write, so a
  lease that a job failing half-way left behind is adopted (and returned
  once unused). The error is logged once (again when it changes: another
  errno, another error), and the recovery with how many jobs failed.
- ``close()``: a last job returns every unit leased with no holder (those
  in their linger window too; a lease that job adopts, with no holder, goes
  back in one more), then the owner lock is released. The leases of units
  still held stay (their containers run on; the owner's next start
  reconciles them). The allocator calls it when it leaves the ledger and,
  with ``ended``, from its ``finalize``: a process terminated by leaving
  ``Runtime()`` (R-SH-4) writes its pending returns too. Ended, no job of
  the process runs any more: a job its termination cancelled puts its
  work back (its thread may still finish: the executor's one thread runs
  the last job after it), and takes still pending fail with
  ``ProcessTerminated`` (nobody will use what they would take).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from runtime import Executor, Future, ProcessTerminated, Promise, delay, dispatch

from actors.ledger import (
    Lease,
    LeaseBatch,
    LeaseConflict,
    LedgerDirectory,
    OwnerLock,
    TakeRequest,
    UNREADABLE,
    MAX_HOLDER,
    check_holder,
    check_owner,
    describe_conflicts,
)
from actors.mig import Unit

from ._ledger_outcomes import JobOutcomes, OnResult
from ._ledger_state import LedgerState, UnitName

if TYPE_CHECKING:
    from ._process import GpuAllocatorProcess

__all__ = ["LedgerLink", "LINGER"]

logger = logging.getLogger(__name__)

LINGER = 0.02
"""Seconds a unit stays leased, unused, before it goes back (between one and two of them)."""
HOLDER_TICKS = 10
"""Ticks between jobs that only bring the holders a lease names up to date."""


class LedgerLink(JobOutcomes):
    """The allocator's leases in one node ledger (see module rules)."""

    def __init__(self, allocator: "GpuAllocatorProcess", owner: str, names: dict[Unit, UnitName],
                 linger: float = LINGER) -> None:
        self.allocator = allocator
        self.owner = check_owner(owner)
        self.names = names
        self.unit_of = {name.uuid: unit for unit, name in names.items()}
        self.linger = linger
        self.directory: LedgerDirectory | None = None
        self.path = ""
        self._lock: OwnerLock | None = None
        self._executor = Executor(1, name="node-ledger")
        self.ours: set[Unit] = set()
        """Managed units whose lease names this owner (after the last job)."""
        self.ours_unmanaged: set[str] = set()
        """UUIDs this owner leases that this allocator does not manage (an earlier life's)."""
        self._unmanaged_go = False
        """``release_unclaimed`` ran: ``ours_unmanaged`` go back with the next job."""
        self.written: dict[Unit, tuple[str, ...]] = {}
        """The holders each of ``ours`` names in the ledger."""
        self.holders: dict[Unit, tuple[str, ...]] = {}
        """The holders of each unit the allocator has handed out (what the ledger should say)."""
        self.idle_since: dict[Unit, int] = {}
        """Units of ``ours`` the allocator has back: the tick they went idle in."""
        self.inherited: set[Unit] = set()
        self.returning: set[Unit] = set()
        """Units a job in flight returns."""
        self._return_due: set[Unit] = set()
        self._takes: list[tuple[TakeRequest, OnResult]] = []
        self._refreshes: list[Promise] = []
        self._health: dict[str, str] | None = None
        self._reported: dict[str, str] = {}
        self.elsewhere: dict[Unit, LeaseConflict] = {}
        self.generation = 0
        self._waiters: list[Promise] = []
        self.conflicts = 0
        """Grants refused because another owner held a unit (the allocator counts them)."""
        self.jobs = 0
        """Executor jobs run so far."""
        self.epoch = 0
        self._tick_timer: Any = None
        self._retry_timer: Any = None
        """Set while backing off after a failed job (see module rules)."""
        self.failures = 0
        """Jobs failed in a row (0: the last job worked)."""
        self._failure_text = ""
        self._reread = False
        """A job failed: the next one reads the ledger even with nothing to write."""
        self._running = False
        self._opened = False
        self._closing = False

    # -- opening and closing -------------------------------------------------------
    async def open(self, path: str) -> None:
        """Open the ledger, take the owner's lock, learn what the owner inherits (see module rules)."""
        self.directory, self._lock, leases, health = await self._executor.run(_open, path, self.owner)
        self.path = self.directory.path
        self._opened = True
        allocator = self.allocator
        if health is not None:
            logger.error("Node ledger %s: the health file %s of %s cannot be read (%s): moved aside to %s; the"
                         " health of its units is written again with its next report", self.path, health[0],
                         self.owner, health[2], health[1])
        for uuid, why in sorted(self.directory.unreadable.items()):
            logger.error("Node ledger %s: the lease file %s cannot be read (%s): unit %s stays out of every front"
                         " door's reach until the front door whose containers use it recovers them and re-takes"
                         " it, or an operator removes the file once no container uses the unit", self.path,
                         leases[uuid].owner[len(UNREADABLE):], why, uuid)
        for uuid, lease in leases.items():
            if lease.owner != self.owner:
                continue
            unit = self.unit_of.get(uuid)
            if unit is None:
                self.ours_unmanaged.add(uuid)
                continue
            self.ours.add(unit)
            self.written[unit] = lease.holders
            if unit in allocator.free:
                allocator.free.discard(unit)
                self.inherited.add(unit)
        self._learn(leases, {})
        if self.inherited or self.ours_unmanaged:
            logger.warning("Node ledger %s: %s still leases %s from an earlier run; they stay out of the pool until"
                           " it has recovered its containers", self.path, self.owner,
                           sorted([str(u) for u in self.inherited] + sorted(self.ours_unmanaged)))
        allocated = [unit for unit in allocator.allocated if unit not in self.ours]
        if allocated:  # handed out before the ledger was joined: lease them too
            self.take(allocated, True, self._unleased)
        self._start()

    def _unleased(self, result: Any) -> None:
        if isinstance(result, BaseException) or result.conflicts:
            logger.error("Node ledger %s: units handed out before joining could not all be leased: %s", self.path,
                         result if isinstance(result, BaseException) else
                         describe_conflicts(result.conflicts))

    async def close(self, ended: bool = False) -> None:
        """Return the units no holder has, release the owner lock (see module
        rules); ``ended``: the allocator process has terminated (its finalize)."""
        if self.directory is None or (self._closing and not ended):
            return  # closed already, or never opened; or a close is under way
        self._closing = True
        if self._tick_timer is not None:
            self._tick_timer.cancel()
            self._tick_timer = None
        if ended:  # no job of the process runs any more, nor will a dispatched one
            self._running = False
            self._fail_takes(ProcessTerminated(f"GPU allocator {self.allocator.pid} terminated"))
        if self._opened:
            try:
                while self._running:
                    await self._idle()
                for _round in range(3):  # a lease the last job adopted, unused, goes back in one more
                    due = self._unused()
                    if _round and (not due or self.failures):  # nothing left, or the ledger fails: stop
                        break
                    self._return_due |= due
                    self._running = True
                    await self._run()
            except Exception as error:  # the leases stay: the next start reconciles them
                logger.error("Node ledger %s: could not return the unused units at close: %s", self.path, error)
        self.shutdown()

    def _unused(self) -> set[Unit]:
        """The units this owner leases with no holder (and not inherited)."""
        allocated, inherited = self.allocator.allocated, self.inherited
        return {unit for unit in self.ours if unit not in allocated and unit not in inherited}

    def _fail_takes(self, error: BaseException) -> None:
        takes, self._takes = self._takes, []
        for _take, on_result in takes:
            on_result(error)

    def shutdown(self) -> None:
        """Release the owner lock and the files at once (the process ends)."""
        self._closing = True
        for timer in (self._tick_timer, self._retry_timer):
            if timer is not None:
                timer.cancel()
        self._tick_timer = self._retry_timer = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        self._executor.shutdown(wait=False)
        error = ProcessTerminated(f"GPU allocator {self.allocator.pid} left the node ledger")
        self._fail_takes(error)
        for promise in [*self._refreshes, *self._waiters]:
            promise.fail(error)
        self._refreshes.clear()
        self._waiters.clear()

    async def _idle(self) -> None:
        promise: Promise = Promise()
        self._refreshes.append(promise)
        await promise.future

    # -- grants ----------------------------------------------------------------------
    def grant(self, units: Iterable[Unit], holder: str | None) -> bool:
        """The allocator hands ``units`` to ``holder`` (None: nobody in
        particular); whether the owner leases every one already (and returns
        none of them): then the grant needs no job. An invalid holder raises
        before anything changes. The churn's path: kept short."""
        if holder is None:
            holders: tuple[str, ...] = ()
        elif type(holder) is str and holder.isascii() and holder.isprintable() and 0 < len(holder) <= MAX_HOLDER:
            holders = (holder,)
        else:
            holders = (check_holder(holder),)  # raises, naming it
        covered = self._opened
        ours, returning, mine, idle, due = self.ours, self.returning, self.holders, self.idle_since, self._return_due
        for unit in units:
            mine[unit] = holders
            if idle:
                idle.pop(unit, None)
            if due:
                due.discard(unit)
            if covered and (unit not in ours or unit in returning):
                covered = False
        if self._tick_timer is None:
            self._wake()
        return covered

    def add_holder(self, units: Iterable[Unit], holder: str) -> None:
        """``holder`` shares ``units`` with their other holders (inside this owner)."""
        check_holder(holder)
        for unit in units:
            current = self.holders.get(unit, ())
            if holder not in current:
                self.holders[unit] = (*current, holder)
            self.idle_since.pop(unit, None)
            self._return_due.discard(unit)
        self._wake()

    def remove_holder(self, unit: Unit, holder: str) -> bool:
        """``holder`` lets go of ``unit``; whether no holder is left."""
        left = tuple(h for h in self.holders.get(unit, ()) if h != holder)
        self.holders[unit] = left
        self._wake()
        return not left

    def covered(self, units: Iterable[Unit]) -> bool:
        """Whether every unit is leased to the owner and not being returned (a grant needs no job)."""
        if not self._opened:
            return False
        ours, returning = self.ours, self.returning
        return all(unit in ours and unit not in returning for unit in units)

    def unused(self, units: Iterable[Unit]) -> None:
        """The allocator has ``units`` back: returned once unused for a while."""
        mine, ours, idle, epoch = self.holders, self.ours, self.idle_since, self.epoch
        for unit in units:
            mine.pop(unit, None)
            if unit in ours:
                idle[unit] = epoch
        if self._tick_timer is None:
            self._wake()

    def lease(self, unit: Unit) -> Lease:
        """The lease ``unit`` would be written with now."""
        name = self.names[unit]
        return Lease(unit=name.uuid, owner=self.owner, holders=self.holders.get(unit, ()), parent=name.parent,
                     device=name.device)

    def take(self, units: Iterable[Unit], partial: bool, on_result: OnResult, proven: Iterable[Unit] = ()) -> None:
        """Queue a take of ``units`` (with the holders ``grant`` gave them) for the
        next job; ``on_result`` hears how it went, on the allocator. ``proven``:
        those of them the owner's own truth shows it using (recovery: the
        kernel), whose unreadable leases it re-takes (see module rules)."""
        request = TakeRequest(leases=tuple(self.lease(unit) for unit in sorted(units)), partial=partial,
                              proven=tuple(sorted(self.names[unit].uuid for unit in proven)))
        self._takes.append((request, on_result))
        self._start()

    def refresh(self) -> Future[None]:
        """Read the ledger again now (one job): ``elsewhere`` as it is."""
        promise: Promise = Promise()
        self._refreshes.append(promise)
        self._start()
        return promise.future

    def report_health(self, unhealthy: dict[Unit, str]) -> None:
        """The units this owner holds unhealthy, for the operator's ``ledger`` (written by the next job)."""
        report = {self.names[unit].uuid: reason for unit, reason in unhealthy.items() if unit in self.names}
        if report != self._reported:
            self._health = report
            self._start(urgent=False)

    def blocked(self, unit: Unit) -> LeaseConflict | None:
        """Why another owner keeps ``unit`` from this one (None: nothing known)."""
        return self.elsewhere.get(unit)

    def since(self, generation: int | None) -> Future:
        """A ``LedgerState`` once ``generation`` is not the current one."""
        if generation is None or generation != self.generation:
            return Future.ready(self.state())
        promise: Promise = Promise()
        self._waiters.append(promise)
        promise.on_discard(lambda: self._waiters.remove(promise) if promise in self._waiters else None)
        return promise.future

    def state(self) -> LedgerState:
        return LedgerState(self.path, self.owner, self.generation, dict(self.elsewhere), frozenset(self.inherited),
                           frozenset(self.ours), self.conflicts, self.jobs, self.failures)

    # -- reconciling after a restart -------------------------------------------------
    def reclaimed(self, units: Iterable[Unit]) -> None:
        """Recovery kept ``units`` (inherited ones are no longer inherited)."""
        self.inherited.difference_update(units)

    def release_unclaimed(self) -> tuple[set[Unit], set[str]]:
        """Every inherited unit not reclaimed goes back to the allocator's pool
        and to the ledger (a job at once: ``returned``); the units, and the
        unmanaged UUIDs returned."""
        units, self.inherited = self.inherited, set()
        self.allocator.free.update(units)
        self.unused(units)
        self._return_due |= units
        unmanaged = set(self.ours_unmanaged)
        self._unmanaged_go = True
        if unmanaged:
            logger.warning("Node ledger %s: %s leased %s in an earlier run, which it does not manage now: returned",
                           self.path, self.owner, sorted(unmanaged))
        if units or unmanaged:
            self._start()
        return units, unmanaged

    def returned(self) -> Future[None]:
        """Done once a job that starts from now has run (the returns pending now
        written), or failed (they are retried: see module rules, the error is logged)."""
        promise: Promise = Promise()
        self.refresh().on_any(lambda _: promise.set_value(None))
        return promise.future

    # -- jobs ----------------------------------------------------------------------------
    def _wake(self) -> None:
        """Something will need writing: keep the tick going."""
        if self._tick_timer is None and self._opened and not self._closing:
            self._tick_timer = delay(self.linger, self.allocator.pid, _tick)

    def tick(self) -> None:
        self._tick_timer = None
        self.epoch += 1
        allocated = self.allocator.allocated
        for unit, since in list(self.idle_since.items()):
            if unit not in self.ours:
                del self.idle_since[unit]
            elif unit in allocated or unit in self.inherited:
                continue
            elif since <= self.epoch - 2:
                self._return_due.add(unit)
        holders_due = self.epoch % HOLDER_TICKS == 0 and self._rewrites()
        if self._return_due or holders_due or self._health is not None or (self._unmanaged_go and self.ours_unmanaged):
            self._start(urgent=False)
        if self.idle_since or self._rewrites():
            self._wake()

    def _rewrites(self) -> list[Unit]:
        holders, written = self.holders, self.written
        return [unit for unit in self.ours if holders.get(unit, ()) != written.get(unit, ())]

    def _start(self, urgent: bool = True) -> None:
        """Run the pending work (one job at a time); while backing off after a
        failed job, only ``urgent`` work (a grant, a refresh) starts one."""
        if not urgent and self._retry_timer is not None:
            return
        if not self._running and self._opened and self.directory is not None:
            self._running = True
            dispatch(self.allocator.pid, _run_jobs)

    def retry(self) -> None:
        """The back-off after a failed job is over: run what waits, and re-read the ledger."""
        self._retry_timer = None
        self._start()

    async def _run(self) -> None:
        """Jobs until nothing is pending (one at a time)."""
        try:
            while True:
                batch, takes, refreshes = self._next_batch()
                if batch is None:
                    for promise in refreshes:
                        promise.set_value(None)
                    return
                self.jobs += 1
                try:
                    directory = self.directory
                    assert directory is not None
                    result = await self._executor.run(directory.apply, self.owner, batch)
                except Exception as error:  # noqa: BLE001 - a failed job: see the module rules
                    self._failed(batch, takes, refreshes, error)
                    if self._takes or self._refreshes:  # asked meanwhile: their callers hear how it goes
                        continue
                    return
                except BaseException:  # cancelled (the process terminated): its work waits for close
                    self._cancelled(batch, takes, refreshes)
                    raise
                self._done(result, takes)
                for promise in refreshes:
                    promise.set_value(None)
        finally:
            self._running = False

    def _next_batch(self) -> tuple[LeaseBatch | None, list[tuple[TakeRequest, OnResult]], list[Promise]]:
        takes, self._takes = self._takes, []
        refreshes, self._refreshes = self._refreshes, []
        taken = {lease.unit for take, _ in takes for lease in take.leases}
        due = {unit for unit in self._return_due if unit in self.ours and unit not in self.allocator.allocated
               and unit not in self.inherited}
        rewrites = tuple(self.lease(unit) for unit in self._rewrites()
                         if unit not in due and self.names[unit].uuid not in taken)
        self._return_due = set()
        unmanaged = tuple(sorted(self.ours_unmanaged)) if self._unmanaged_go else ()
        returns = tuple(sorted(self.names[unit].uuid for unit in due)) + unmanaged
        health, self._health = self._health, None
        if health is not None:
            self._reported = health
        batch = LeaseBatch(takes=tuple(take for take, _ in takes), rewrites=rewrites, returns=returns, health=health)
        if batch.empty() and not refreshes and not self._reread:
            return None, [], []
        self._reread = False
        self.returning = due
        return batch, takes, refreshes


def _open(path: str, owner: str) -> tuple[LedgerDirectory, OwnerLock, dict[str, Lease], tuple[str, str, str] | None]:
    """In the executor: open the directory, take the owner's lock, set aside its
    unreadable health file, read every lease."""
    directory = LedgerDirectory.open(path)
    try:
        lock = directory.hold_owner(owner)
        try:
            health = directory.set_aside_own_health(owner)
            return directory, lock, directory.read(), health
        except BaseException:
            lock.release()
            raise
    except BaseException:
        directory.close()
        raise


def _tick(process: "GpuAllocatorProcess") -> None:
    link = process.ledger_link
    if link is not None:
        link.tick()


async def _run_jobs(process: "GpuAllocatorProcess") -> None:
    link = process.ledger_link
    if link is not None:
        await link._run()

