"""Recovering: carrying a recovery out, one at a time (R-IS-7, issue 20 item 4).

Rules:
- ``recover(states, orphans)`` validates every id first, then runs once every
  call issued before it is done (a no-op added to each busy container
  sequence) and after any earlier recovery (a Sequence of recoveries); while
  it runs or waits, every call issued after it waits for it (the actor's
  ``_in_order`` and fast paths read ``_recovering``).
- It gathers the facts -- the cgroups under the root, each candidate's
  device state (one device-control batch), the GPUs the allocator holds --
  asks the pure planner (``_recovery``), and carries the plan out: one
  reclaim, the records and their units in the ledger (containers of
  unknown device state may reach any unit: the quarantine is held back for
  them all), the report lines, then every recovered cgroup whose state is
  known is reconciled to its recovered policy (the kernel may lag its record
  after a crash), and the CDI specs are brought in line.
- Mixed into the isolator actor (``NvidiaGpuIsolatorProcess``).
"""

from __future__ import annotations

import logging
from typing import Any

from runtime import Future, await_all, dispatch

from ._errors import IsolatorError
from ._grant import ContainerRecord
from ._ledger import Reach
from ._recovery import BROAD, UNKNOWN, minors, plan_recovery, recovery_candidates
from ._types import ContainerID, ContainerState, check_container_id

logger = logging.getLogger(__name__)


def _nothing() -> None:
    """A no-op in a container's sequence: done once the calls before it are."""


class Recovering:
    """The isolator actor's ``recover`` verb (see the module rules)."""

    pid: Any
    infos: dict
    allocator: Any
    devices: Any
    policies: Any
    catalog: Any
    specs: Any
    recovery_report: list
    _mig: bool
    _sequences: dict
    _running: set
    _sequence: Any
    _recoveries: Any
    _recovering: Any
    _lingering: dict
    ledger: Any
    _give_back: Any
    _units_of: Any
    _metrics: Any
    _run: Any
    _enforce_record: Any

    def recover(self, states: list[ContainerState], orphans: set[ContainerID]) -> Future:
        for state in states:
            check_container_id(getattr(state, "container_id", state))
        for orphan in orphans or ():
            check_container_id(orphan)
        # It starts once every call issued before it is done (and an earlier
        # recovery); every call issued after it waits for it (``_in_order``).
        busy = [cid for cid, sequence in self._sequences.items() if not sequence.is_idle()]
        busy += [cid for cid in self._running if cid not in self._sequences]
        earlier = [self._sequence(cid).add(_nothing) for cid in busy]
        recovery = self._recoveries.add(dispatch, self.pid, type(self)._run, None, self._recover,
                                        (states, orphans, earlier), None)
        self._recovering = recovery
        return recovery

    def _recovered(self) -> None:
        self._recovering = None  # no recovery running or waiting

    async def _recover(self, states: list[ContainerState], orphans: set[ContainerID], earlier: list[Future]) -> None:
        if earlier:
            await await_all(earlier)
        named: list[ContainerID] = [s.container_id for s in states] + sorted(orphans or ())
        existing = await self.devices.list_cgroups()
        candidates, report, missing = recovery_candidates(
            named, existing, {cid.value for cid in self.infos}, {cid.value for cid in self._lingering})
        read = [self.devices.state(cid.path()) for cid in candidates]  # one batch in device control
        states_by_cgroup = {cid.path(): await state for cid, state in zip(candidates, read)}
        held = await self.allocator.allocated()
        candidates = [cid for cid in candidates if cid not in self.infos]  # re-check after the awaits
        if self._mig:
            plan = plan_recovery(candidates, states_by_cgroup, self.allocator.total(), held, report, missing,
                                 granted=self.catalog.granted, covers=self.catalog.covers_by_wildcard)
        else:
            plan = plan_recovery(candidates, states_by_cgroup, self.allocator.total(), held, report, missing)
        for cid in plan.missing:
            logger.warning("Container %s: couldn't find the cgroup '%s' for recovery", cid, cid.path())
        if plan.claim:
            await self.allocator.reclaim(plan.claim)
        recovered: list[ContainerRecord] = []
        for container in plan.containers:
            info = ContainerRecord(container.container_id, container.cgroup)
            if container.kind == UNKNOWN:  # it may reach any unit: the quarantine is held back for it
                self.ledger.reaches_any(container.container_id, Reach.UNKNOWN_STATE)
            else:
                self.ledger.hold(container.container_id, container.gpus)
                recovered.append(info)
                if container.kind != BROAD:
                    logger.info("Container %s: recovered with GPUs %s", container.container_id,
                                minors(container.gpus))
            self.infos[container.container_id] = info
        await self._give_back(self.ledger.hold_back(plan.quarantine))
        for line in plan.report:
            self._report(line)
        for info in recovered:
            await self._reconcile_recovered(info)
        unknown = [cid for cid in self.infos if self.ledger.reach(cid) is Reach.UNKNOWN_STATE]
        known = {cid: self.ledger.held(cid) for cid in self.infos if cid not in unknown}
        try:
            for line in await self.specs.recover(known, unknown):
                self._report(line)
        except IsolatorError as e:  # the kernel and the allocator are recovered; say what the specs lack
            self._report(f"The CDI specs could not be brought in line with the recovered containers: {e}")

    async def _reconcile_recovered(self, info: ContainerRecord) -> None:
        """Make the kernel enforce a recovered container's policy: the kernel may
        hold more (a broad grant rewritten to the GPUs kept) or other rules;
        drift it cannot repair is reported and contained (``_repair``)."""
        lines, failed = await self._enforce_record(info)
        for line in lines:
            self._metrics.repairs.inc()
            self._report(f"Container {info.container_id}: recovery repaired its device rules: {line}")
        if failed is not None:
            self._report(f"Container {info.container_id}: recovery {failed.description}")

    def _report(self, line: str) -> None:
        logger.warning("%s", line)
        self.recovery_report.append(line)
