"""Kernel read-back and drift repair: the kernel is the answer.

Rules (R-DV-5, issue 20 items 2 and 5):
- ``reconcile`` makes every container's kernel device state match its record
  and returns the repairs made (empty when nothing drifted). Each container's
  repair waits behind its earlier calls (its Sequence), so it never races a
  prepare, update or cleanup of it; a cleaned-up container is skipped, never
  recreated. ``flags.reconcile_interval`` runs it periodically on the runtime
  Clock (scheduled at initialize, cancelled at finalize; a failed run keeps
  the schedule).
- No GPU goes back to the pool on a guess. GPUs whose grant had an unknown
  outcome (a device-control call failed, e.g. a ``WorkerError`` when the
  device worker died mid-batch) are ``withheld`` on the container's record:
  they go back once the kernel is made to match the record (a reconcile
  succeeded), or once the cgroup's state, read back, does not grant them.
- Drift that cannot be repaired is contained and reported: the repair comes
  back as a ``Repair`` with ``failed`` and the reason; when the container
  may reach GPUs beyond its record (the kernel refused to take them back),
  every free GPU is held back for it (``withheld``), and every GPU released
  meanwhile (``_give_back``), until a reconcile repairs it or it is cleaned up. Programs of others attached beside ours
  (v2) only deny more: reported, nothing held back. Recovery does the same.
- A cgroup the isolator could not remove lingers (``LingeringCgroup``) with
  the GPUs it may still grant; they go back once the kernel has removed it,
  or (processes inside: it stays) denies them. A later cleanup of that id, a
  prepare of it or a reconcile tries again. One left by a failed prepare
  may grant any GPU (its configure may have stopped after the mkdir: v1
  then allows what its parent allows, v2 has no program): when it cannot
  be removed, every free GPU is held back for it too, until it is -- and
  so is every GPU released while it is there (``_give_back``: a GPU freed
  by another container's cleanup or update stays allocated, held back for
  it, since it may reach that one too).
- Mixed into the isolator actor (``NvidiaGpuIsolatorProcess``).
"""

from __future__ import annotations

import logging
from typing import Any

from runtime import delay

from actors.devices import ForeignProgramsError

from ._grant import ContainerRecord
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
    _lingering: dict
    _mig: bool
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
        GPUs withheld for an unknown outcome go back once the kernel matches
        the record; lingering cgroups that hold GPUs are removed again."""
        runs = [self._in_order(cid, self._reconcile_one, cid) for cid in sorted(self.infos)]
        runs += [self._in_order(cid, self._reconcile_lingering, cid)
                 for cid, lingering in sorted(self._lingering.items())
                 if lingering.withheld or lingering.may_grant_any]
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
        if info is None or info.unknown_state:
            return []
        lines, failed = await self._enforce_record(info)
        repairs = [Repair(str(cid), line) for line in lines]
        for line in lines:
            logger.warning("Container %s: drift repaired: %s", cid, line)
        if failed is not None:
            self._metrics.repairs.inc(len(repairs))
            return repairs + [failed]
        line = await self.specs.ensure(cid, info.allocated)
        if line is not None:
            logger.warning("Container %s: drift repaired: %s", cid, line)
            repairs.append(Repair(str(cid), line))
        info.reaches_any = False  # the kernel enforces the record now
        if info.withheld:  # so they are not granted
            released, info.withheld = info.withheld, set()
            await self._give_back(released)
            logger.info("Container %s: GPUs %s, held back while its kernel state was unknown, released", cid,
                        minors(released))
            repairs.append(Repair(str(cid), f"released GPUs {minors(released)} held back while its kernel state"
                                  " was unknown"))
        self._metrics.repairs.inc(len(repairs))
        return repairs

    async def _enforce_record(self, info: ContainerRecord) -> tuple[list[str], Repair | None]:
        """Make the kernel enforce ``info``'s record: the repairs made, and the
        repair that failed (None when none did). Drift that cannot be repaired
        (v1: a wiped cgroup whose child keeps the re-deny from the kernel; v2:
        a program of others attached to override ours) may let the container
        reach every GPU: every free GPU is then held back for it until a
        reconcile repairs it or it is cleaned up. Programs of others attached
        beside ours can only deny more: reported, nothing held back."""
        cid = info.container_id
        try:
            return await self.devices.reconcile(info.cgroup, self.policies.of(info.allocated)), None
        except ForeignProgramsError as error:
            reason = str(error)
            logger.error("Container %s: drift not repaired: %s", cid, reason)
            return [], Repair(str(cid), f"could not repair its device rules: {reason}", failed=True, reason=reason)
        except Exception as error:
            reason = "; ".join([str(error), *getattr(error, "__notes__", ())])
            held = await self._withhold_reachable(info)
            contained = (f"GPUs {minors(held)} are held back until it is repaired or cleaned up" if held
                         else "no GPU is free to hold back")
            description = f"could not repair its device rules ({reason}); it may reach any GPU, so {contained}"
            logger.error("Container %s: %s", cid, description)
            return [], Repair(str(cid), description, failed=True, reason=reason)

    async def _withhold_reachable(self, info: ContainerRecord) -> set:
        """Hold back every free GPU for ``info`` (it may reach them), and every
        one released while it may; what it holds back."""
        info.reaches_any = True
        info.withheld |= await self._hold_back_free()
        return set(info.withheld)

    async def _give_back(self, units: set) -> None:
        """Return ``units`` to the free pool -- unless a cgroup may reach any
        GPU (a failed prepare's left behind, or a container whose drift could
        not be repaired): then they stay allocated, held back for it, until
        it is removed or repaired."""
        if not units:
            return
        holder = next(((cid, lingering.withheld) for cid, lingering in self._lingering.items()
                       if lingering.may_grant_any), None)
        if holder is None:
            holder = next(((cid, info.withheld) for cid, info in self.infos.items() if info.reaches_any), None)
        if holder is not None:
            cid, withheld = holder
            withheld |= set(units)
            logger.warning("Container %s: GPUs %s released elsewhere stay out of the free pool while its cgroup,"
                           " which may reach any GPU, is not removed or repaired", cid, minors(units))
            return
        await self.allocator.deallocate(units)

    async def _hold_back_free(self) -> set:
        """Allocate every free GPU (for a cgroup that may reach them); the GPUs taken."""
        for _attempt in range(3):
            free = set(await self.allocator.available())
            if not free:
                return set()
            try:
                await self.allocator.allocate(free)
            except Exception:  # another container took one meanwhile: look again
                continue
            return free
        return set()

    async def _reconcile_lingering(self, cid: ContainerID) -> list[Repair]:
        lingering = self._lingering.get(cid)
        if lingering is None or not (lingering.withheld or lingering.may_grant_any):
            return []
        withheld = minors(lingering.withheld)
        gone = await self._settle_lingering(cid)
        line = (f"removed the cgroup '{cid.path()}' left behind; released GPUs {withheld}" if gone else
                f"denied GPUs {withheld} to the cgroup '{cid.path()}' left behind (processes inside) and released them")
        return [Repair(str(cid), line)]

    async def _settle_lingering(self, container_id: ContainerID) -> bool:
        """Remove a lingering cgroup; True once it is gone. The GPUs withheld
        for it go back only when the kernel has removed it, or (processes
        inside: it stays) denies them; a failure keeps them and is raised."""
        lingering = self._lingering[container_id]
        cgroup = container_id.path()
        try:
            removed = await self.devices.remove(cgroup)
            if not removed and (lingering.withheld or lingering.may_grant_any):
                # Processes inside: take every GPU back from them.
                await self.devices.configure(cgroup, self.policies.of(()))
        except BaseException as error:
            lingering.reason = f"could not be removed ({error})"
            if lingering.may_grant_any:  # its state is unknown: it may reach any GPU
                lingering.withheld |= await self._hold_back_free()
            logger.error("Container %s: cgroup '%s' could not be removed (%s); GPUs %s stay out of the free pool"
                         " until a cleanup or reconcile removes it", container_id, cgroup, error,
                         minors(lingering.withheld))
            raise
        released, lingering.withheld = lingering.withheld, set()
        lingering.may_grant_any = False
        if removed:
            del self._lingering[container_id]
        else:
            lingering.reason = "still has processes"
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, cgroup, minors(released))
        await self._give_back(released)
        return removed

    async def _settle_withheld(self, info: ContainerRecord) -> None:
        """Give back the withheld GPUs the kernel does not grant: make the
        kernel enforce the record (reconcile) and release them all; failing
        that, read the cgroup's state back and release those it does not
        grant. Whatever cannot be known stays withheld."""
        withheld = set(info.withheld)
        if not withheld:
            return
        try:
            await self.devices.reconcile(info.cgroup, self.policies.of(info.allocated))
            released = withheld
        except Exception as error:
            try:
                state = await self.devices.state(info.cgroup)
            except Exception as again:
                logger.warning("Container %s: GPUs %s stay out of the free pool: the kernel state of cgroup '%s'"
                               " is unknown (%s; %s)", info.container_id, minors(withheld), info.cgroup, error, again)
                return
            if state is None:
                released = set()
            elif self._mig:
                released = {unit for unit in withheld if not self.catalog.may_use(state, unit)}
            else:
                released = {g for g in withheld if not state.is_granted("c", g.major, g.minor, "r")
                            and not state.is_granted("c", g.major, g.minor, "w")}
        info.withheld -= released
        await self._give_back(released)
        if info.withheld:
            logger.warning("Container %s: GPUs %s stay out of the free pool: cgroup '%s' may still grant them",
                           info.container_id, minors(info.withheld), info.cgroup)
        else:
            logger.info("Container %s: GPUs %s, whose grant had an unknown outcome, are not granted; released",
                        info.container_id, minors(released))
