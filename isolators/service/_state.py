"""The service's state as one caller may read it (SPEC R-SC-5).

Rules:
- ``state_for(caller, ...)`` builds the state document (``ServiceState``)
  from what the isolator and the allocator said a moment ago (the units
  each container holds, the free ones, the unhealthy ones), the service's
  records and its waiting line.
- The caller's own containers and waiting requests are shown whole;
  other users' only as counts per user (``ServiceState.others``: GPUs, MIG
  devices and waiting requests, by user name, else uid). Root and agents
  (and ``caller=None``: everything) see every container and request.
- Whose a container is comes from its record (``ContainerRecord.owner``);
  one the service holds no record of is root's. A MIG device names the
  container holding it only where the caller may see that container, and
  its user always.
- Pure: no I/O, no actor; the service asks, this module filters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from actors import Gpu

from ._caller import Caller
from ._line import PendingPrepare
from ._messages import ServiceState, UserShare
from ._records import ContainerRecord
from ._units import NodeUnits

__all__ = ["state_for"]


def state_for(caller: Caller | None, held: Mapping[str, list[Any]], available: Iterable[Any],
              unhealthy: Mapping[Any, str], records: Mapping[str, ContainerRecord], waiting: list[PendingPrepare],
              units: NodeUnits, *, backend: str, address: str, socket: str) -> ServiceState:
    """The state as ``caller`` may read it (None: everything; see module rules).
    ``held``: container id -> the units ``isolator.containers()`` lists."""
    everything = caller is None or caller.privileged
    containers, holders, users, others = {}, {}, {}, {}
    for name in sorted(held):
        minors = [unit for unit in held[name] if isinstance(unit, int)]
        migs = [unit for unit in held[name] if not isinstance(unit, int)]
        record = records.get(name) or ContainerRecord(container_id=name, uid=0, user="root")
        owner = record.owner
        if everything or owner == caller.uid:
            holders.update(dict.fromkeys(migs, name))
            containers[name] = record.view(minors, [units.uuid(m) for m in minors], migs,
                                           [units.uuid(m) for m in migs])
        else:
            share = others.setdefault(record.user or str(owner), UserShare())
            share.gpus += len(minors)
            share.mig_devices += len(migs)
        users.update(dict.fromkeys(migs, record.user or str(owner)))
    shown = []
    for pending in waiting:
        if everything or pending.uid == caller.uid:
            shown.append(pending.view())
        else:
            others.setdefault(pending.user or str(pending.uid), UserShare()).waiting += 1
    mig_views = units.mig_views(holders, unhealthy)
    for view in mig_views:
        view.user = users.get(view.device)
    return ServiceState(
        containers=containers,
        free=sorted(g.minor for g in available if isinstance(g, Gpu)),
        unhealthy={str(g.minor): reason for g, reason in sorted(unhealthy.items()) if isinstance(g, Gpu)},
        waiting=shown,
        total=sorted(g.minor for g in units.whole),
        backend=backend,
        address=address,
        mig_strategy=units.strategy,
        mig_devices=mig_views,
        mig_mode=units.mig_mode,
        others=others,
        socket=socket,
    )
