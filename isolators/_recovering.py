"""Recovering: the facts a recovery plans from, read from the kernel and the allocator.

Rules (R-IS-7, issue 20 item 4):
- ``read_recovery_plan`` gathers the facts -- the cgroups under the root,
  each candidate's device state (one device-control batch: every read is
  submitted before the first is awaited), the units the allocator holds --
  and asks the pure planner (``_recovery.plan_recovery``) with the unit
  catalog's view of a grant (whole GPUs and MIG devices alike).
- Candidates the isolator came to know while the facts were read (a
  record made meanwhile) are dropped before planning: ``known()`` is asked
  again after the awaits.
- The isolator carries the plan out (``NvidiaGpuIsolatorProcess._recover``):
  one reclaim, the records and their units in the ledger (containers of
  unknown device state may reach any unit: the quarantine is held back for
  them all), the report lines, then every recovered cgroup whose state is
  known is reconciled to its recovered policy (the kernel may lag its
  record after a crash), and the CDI specs are brought in line. It runs
  one at a time, after every call issued before it (``Ordering.recover``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from actors.devices import DeviceControl

from ._catalog import UnitCatalog
from ._recovery import RecoveryPlan, plan_recovery, recovery_candidates
from ._types import ContainerID

__all__ = ["read_recovery_plan"]


async def read_recovery_plan(devices: DeviceControl, allocator: Any, catalog: UnitCatalog,
                             named: Iterable[ContainerID], known: Callable[[], Collection[ContainerID]],
                             lingering: Collection[ContainerID]) -> RecoveryPlan:
    """The plan for the containers ``named`` (states, then orphans), from
    what the kernel and the allocator hold now (see the module rules)."""
    existing = await devices.list_cgroups()
    candidates, report, missing = recovery_candidates(
        named, existing, {cid.value for cid in known()}, {cid.value for cid in lingering})
    read = [devices.state(cid.path()) for cid in candidates]  # one batch in device control
    states = {cid.path(): await state for cid, state in zip(candidates, read)}
    held = await allocator.allocated()
    now_known = known()
    candidates = [cid for cid in candidates if cid not in now_known]  # re-check after the awaits
    return plan_recovery(candidates, states, allocator.total(), held, report, missing,
                         granted=catalog.granted, covers=catalog.covers_by_wildcard)
