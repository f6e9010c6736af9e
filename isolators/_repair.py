"""Kernel read-back and drift repair: the kernel is the answer.

Rules (R-DV-5, issue 20 items 2 and 5):
- ``reconcile`` (the isolator's verb) makes every container's kernel device
  state match its record (``enforce_record``, once per container, behind
  its earlier calls, so it never races a prepare, update or cleanup of it;
  a cleaned-up container is skipped, never recreated) and returns the
  repairs made (empty when nothing drifted).
- No unit goes back to the pool on a guess; the ledger (``_ledger``) says
  why each is not free, and every release goes through it and then
  ``give_back``. Units whose grant had an unknown outcome (a device-control
  call failed, e.g. a ``WorkerError`` when the device worker died
  mid-batch) are withheld for the container: they go back once the kernel
  is made to match the record (a reconcile succeeded), or once the cgroup's
  state, read back, does not grant them.
- Drift that cannot be repaired is contained and reported: the repair comes
  back as a ``Repair`` with ``failed`` and the reason; when the container
  may reach units beyond its record (the kernel refused to take them back)
  its cgroup may reach any unit (``reaches_any``: every free unit is taken
  at once and held back, and so is every unit released meanwhile) until a
  reconcile repairs it or it is cleaned up. Programs of others attached
  beside ours (v2) only deny more: reported, nothing held back. Recovery
  does the same.
- A cgroup the isolator could not remove lingers (``lingering``: why) with
  what it may still reach in the ledger; that goes back once the kernel
  has removed it, or (processes inside: it stays) denies it every unit. A
  later cleanup of that id, a prepare of it or a reconcile tries again.
  One left by a failed prepare may reach any unit (its configure may have
  stopped after the mkdir: v1 then allows what its parent allows, v2 has
  no program): from the failure on, every free unit is held back, and so
  is every unit released while it is there.
- A cleanup of an id the isolator has no record of finds its cgroup under
  the root only if someone else made it (``remove_unknown``): it would grant
  every device, so it is removed, or (processes inside) denied every unit
  and kept as lingering, with a warning.
- ``KernelRepair`` is a part the isolator actor owns: it shares the actor's
  ledger and device control, and owns the lingering cgroups (``lingering``:
  id -> why it is still there). Every release the ledger decides is
  carried out here (``give_back``).
- ``all_repairs(runs)`` awaits every container's reconcile (so none is left
  queued) and gives their repairs together, or the first failure once all
  have finished.
"""

from __future__ import annotations

import logging
from typing import Any

from actors.devices import DeviceControl, ForeignProgramsError
from runtime import Future

from ._catalog import UnitCatalog
from ._grant import Policies
from ._ledger import GpuLedger, Reach, Released
from ._recovery import minors
from ._types import ContainerID, Repair

__all__ = ["KernelRepair", "all_repairs"]

logger = logging.getLogger(__name__)

_DONE: Future[None] = Future.ready(None)


class KernelRepair:
    """Kernel read-backs and repairs, and the ledger's releases carried out (see the module rules)."""

    def __init__(self, devices: DeviceControl, allocator: Any, ledger: GpuLedger, policies: Policies,
                 catalog: UnitCatalog) -> None:
        self.lingering: dict[ContainerID, str] = {}
        """Ids whose cgroup could not be removed (processes inside, a failed or
        unknown removal), and why; what it may still reach is in the ledger."""
        self._devices = devices
        self._allocator = allocator
        self._ledger = ledger
        self._policies = policies
        self._catalog = catalog

    # -- the ledger's decisions, carried out ------------------------------------------
    def give_back(self, released: Released) -> Future[None]:
        """Carry out what the ledger let go: ``freed`` back to the allocator
        (the Future of it: await it); ``held_back`` stay while a cgroup may
        reach any unit (logged)."""
        if released.held_back:
            logger.warning("GPUs %s released stay out of the free pool while the cgroups of %s, which may reach any"
                           " GPU, are not removed or repaired", minors(released.held_back),
                           sorted(str(cid) for cid in self._ledger.reaching))
        if released.freed:
            return self._allocator.deallocate(released.freed)
        return _DONE

    async def reaches_any(self, cid: ContainerID, reach: Reach) -> frozenset:
        """``cid``'s cgroup may reach any unit: tell the ledger, and take every
        free unit at once (one allocator call, before anything else can be
        handed out) to hold back; what is held back now."""
        self._ledger.reaches_any(cid, reach)
        try:
            taken = await self._allocator.take_free()
        except Exception as error:
            logger.error("Container %s: could not hold back the free GPUs (%s)", cid, error)
        else:
            await self.give_back(self._ledger.hold_back(taken))
        return self._ledger.held_back() | self._ledger.withheld(cid)

    # -- containers ---------------------------------------------------------------------
    async def enforce_record(self, cid: ContainerID, cgroup: str) -> tuple[list[str], Repair | None]:
        """Make the kernel enforce ``cid``'s record: the repairs made, and the
        repair that failed (None when none did). Drift that cannot be repaired
        (v1: a wiped cgroup whose child keeps the re-deny from the kernel; v2:
        a program of others attached to override ours) may let the container
        reach every unit: it is then held back for it until a reconcile
        repairs it or it is cleaned up. Programs of others attached beside
        ours can only deny more: reported, nothing held back."""
        try:
            return await self._devices.reconcile(cgroup, self._policies.of(self._ledger.held(cid))), None
        except ForeignProgramsError as error:
            reason = str(error)
            logger.error("Container %s: drift not repaired: %s", cid, reason)
            return [], Repair(str(cid), f"could not repair its device rules: {reason}", failed=True, reason=reason)
        except Exception as error:
            reason = "; ".join([str(error), *getattr(error, "__notes__", ())])
            held = await self.reaches_any(cid, Reach.DRIFT)
            contained = (f"GPUs {minors(held)} are held back until it is repaired or cleaned up" if held
                         else "no GPU is free to hold back")
            description = f"could not repair its device rules ({reason}); it may reach any GPU, so {contained}"
            logger.error("Container %s: %s", cid, description)
            return [], Repair(str(cid), description, failed=True, reason=reason)

    async def settle_withheld(self, cid: ContainerID, cgroup: str) -> None:
        """Give back the withheld units the kernel does not grant: make the
        kernel enforce the record (reconcile) and release them all; failing
        that, read the cgroup's state back and release those it does not
        grant. Whatever cannot be known stays withheld."""
        withheld = self._ledger.withheld(cid)
        if not withheld:
            return
        try:
            await self._devices.reconcile(cgroup, self._policies.of(self._ledger.held(cid)))
            released = self._ledger.enforced(cid, self._ledger.held(cid))
        except Exception as error:
            try:
                state = await self._devices.state(cgroup)
            except Exception as again:
                logger.warning("Container %s: GPUs %s stay out of the free pool: the kernel state of cgroup '%s'"
                               " is unknown (%s; %s)", cid, minors(withheld), cgroup, error, again)
                return
            if state is None:
                return
            released = self._ledger.not_granted(cid, {unit for unit in withheld
                                                      if not self._catalog.may_use(state, unit)})
        await self.give_back(released)
        still = self._ledger.withheld(cid)
        if still:
            logger.warning("Container %s: GPUs %s stay out of the free pool: cgroup '%s' may still grant them",
                           cid, minors(still), cgroup)
        else:
            logger.info("Container %s: GPUs %s, whose grant had an unknown outcome, are not granted; released",
                        cid, minors(withheld))

    # -- cgroups left behind --------------------------------------------------------------
    async def remove_unknown(self, container_id: ContainerID) -> None:
        """Cleanup of an id the isolator has no record of: as in Mesos, nothing
        to do -- unless a cgroup of that name exists under the root (someone
        else made it): it would grant every device, so it is removed, or (it
        has processes) denied every GPU and kept as lingering, with a warning."""
        cgroup = container_id.path()
        if not await self._devices.exists(cgroup):
            logger.debug("Container %s: ignoring cleanup request for unknown container", container_id)
            return
        if await self._devices.remove(cgroup):
            logger.warning("Container %s: cleanup of an unknown container found its cgroup '%s' under the isolator"
                           " root (made by someone else); removed it", container_id, cgroup)
            return
        await self._devices.configure(cgroup, self._policies.of(()))
        self.lingering[container_id] = "still has processes"
        logger.warning("Container %s: cleanup of an unknown container found its cgroup '%s' under the isolator root"
                       " (made by someone else) with processes inside; it stays, denied every GPU", container_id,
                       cgroup)

    def to_settle(self) -> list[ContainerID]:
        """The lingering cgroups that may still reach a unit, sorted."""
        return sorted(cid for cid in self.lingering if self._ledger.has(cid))

    async def reconcile_lingering(self, cid: ContainerID) -> list[Repair]:
        if cid not in self.lingering or not self._ledger.has(cid):
            return []
        units = minors(self._ledger.held(cid) | self._ledger.withheld(cid))
        gone = await self.settle_lingering(cid)
        line = (f"removed the cgroup '{cid.path()}' left behind; released GPUs {units}" if gone else
                f"denied GPUs {units} to the cgroup '{cid.path()}' left behind (processes inside) and released them")
        return [Repair(str(cid), line)]

    async def settle_lingering(self, cid: ContainerID) -> bool:
        """Remove a lingering cgroup; True once it is gone. What it may reach
        goes back only when the kernel has removed it, or (processes inside:
        it stays) denies it every unit; a failure keeps them and is raised."""
        cgroup = cid.path()
        try:
            removed = await self._devices.remove(cgroup)
            if not removed and self._ledger.has(cid):
                # Processes inside: take every GPU back from them.
                await self._devices.configure(cgroup, self._policies.of(()))
        except BaseException as error:
            self.lingering[cid] = f"could not be removed ({error})"
            logger.error("Container %s: cgroup '%s' could not be removed (%s); GPUs %s stay out of the free pool"
                         " until a cleanup or reconcile removes it", cid, cgroup, error,
                         minors(self._ledger.held(cid) | self._ledger.withheld(cid)))
            raise
        released = self._ledger.removed(cid) if removed else self._ledger.enforced(cid, ())
        if removed:
            del self.lingering[cid]
        else:
            self.lingering[cid] = "still has processes"
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", cid, cgroup, minors(released.freed | released.held_back))
        await self.give_back(released)
        return removed


async def all_repairs(runs: list[Any]) -> list[Repair]:
    """Every run's repairs, each awaited (see module rules)."""
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
