"""Kernel read-back and drift repair: the kernel is the answer.

Rules (R-DV-5, issue 20 items 2 and 5):
- ``reconcile`` makes every container's kernel device state match its record
  and returns the repairs made (empty when nothing drifted). Each container's
  repair waits behind its earlier calls (its Sequence), so it never races a
  prepare, update or cleanup of it; a cleaned-up container is skipped, never
  recreated. ``flags.reconcile_interval`` runs it periodically on the runtime
  Clock (scheduled at initialize, cancelled at finalize; a failed run keeps
  the schedule).
- No unit goes back to the pool on a guess; the ledger (``_ledger``) says
  why each is not free, and every release goes through it and then
  ``_give_back``. Units whose grant had an unknown outcome (a device-control
  call failed, e.g. a ``WorkerError`` when the device worker died
  mid-batch) are withheld for the container: they go back once the kernel
  is made to match the record (a reconcile succeeded), or once the cgroup's
  state, read back, does not grant them.
- Drift that cannot be repaired is contained and reported: the repair comes
  back as a ``Repair`` with ``failed`` and the reason; when the container
  may reach units beyond its record (the kernel refused to take them back)
  its cgroup may reach any unit (``_reaches_any``: every free unit is taken
  at once and held back, and so is every unit released meanwhile) until a
  reconcile repairs it or it is cleaned up. Programs of others attached
  beside ours (v2) only deny more: reported, nothing held back. Recovery
  does the same.
- A cgroup the isolator could not remove lingers (``_lingering``: why) with
  what it may still reach in the ledger; that goes back once the kernel
  has removed it, or (processes inside: it stays) denies it every unit. A
  later cleanup of that id, a prepare of it or a reconcile tries again.
  One left by a failed prepare may reach any unit (its configure may have
  stopped after the mkdir: v1 then allows what its parent allows, v2 has
  no program): from the failure on, every free unit is held back, and so
  is every unit released while it is there.
- Mixed into the isolator actor (``NvidiaGpuIsolatorProcess``).
"""

from __future__ import annotations

import logging
from typing import Any

from runtime import delay

from actors.devices import ForeignProgramsError

from ._grant import ContainerRecord
from ._ledger import GpuLedger, Reach, Released
from ._metrics import measured
from ._recovery import minors
from ._types import ContainerID, Repair

logger = logging.getLogger(__name__)


class KernelRepair:
    """The isolator actor's reconcile verb and kernel read-backs (see the module rules)."""

    pid: Any
    flags: Any
    infos: dict
    allocator: Any
    devices: Any
    policies: Any
    specs: Any
    ledger: GpuLedger
    _lingering: dict
    catalog: Any
    _metrics: Any
    _stopping: bool
    _reconcile_timer: Any
    _in_order: Any

    def _schedule_reconcile(self) -> None:
        interval = self.flags.reconcile_interval
        if interval is not None and not self._stopping:
            self._reconcile_timer = delay(interval, self.pid, type(self)._periodic_reconcile)

    async def _periodic_reconcile(self) -> None:
        self._reconcile_timer = None
        try:
            repairs = await self.reconcile()
            self.reconcile_runs += 1
            failed = [repair for repair in repairs if repair.failed]
            if len(repairs) > len(failed):
                logger.warning("Periodic reconcile repaired %d drifted device rules", len(repairs) - len(failed))
            if failed:
                logger.error("Periodic reconcile could not repair containers %s",
                             sorted({repair.container_id for repair in failed}))
        except Exception as e:  # keep the schedule: the next run may succeed
            logger.error("Periodic reconcile failed: %s", e)
        finally:
            self._schedule_reconcile()

    async def reconcile(self) -> list[Repair]:
        """R-DV-5: make every container's kernel device state match its record;
        the repairs made (empty when nothing drifted). Each container's repair
        waits behind its earlier calls, so it never races a prepare, update or
        cleanup of it (a cleaned-up container is skipped, never recreated).
        Units withheld for an unknown outcome go back once the kernel matches
        the record; lingering cgroups that may reach units are removed again."""
        runs = [self._in_order(cid, self._reconcile_one, cid) for cid in sorted(self.infos)]
        runs += [self._in_order(cid, self._reconcile_lingering, cid)
                 for cid in sorted(self._lingering) if self.ledger.has(cid)]
        repairs: list[Repair] = []
        failure: Exception | None = None
        for run in runs:  # await every one, so none is left queued (drift not repaired is a failed Repair)
            try:
                repairs += await run
            except Exception as e:
                failure = failure or e
        if failure is not None:
            raise failure
        return repairs

    @measured("reconcile")
    async def _reconcile_one(self, cid: ContainerID) -> list[Repair]:
        info = self.infos.get(cid)
        if info is None or self.ledger.reach(cid) is Reach.UNKNOWN_STATE:
            return []
        lines, failed = await self._enforce_record(info)
        repairs = [Repair(str(cid), line) for line in lines]
        for line in lines:
            logger.warning("Container %s: drift repaired: %s", cid, line)
        if failed is not None:
            self._metrics.repairs.inc(len(repairs))
            return repairs + [failed]
        line = await self.specs.ensure(cid, self.ledger.held(cid))
        if line is not None:
            logger.warning("Container %s: drift repaired: %s", cid, line)
            repairs.append(Repair(str(cid), line))
        released = self.ledger.enforced(cid, self.ledger.held(cid))  # the kernel enforces the record now
        if released.freed or released.held_back:
            await self._give_back(released)
            units = minors(released.freed | released.held_back)
            logger.info("Container %s: GPUs %s, held back while its kernel state was unknown, released", cid, units)
            repairs.append(Repair(str(cid), f"released GPUs {units} held back while its kernel state was unknown"))
        self._metrics.repairs.inc(len(repairs))
        return repairs

    async def _enforce_record(self, info: ContainerRecord) -> tuple[list[str], Repair | None]:
        """Make the kernel enforce ``info``'s record: the repairs made, and the
        repair that failed (None when none did). Drift that cannot be repaired
        (v1: a wiped cgroup whose child keeps the re-deny from the kernel; v2:
        a program of others attached to override ours) may let the container
        reach every unit: it is then held back for it until a reconcile
        repairs it or it is cleaned up. Programs of others attached beside
        ours can only deny more: reported, nothing held back."""
        cid = info.container_id
        try:
            return await self.devices.reconcile(info.cgroup, self.policies.of(self.ledger.held(cid))), None
        except ForeignProgramsError as error:
            reason = str(error)
            logger.error("Container %s: drift not repaired: %s", cid, reason)
            return [], Repair(str(cid), f"could not repair its device rules: {reason}", failed=True, reason=reason)
        except Exception as error:
            reason = "; ".join([str(error), *getattr(error, "__notes__", ())])
            held = await self._reaches_any(cid, Reach.DRIFT)
            contained = (f"GPUs {minors(held)} are held back until it is repaired or cleaned up" if held
                         else "no GPU is free to hold back")
            description = f"could not repair its device rules ({reason}); it may reach any GPU, so {contained}"
            logger.error("Container %s: %s", cid, description)
            return [], Repair(str(cid), description, failed=True, reason=reason)

    async def _reaches_any(self, cid: ContainerID, reach: Reach) -> frozenset:
        """``cid``'s cgroup may reach any unit: tell the ledger, and take every
        free unit at once (one allocator call, before anything else can be
        handed out) to hold back; what is held back now."""
        self.ledger.reaches_any(cid, reach)
        try:
            taken = await self.allocator.take_free()
        except Exception as error:
            logger.error("Container %s: could not hold back the free GPUs (%s)", cid, error)
        else:
            await self._give_back(self.ledger.hold_back(taken))
        return self.ledger.held_back() | self.ledger.withheld(cid)

    async def _give_back(self, released: Released) -> None:
        """Carry out what the ledger let go: ``freed`` back to the allocator;
        ``held_back`` stay while a cgroup may reach any unit (logged)."""
        if released.held_back:
            logger.warning("GPUs %s released stay out of the free pool while the cgroups of %s, which may reach any"
                           " GPU, are not removed or repaired", minors(released.held_back),
                           sorted(str(cid) for cid in self.ledger.reaching()))
        if released.freed:
            await self.allocator.deallocate(released.freed)

    async def _reconcile_lingering(self, cid: ContainerID) -> list[Repair]:
        if cid not in self._lingering or not self.ledger.has(cid):
            return []
        units = minors(self.ledger.held(cid) | self.ledger.withheld(cid))
        gone = await self._settle_lingering(cid)
        line = (f"removed the cgroup '{cid.path()}' left behind; released GPUs {units}" if gone else
                f"denied GPUs {units} to the cgroup '{cid.path()}' left behind (processes inside) and released them")
        return [Repair(str(cid), line)]

    async def _settle_lingering(self, container_id: ContainerID) -> bool:
        """Remove a lingering cgroup; True once it is gone. What it may reach
        goes back only when the kernel has removed it, or (processes inside:
        it stays) denies it every unit; a failure keeps them and is raised."""
        cgroup = container_id.path()
        try:
            removed = await self.devices.remove(cgroup)
            if not removed and self.ledger.has(container_id):
                # Processes inside: take every GPU back from them.
                await self.devices.configure(cgroup, self.policies.of(()))
        except BaseException as error:
            self._lingering[container_id] = f"could not be removed ({error})"
            logger.error("Container %s: cgroup '%s' could not be removed (%s); GPUs %s stay out of the free pool"
                         " until a cleanup or reconcile removes it", container_id, cgroup, error,
                         minors(self.ledger.held(container_id) | self.ledger.withheld(container_id)))
            raise
        released = self.ledger.removed(container_id) if removed else self.ledger.enforced(container_id, ())
        if removed:
            del self._lingering[container_id]
        else:
            self._lingering[container_id] = "still has processes"
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, cgroup, minors(released.freed | released.held_back))
        await self._give_back(released)
        return removed

    async def _settle_withheld(self, info: ContainerRecord) -> None:
        """Give back the withheld units the kernel does not grant: make the
        kernel enforce the record (reconcile) and release them all; failing
        that, read the cgroup's state back and release those it does not
        grant. Whatever cannot be known stays withheld."""
        cid = info.container_id
        withheld = self.ledger.withheld(cid)
        if not withheld:
            return
        try:
            await self.devices.reconcile(info.cgroup, self.policies.of(self.ledger.held(cid)))
            released = self.ledger.enforced(cid, self.ledger.held(cid))
        except Exception as error:
            try:
                state = await self.devices.state(info.cgroup)
            except Exception as again:
                logger.warning("Container %s: GPUs %s stay out of the free pool: the kernel state of cgroup '%s'"
                               " is unknown (%s; %s)", cid, minors(withheld), info.cgroup, error, again)
                return
            if state is None:
                return
            released = self.ledger.not_granted(cid, {unit for unit in withheld if not self.catalog.may_use(state, unit)})
        await self._give_back(released)
        still = self.ledger.withheld(cid)
        if still:
            logger.warning("Container %s: GPUs %s stay out of the free pool: cgroup '%s' may still grant them",
                           cid, minors(still), info.cgroup)
        else:
            logger.info("Container %s: GPUs %s, whose grant had an unknown outcome, are not granted; released",
                        cid, minors(withheld))
