"""GpuAllocatorProcess: the single source of truth for which GPU is free.

Rules (R-AL-1..3; Mesos' ``NvidiaGpuAllocatorProcess``):
- State: the managed set (``total``), the ``allocated`` set, and GPUs
  marked unhealthy with a reason. Every GPU of ``total`` is either
  allocated or free; ``available`` is free and healthy.
- ``allocate(count)`` takes ``count`` available GPUs, chosen by
  ``allocate_best`` (topology) or lowest minors first (``lowest``); when
  short it fails with "Requested N gpus but only M available".
- ``allocate(gpus)`` takes exactly those or fails with "{...} are not
  available" naming each missing one and why (allocated, unhealthy, not
  managed). ``deallocate(gpus)`` returns them or fails with "{...} are not
  allocated" (a double free, a bogus GPU). ``reclaim(gpus)`` is recovery's
  allocate: it takes managed GPUs that are not allocated whatever their
  health (a container that held them is still running). ``take_free()``
  takes every unit not allocated, whatever its health, in one call
  (nothing can be handed out between a look and a take): an isolator
  holds them back while a cgroup may reach any unit.
- A failed call changes nothing: every check runs before any change.
- Units (R-MG-3): what is handed out is a unit, a whole ``Gpu`` or a
  ``MigDevice``. ``pools`` names which units count under which resource:
  ``gpus`` (whole GPUs, or every MIG device under the ``single`` strategy)
  and ``mig-<profile>`` (the ``mixed`` strategy); without it every unit is
  one of ``gpus``. ``allocate(count)`` takes from the ``gpus`` pool;
  ``allocate_resources({"gpus": 1, "mig-1g.18gb": 2})`` takes from several
  pools at once, all or nothing, failing with "Requested N mig-1g.18gb but
  only M available" (Mesos' text, with the resource's name). Topology
  scoring applies to whole GPUs only: MIG devices go lowest first (parent
  minor, GPU instance, compute instance). ``deallocate``, ``reclaim``,
  ``allocate(units)``, health and ``watch`` take units of either kind.
- Health (R-AL-3, R-HE-3/4): ``mark_unhealthy`` withholds a unit from
  allocation (one already allocated stays with its holder until
  deallocated, then stays out of the pool); ``mark_healthy`` (the
  operator's call) brings it back. ``watch(units)`` is a Future that
  completes with a ``GpuHealth`` when any of them turns unhealthy.
  ``health_event(event)`` is an NVML event handed over by the health
  monitor: an Xid in ``ignored_xids`` is logged and changes nothing; any
  other Xid, or a double-bit ECC error, marks the units of that GPU
  unhealthy (the whole GPU, or its MIG devices -- only those of the event's
  GPU instance when it names one) with the reason ``Xid 79`` /
  ``double-bit ECC error``; an event on a GPU this allocator does not
  manage is logged. ``health_unknown(reason)`` marks every managed unit
  unhealthy (NVML events failed: the node's health is unknown).
  ``unwatched`` lists units whose health nobody watches.
- Health generations (the kubelet plugin's ``ListAndWatch``): every call
  that changes which units are unhealthy (or why) adds one to
  ``health_generation``, once per call however many units it changed.
  ``health_since(generation)`` is a Future of a ``HealthSnapshot``
  (generation and the unhealthy units with their reasons): ready at once
  when ``generation`` is None or not the current one, else when the next
  change comes (discarding it stops waiting). Recovery (``mark_healthy``)
  is a change like any other.
- ``preferred(candidates, count, include)`` answers which ``count`` of the
  ``candidates`` the allocator would hand out, holding every unit of
  ``include``, without allocating: the same choice as ``allocate(count)``
  (``allocate_best`` with ``include``; lowest first under ``lowest``, and
  for MIG devices). Unmanaged units, ``include`` outside ``candidates``, or
  a count they cannot meet fail naming them.
- Every method is synchronous, so a call is one dispatch hop and never
  waits on I/O. The choice for a given free set and count is
  memoised (churn asks the same question again and again).
- Metrics (``_metrics``: GPUs and MIG devices total, free, allocated,
  unhealthy) are published at initialize and given back at finalize.
- The node ledger (SPEC 22; ``_ledger_link``): once ``join_ledger(directory,
  owner)`` has run, this process is the one place its front door takes and
  returns leases. Every grant (``allocate_count``, ``allocate_resources``,
  ``allocate_gpus``, ``reclaim``, ``take_free``, ``hold``) names its
  ``holder`` and is answered only once the ledger holds the owner's lease
  on each unit (at once when it holds them already; else a Future, after
  one executor job shared by every grant pending then). A unit another
  owner holds is never handed out: a count picks other units (one re-read
  of the ledger first when short), named units are refused, and a refusal
  names the unit's UUID, the owner and its holders (and counts
  ``ledger/conflicts``). Units other owners hold are not ``available()``;
  units the owner inherited from an earlier run are out of the pool until
  reclaimed or ``release_unclaimed()``. What goes back
  (``deallocate``, ``let_go``) is returned to the ledger by the link later.
  ``ledger_state()``, ``ledger_since(generation)`` and ``refresh_ledger()``
  tell who else holds what (the Kubernetes plugins' view).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from runtime import Future, MetricSet, Process, ProcessTerminated, Promise, generate_id

from actors.flags import DEFAULT_IGNORED_XIDS, GPU_ALLOCATIONS
from actors.gpu import Gpu
from actors.mig import MigDevice, Unit
from actors.nvml import HealthEvent, NodeInventory

from . import _metrics
from ._errors import AllocatorError, format_gpus
from ._ledger_link import LINGER, LedgerLink, LedgerState, unit_names
from ._topology import PairScores, allocate_best

__all__ = ["GpuAllocatorProcess", "GpuHealth", "AllocatorState", "HealthSnapshot"]

logger = logging.getLogger(__name__)

_MEMO_SIZE = 256

_SAME: Any = object()
"""``_leased``'s default answer: the units granted."""


class GpuHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU's health changed (``healthy=False``: withheld from allocation)."""

    gpu: Gpu
    healthy: bool
    reason: str = ""


class HealthSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Which units are unhealthy, as of one health generation."""

    generation: int
    unhealthy: dict[Unit, str]
    """Unit -> reason (``Xid 79``, ``marked unhealthy by the operator``, ...)."""


class AllocatorState(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the allocator (for inspection and scripts). Whole GPUs
    and MIG devices are listed apart, so each list decodes to one type."""

    total: list[Gpu]
    available: list[Gpu]
    allocated: list[Gpu]
    unhealthy: dict[str, str]
    """``"195:3"`` (or ``"195:0/gi1/ci0"``) -> reason."""
    mig_total: list[MigDevice] = []
    mig_available: list[MigDevice] = []
    mig_allocated: list[MigDevice] = []
    pools: dict[str, int] = {}
    """Resource name -> units available now (``gpus``, ``mig-<profile>``)."""
    unwatched: list[str] = []
    """Units handed out though nobody watches their health (no NVML events
    for their GPU, or health checks off), as ``"195:3"`` / ``"195:0/gi1/ci0"``."""
    node_ledger: str | None = None
    """The node ledger joined (None: none)."""
    ledger_owner: str | None = None
    held_elsewhere: dict[str, str] = {}
    """Units another owner of the node holds: ``"195:3"`` -> who and for whom."""
    inherited: list[str] = []
    """Units this owner leased in an earlier run, out of the pool until recovered."""


class GpuAllocatorProcess(Process):
    """The allocator actor (see module rules)."""

    def __init__(
        self,
        gpus: Iterable[Gpu],
        scores: PairScores | None = None,
        *,
        strategy: str = "topology",
        inventory: NodeInventory | None = None,
        pools: dict[str, Iterable[Unit]] | None = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        unwatched: Iterable[Gpu] | None = None,
    ) -> None:
        super().__init__(generate_id("gpu-allocator"))
        if strategy not in GPU_ALLOCATIONS:
            raise ValueError(f"Unknown allocation strategy {strategy!r}: expected"
                             f" {' or '.join(repr(choice) for choice in GPU_ALLOCATIONS)}")
        self.total = frozenset(gpus)
        self.pools: dict[str, frozenset[Unit]] = (
            {name: frozenset(units) for name, units in pools.items()} if pools is not None else {"gpus": self.total}
        )
        self._pool_of: dict[Unit, str] = {unit: name for name, units in self.pools.items() for unit in units}
        stray = self.total - self._pool_of.keys()
        if stray or self._pool_of.keys() - self.total:
            raise ValueError(f"The pools and the managed units differ: {sorted(stray ^ (self._pool_of.keys() - self.total))}")
        self._whole = self.pools.get("gpus", frozenset())
        self._whole_is_total = self._whole == self.total
        """Every unit is one of ``gpus`` (the whole-GPU node): the fast path."""
        self._whole_has_mig = any(isinstance(unit, MigDevice) for unit in self._whole)
        self.free: set[Gpu] = set(self.total)
        self.allocated: set[Gpu] = set()
        self.unhealthy: dict[Gpu, str] = {}
        self.scores = scores if scores is not None else PairScores.none(self.total)
        self.strategy = strategy
        self.inventory = inventory
        self.ignored_xids = frozenset(ignored_xids)
        self._watchers: list[tuple[frozenset[Gpu], Promise]] = []
        self.health_generation = 0
        """Changes of the unhealthy set so far (see module rules)."""
        self._health_waiters: list[Promise] = []
        self._health_dirty = False
        """This call changed the unhealthy set (``_health_changed`` publishes it)."""
        self._memo: OrderedDict[tuple[frozenset[Gpu], int], tuple[Gpu, ...]] = OrderedDict()
        self._by_index = {info.index: info.gpu for info in inventory.gpus} if inventory else {}
        self._units_of: dict[Gpu, list[Unit]] = {}
        """The managed units on each physical GPU (itself, or its MIG devices)."""
        for unit in sorted(self.total):
            self._units_of.setdefault(unit.parent if isinstance(unit, MigDevice) else unit, []).append(unit)
        unknown = self._units_of.keys() if unwatched is None else set(unwatched)
        self.unwatched = frozenset(u for gpu in unknown for u in self._units_of.get(gpu, ()))
        """Units on GPUs whose health NVML does not report (every unit without a monitor)."""
        self._metrics: MetricSet | None = None
        self.ledger_link: LedgerLink | None = None
        """The node ledger this allocator takes and returns leases in (None: none joined)."""
        self._elsewhere: frozenset[Unit] = frozenset()
        """Managed units another owner of the node holds (not available)."""
        self._ledger_metrics: MetricSet | None = None

    # ------------------------------------------------------------ lifecycle

    def initialize(self) -> None:
        self._metrics = _metrics.publish(self)

    def finalize(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._ledger_metrics is not None:
            self._ledger_metrics.close()
        if self.ledger_link is not None:
            self.ledger_link.shutdown()
        for _gpus, promise in self._watchers:
            promise.fail(ProcessTerminated(f"GPU allocator {self.pid} terminated"))
        self._watchers.clear()
        for promise in self._health_waiters:
            promise.fail(ProcessTerminated(f"GPU allocator {self.pid} terminated"))
        self._health_waiters.clear()

    # ------------------------------------------------------------ queries

    def available(self) -> set[Gpu]:
        available = self.free - self.unhealthy.keys()
        if self._elsewhere:
            available -= self._elsewhere
        return available

    def allocated_gpus(self) -> set[Gpu]:
        return set(self.allocated)

    def unhealthy_gpus(self) -> dict[Gpu, str]:
        return dict(self.unhealthy)

    def state(self) -> AllocatorState:
        available = self.available()
        return AllocatorState(
            total=_whole_gpus(self.total),
            available=_whole_gpus(available),
            allocated=_whole_gpus(self.allocated),
            unhealthy={str(gpu): reason for gpu, reason in sorted(self.unhealthy.items())},
            mig_total=_mig_devices(self.total),
            mig_available=_mig_devices(available),
            mig_allocated=_mig_devices(self.allocated),
            pools={name: len(units & available) for name, units in sorted(self.pools.items())},
            unwatched=[str(unit) for unit in sorted(self.unwatched)],
            **self._ledger_fields(),
        )

    def _ledger_fields(self) -> dict[str, Any]:
        link = self.ledger_link
        if link is None:
            return {}
        return {"node_ledger": link.path, "ledger_owner": link.owner,
                "held_elsewhere": {str(unit): conflict.describe() for unit, conflict in sorted(link.elsewhere.items())},
                "inherited": [str(unit) for unit in sorted(link.inherited)]}

    # ------------------------------------------------------------ allocation

    def allocate_count(self, count: int, holder: str | None = None, _tries: int = 0) -> Any:
        """``count`` available GPUs for ``holder``: the set (or, while the node
        ledger takes their leases, a Future of it)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise AllocatorError(f"Requested {count!r} gpus: the count must be a non-negative integer")
        available = self.available()
        if not self._whole_is_total:
            available &= self._whole
        if len(available) < count:
            if self._may_refresh(self._whole, _tries):
                return self._after_refresh(lambda: self.allocate_count(count, holder, _tries + 1))
            raise AllocatorError(self._short("gpus", count, available, self._whole))
        if count == 0:
            return set()
        chosen = self._choose(available, count)
        link = self.ledger_link
        if link is not None and link.grant(chosen, holder):  # leased already: no file work (the churn's case)
            link = None
        self.free.difference_update(chosen)
        self.allocated.update(chosen)
        if link is None:
            return set(chosen)
        return self._leased(set(chosen), lambda: self.allocate_count(count, holder, _tries + 1), _tries)

    def _short(self, name: str, count: int, available: set[Unit], pool: frozenset[Unit]) -> str:
        message = f"Requested {count} {name} but only {len(available)} available"
        withheld = len((self.free & pool) - self._elsewhere - available)
        if withheld:
            message += f" ({withheld} more withheld as unhealthy)"
        elsewhere = sorted(pool & self._elsewhere)
        if elsewhere and self.ledger_link is not None:
            self.ledger_link.conflicts += 1
            described = "; ".join(self.ledger_link.elsewhere[unit].describe() for unit in elsewhere)
            message += f" ({len(elsewhere)} more held by other front doors of this node: {described})"
        return message

    def allocate_resources(self, demand: dict[str, int], holder: str | None = None, _tries: int = 0) -> Any:
        """Units for several resources at once (``{"gpus": 1, "mig-1g.18gb": 2}``),
        all or nothing, for ``holder`` (see module rules): the set, or a Future of it."""
        if len(demand) == 1 and "gpus" in demand and "gpus" in self.pools:  # the common case: one count of gpus
            return self.allocate_count(demand["gpus"], holder, _tries)
        wanted: list[tuple[str, int]] = []
        for name, count in demand.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise AllocatorError(f"Requested {count!r} {name}: the count must be a non-negative integer")
            if count == 0:
                continue
            if name not in self.pools:
                known = ", ".join(sorted(self.pools)) or "none"
                raise AllocatorError(
                    f"Requested {count} {name} but this node offers no {name!r} (its resources: {known})"
                )
            wanted.append((name, count))
        available = self.available()
        picks: list[tuple[str, tuple[Unit, ...]]] = []
        for name, count in wanted:
            pool = self.pools[name]
            free = available & pool
            if len(free) < count:
                if self._may_refresh(pool, _tries):
                    return self._after_refresh(lambda: self.allocate_resources(demand, holder, _tries + 1))
                raise AllocatorError(self._short(name, count, free, pool))
            picks.append((name, self._choose(free, count) if name == "gpus" else tuple(sorted(free)[:count])))
        chosen: set[Unit] = set()
        for _name, units in picks:
            chosen.update(units)
        link = self.ledger_link
        if link is not None and link.grant(chosen, holder):
            link = None
        self.free.difference_update(chosen)
        self.allocated.update(chosen)
        if link is None or not chosen:
            return chosen
        return self._leased(chosen, lambda: self.allocate_resources(demand, holder, _tries + 1), _tries)

    def pool_of(self, unit: Unit) -> str | None:
        """The resource a managed unit counts under (None: not managed)."""
        return self._pool_of.get(unit)

    def _choose(self, available: set[Gpu], count: int) -> tuple[Gpu, ...]:
        if self.strategy == "lowest" or not self.scores.has_topology or self._whole_has_mig:
            return tuple(sorted(available)[:count])
        key = (frozenset(available), count)
        chosen = self._memo.get(key)
        if chosen is None:
            chosen = tuple(allocate_best(available, count, self.scores))
            self._memo[key] = chosen
            if len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return chosen

    def allocate_gpus(self, gpus: Iterable[Gpu], holder: str | None = None, _tries: int = 0) -> Any:
        wanted = _as_gpu_set(gpus)
        missing = wanted - self.available()
        if missing:
            if self._may_refresh(missing, _tries):
                return self._after_refresh(lambda: self.allocate_gpus(wanted, holder, _tries + 1))
            if missing & self._elsewhere and self.ledger_link is not None:
                self.ledger_link.conflicts += 1
            raise AllocatorError(f"{format_gpus(missing)} are not available ({self._why(missing)})")
        link = self.ledger_link
        if link is not None and link.grant(wanted, holder):
            link = None
        self.free.difference_update(wanted)
        self.allocated.update(wanted)
        if link is None or not wanted:
            return None
        return self._leased(wanted, lambda: self.allocate_gpus(wanted, holder, _tries + 1), _tries, value=None)

    def reclaim(self, gpus: Iterable[Gpu], holders: dict[Unit, str] | None = None) -> Any:
        """Recovery's allocate: managed units a surviving container holds, whatever
        their health; with a node ledger, their leases too (``holders``: unit ->
        its holder), or inherited ones kept."""
        wanted = _as_gpu_set(gpus)
        link = self.ledger_link
        inherited = link.inherited & wanted if link is not None else set()
        missing = wanted - self.free - inherited
        if missing:
            raise AllocatorError(f"{format_gpus(missing)} are not available ({self._why(missing)})")
        self.free.difference_update(wanted)
        self.allocated.update(wanted)
        if link is None or not wanted:
            return None
        link.reclaimed(wanted)
        covered = True
        for unit in wanted:
            covered = link.grant((unit,), (holders or {}).get(unit)) and covered
        if covered:
            return None
        promise: Promise = Promise()

        def on_result(result: Any) -> None:
            if isinstance(result, BaseException):
                promise.fail(result)
                return
            if result.conflicts:  # the kernel already grants them: say so loudly, keep them
                link.conflicts += 1
                logger.error("Node ledger %s: units recovered from the kernel are held by another front door too"
                             " (two front doors grant them): %s", link.path,
                             "; ".join(conflict.describe() for conflict in result.conflicts))
            promise.set_value(None)

        link.take(wanted, True, on_result)
        return promise.future

    def take_free(self, holder: str | None = None) -> Any:
        """Every unit not allocated (healthy or not) that no other owner of the
        node holds, now allocated; the units (or a Future of them)."""
        taken = set(self.free) - self._elsewhere
        self.free.difference_update(taken)
        self.allocated.update(taken)
        link = self.ledger_link
        if link is None or not taken:
            return taken
        if link.grant(taken, holder):
            return taken
        promise: Promise = Promise()

        def on_result(result: Any) -> None:
            if isinstance(result, BaseException):
                self._put_back(taken)
                promise.fail(result)
                return
            kept = {link.unit_of[uuid] for uuid in result.taken}
            self._put_back(taken - kept)
            promise.set_value(kept)

        link.take(taken, True, on_result)
        return promise.future

    def hold(self, units: Iterable[Unit], holder: str) -> Any:
        """``holder`` holds exactly ``units`` (sharing any it already holds with
        other holders of this owner): all or nothing (see module rules). Units
        the owner inherited from an earlier run are held again (a front door
        reconciling from its own truth: then ``release_unclaimed``)."""
        wanted = _as_gpu_set(units)
        link = self._link("hold")
        unmanaged = wanted - self.total
        if unmanaged:
            raise AllocatorError(f"{format_gpus(unmanaged)} are not managed by this allocator")
        inherited = wanted & link.inherited  # a front door reconciling from its own truth holds them again
        fresh = wanted & self.free
        self.free.difference_update(fresh)
        self.allocated.update(fresh | inherited)
        link.reclaimed(inherited)
        before = {unit: link.holders.get(unit, ()) for unit in wanted - fresh - inherited}
        link.add_holder(wanted, holder)
        if link.covered(wanted):
            return None
        promise: Promise = Promise()

        def on_result(result: Any) -> None:
            if isinstance(result, BaseException) or result.conflicts:
                self._put_back(fresh)
                self.allocated.difference_update(inherited)
                link.inherited.update(inherited)
                for unit in inherited:
                    link.holders.pop(unit, None)
                for unit, holders in before.items():
                    link.holders[unit] = holders
                if isinstance(result, BaseException):
                    promise.fail(result)
                    return
                self.ledger_link.conflicts += 1  # type: ignore[union-attr]
                promise.fail(AllocatorError(_refused(result.conflicts)))
                return
            promise.set_value(None)

        link.take(wanted, False, on_result)
        return promise.future

    def let_go(self, holder: str, units: Iterable[Unit] | None = None) -> set[Unit]:
        """``holder`` holds ``units`` (None: every unit) no more; the units no holder
        keeps are back in the pool (the ledger gets them back later); those units."""
        link = self._link("let_go")
        candidates = _as_gpu_set(units) if units is not None else set(link.holders)
        freed = set()
        for unit in candidates:
            if holder in link.holders.get(unit, ()) and link.remove_holder(unit, holder):
                freed.add(unit)
        self.allocated.difference_update(freed)
        self.free.update(freed)
        link.unused(freed)
        return freed

    def deallocate(self, gpus: Iterable[Gpu]) -> None:
        returned = _as_gpu_set(gpus)
        missing = returned - self.allocated
        if missing:
            reasons = []
            for gpu in sorted(missing):
                reasons.append(f"{gpu} is {'free' if gpu in self.total else 'not managed by this allocator'}")
            raise AllocatorError(f"{format_gpus(missing)} are not allocated ({'; '.join(reasons)})")
        self.allocated.difference_update(returned)
        self.free.update(returned)
        if self.ledger_link is not None:
            self.ledger_link.unused(returned)

    def _why(self, gpus: set[Gpu]) -> str:
        reasons = []
        link = self.ledger_link
        for gpu in sorted(gpus):
            if gpu not in self.total:
                reasons.append(f"{gpu} is not managed by this allocator")
            elif gpu in self.allocated:
                reasons.append(f"{gpu} is allocated")
            elif link is not None and gpu in link.inherited:
                reasons.append(f"{gpu} is leased by {link.owner} in an earlier run and not recovered yet")
            elif link is not None and gpu in self._elsewhere:
                reasons.append(link.elsewhere[gpu].describe())
            elif gpu in self.unhealthy:
                reasons.append(f"{gpu} is unhealthy: {self.unhealthy[gpu]}")
        return "; ".join(reasons)

    # ------------------------------------------------------------ the node ledger

    async def join_ledger(self, directory: str, owner: str, linger: float = LINGER) -> LedgerState:
        """Take and return this allocator's leases in the node ledger at
        ``directory`` as ``owner`` from now on (see module rules)."""
        link = self.ledger_link
        if link is not None:
            if link.owner == owner and link.path == directory:
                return link.state()
            raise AllocatorError(f"This allocator already holds its units in the node ledger {link.path} as"
                                 f" {link.owner}; it cannot join {directory} as {owner}")
        if self.inventory is None:
            raise AllocatorError("The node ledger names units by their UUIDs: an allocator without the NVML"
                                 " inventory cannot join one")
        link = LedgerLink(self, owner, unit_names(self.inventory, self.total), linger)
        self.ledger_link = link
        try:
            await link.open(directory)
        except BaseException:
            self.ledger_link = None
            for unit in link.inherited:
                self.free.add(unit)
            link.shutdown()
            raise
        self._ledger_metrics = _metrics.publish_ledger(self)
        if self.unhealthy:
            link.report_health(self.unhealthy)
        return link.state()

    async def leave_ledger(self) -> None:
        """Return the units no holder has and release the owner's lock (the
        allocator is closing); the leases of held units stay."""
        link = self.ledger_link
        if link is not None:
            await link.close()

    def ledger_state(self) -> LedgerState | None:
        return self.ledger_link.state() if self.ledger_link is not None else None

    def ledger_since(self, generation: int | None) -> Future:
        """A ``LedgerState`` once what other owners hold changed after ``generation`` (None: now)."""
        return self._link("ledger_since").since(generation)

    def refresh_ledger(self) -> Future:
        """Read the ledger again (one job); then the current ``LedgerState``."""
        link = self._link("refresh_ledger")
        return link.refresh().then(lambda _: link.state())

    def release_unclaimed(self) -> list[str]:
        """Recovery is done: every unit inherited from an earlier run and not
        reclaimed goes back (see module rules); what went back, as text."""
        link = self.ledger_link
        if link is None:
            return []
        units, unmanaged = link.release_unclaimed()
        return [str(unit) for unit in sorted(units)] + sorted(unmanaged)

    def elsewhere_changed(self, units: frozenset[Unit]) -> None:
        """The link learnt which managed units other owners hold."""
        self._elsewhere = units

    def _link(self, call: str) -> LedgerLink:
        if self.ledger_link is None:
            raise AllocatorError(f"{call}: this allocator has joined no node ledger (join_ledger first)")
        return self.ledger_link

    def _may_refresh(self, wanted: Iterable[Unit], tries: int) -> bool:
        """Short because other owners held units when last seen: read the ledger once more first."""
        return self.ledger_link is not None and tries == 0 and not self._elsewhere.isdisjoint(wanted)

    def _after_refresh(self, again: Callable[[], Any]) -> Future:
        promise: Promise = Promise()
        self.ledger_link.refresh().on_any(lambda _: promise.associate(_as_future(again)))  # type: ignore[union-attr]
        return promise.future

    def _leased(self, units: set[Unit], again: Callable[[], Any], tries: int, value: Any = _SAME) -> Future:
        """``units``, just taken from the pool (their holders given to the link,
        which does not lease them all yet): the grant's answer once the
        ledger holds them (see module rules)."""
        link = self.ledger_link
        answer = set(units) if value is _SAME else value
        promise: Promise = Promise()

        def on_result(result: Any) -> None:
            if isinstance(result, BaseException):
                self._put_back(units)
                promise.fail(result)
                return
            if not result.conflicts:
                promise.set_value(answer)
                return
            self._put_back(units)
            if tries < len(self.total):  # other units may do (a count), or the refusal names who holds them
                promise.associate(_as_future(again))
            else:
                link.conflicts += 1  # type: ignore[union-attr]
                promise.fail(AllocatorError(_refused(result.conflicts)))

        link.take(units, False, on_result)  # type: ignore[union-attr]
        return promise.future

    def _put_back(self, units: Iterable[Unit]) -> None:
        """Units a grant took from the pool but could not lease: back in the pool."""
        units = set(units) & self.allocated
        self.allocated.difference_update(units)
        self.free.update(units)
        if self.ledger_link is not None:
            self.ledger_link.unused(units)

    # ------------------------------------------------------------ health

    def mark_unhealthy(self, gpu: Gpu, reason: str = "marked unhealthy by the operator") -> GpuHealth:
        self._check_managed(gpu)
        change = self._withhold(gpu, reason)
        self._health_changed()
        return change

    def _withhold(self, gpu: Unit, reason: str) -> GpuHealth:
        """Mark one unit unhealthy and resolve its watchers (health waiters
        are told by ``_health_changed``, once per call)."""
        change = GpuHealth(gpu=gpu, healthy=False, reason=reason)
        if gpu not in self.unhealthy:
            logger.warning("GPU %s is unhealthy: %s; it is withheld from allocation", gpu, reason)
        if self.unhealthy.get(gpu) != reason:
            self.unhealthy[gpu] = reason
            self._health_dirty = True
        keep = []
        for gpus, promise in self._watchers:
            if gpu in gpus:
                promise.set_value(change)
            else:
                keep.append((gpus, promise))
        self._watchers = keep
        return change

    def mark_healthy(self, gpu: Gpu) -> GpuHealth:
        self._check_managed(gpu)
        if self.unhealthy.pop(gpu, None) is not None:
            logger.info("GPU %s is healthy again", gpu)
            self._health_dirty = True
        self._health_changed()
        return GpuHealth(gpu=gpu, healthy=True)

    def _health_changed(self) -> None:
        """One new generation if this call changed the unhealthy set; its waiters get the snapshot."""
        if not self._health_dirty:
            return
        self._health_dirty = False
        self.health_generation += 1
        if self.ledger_link is not None:
            self.ledger_link.report_health(self.unhealthy)
        waiters, self._health_waiters = self._health_waiters, []
        if waiters:
            snapshot = self._health_snapshot()
            for promise in waiters:
                promise.set_value(snapshot)

    def _health_snapshot(self) -> HealthSnapshot:
        return HealthSnapshot(generation=self.health_generation, unhealthy=dict(self.unhealthy))

    def health_since(self, generation: int | None) -> Future:
        """A ``HealthSnapshot`` once the generation differs from ``generation`` (see module rules)."""
        if generation is None or generation != self.health_generation:
            return Future.ready(self._health_snapshot())
        promise: Promise = Promise()
        return _queued(lambda: self._health_waiters, promise, promise)

    def preferred(self, candidates: Iterable[Unit], count: int, include: Iterable[Unit] = ()) -> list[Unit]:
        """Which ``count`` of ``candidates`` (holding ``include``) would be handed out (see module rules)."""
        pool = _as_gpu_set(candidates)
        required = _as_gpu_set(include)
        unmanaged = (pool | required) - self.total
        if unmanaged:
            raise AllocatorError(f"{format_gpus(unmanaged)} are not managed by this allocator")
        outside = required - pool
        if outside:
            raise AllocatorError(f"{format_gpus(outside)} must be included but are not among the candidates")
        if isinstance(count, bool) or not isinstance(count, int) or not len(required) <= count <= len(pool):
            raise AllocatorError(
                f"Cannot choose {count!r} of {len(pool)} candidates holding the {len(required)} that must be included"
            )
        whole = all(isinstance(unit, Gpu) for unit in pool)
        if self.strategy == "lowest" or not whole or not self.scores.has_topology:
            rest = sorted(pool - required)[: count - len(required)]
            return sorted(required) + rest
        return allocate_best(pool, count, self.scores, include=required)

    def watch(self, gpus: Iterable[Gpu]) -> Future:
        watched = _as_gpu_set(gpus)
        for gpu in sorted(watched):
            if gpu in self.unhealthy:
                return Future.ready(GpuHealth(gpu=gpu, healthy=False, reason=self.unhealthy[gpu]))
        promise: Promise = Promise()
        return _queued(lambda: self._watchers, (frozenset(watched), promise), promise)

    def health_event(self, event: HealthEvent) -> list[GpuHealth]:
        """An NVML health event (from the health monitor); the changes it made."""
        gpu = self._by_index.get(event.index)
        units = self._units_of.get(gpu, []) if gpu is not None else []
        if event.gpu_instance is not None:
            units = [u for u in units if not isinstance(u, MigDevice) or u.gi == event.gpu_instance]
        where = f"GPU {gpu}" if gpu is not None else f"GPU index {event.index}"
        if event.gpu_instance is not None:
            where += f" (GPU instance {event.gpu_instance})"
        if not units:
            logger.info("NVML reported %s on %s, which this allocator does not manage", event.describe(), where)
            return []
        if event.kind == "xid" and event.code in self.ignored_xids:
            logger.info("%s reported %s (caused by an application; kept)", where, event.describe())
            return []
        changes = [self._withhold(unit, event.describe()) for unit in units]
        self._health_changed()
        return changes

    def health_unknown(self, reason: str) -> list[GpuHealth]:
        """NVML cannot tell any GPU's health: withhold every managed unit."""
        logger.error("The health of this node's GPUs is unknown (%s): every GPU is withheld until"
                     " mark_healthy", reason)
        changes = [self._withhold(unit, reason) for unit in sorted(self.total)]
        self._health_changed()
        return changes

    def _check_managed(self, gpu: Unit) -> None:
        if not isinstance(gpu, (Gpu, MigDevice)):
            raise AllocatorError(f"Expected a Gpu or a MigDevice, got {gpu!r}")
        if gpu not in self.total:
            raise AllocatorError(f"GPU {gpu} is not managed by this allocator")


def _as_future(fn: Callable[[], Any]) -> Future:
    """``fn()`` as a Future (its value, the Future it returned, or its failure)."""
    try:
        value = fn()
    except Exception as error:
        return Future.failed(error)
    return value if isinstance(value, Future) else Future.ready(value)


def _refused(conflicts: Iterable[Any]) -> str:
    """A grant refused because another owner of the node holds its units."""
    return "Held by another front door of this node: " + "; ".join(c.describe() for c in conflicts)


def _queued(waiting: Callable[[], list[Any]], entry: Any, promise: Promise) -> Future:
    """``promise``'s Future, with ``entry`` queued on the list ``waiting()``
    gives until it is answered; discarding the Future takes ``entry`` off the
    list ``waiting()`` gives then (the process replaces its lists when it
    answers them)."""
    waiting().append(entry)

    def _discarded() -> None:
        current = waiting()
        if entry in current:
            current.remove(entry)
        promise.discard()

    promise.on_discard(_discarded)
    return promise.future


def _as_gpu_set(gpus: Iterable[Unit]) -> set[Unit]:
    result = set()
    for gpu in gpus:
        if not isinstance(gpu, (Gpu, MigDevice)):
            raise AllocatorError(f"Expected Gpu or MigDevice values, got {gpu!r}")
        result.add(gpu)
    return result


def _whole_gpus(units: Iterable[Unit]) -> list[Gpu]:
    return sorted(unit for unit in units if isinstance(unit, Gpu))


def _mig_devices(units: Iterable[Unit]) -> list[MigDevice]:
    return sorted(unit for unit in units if isinstance(unit, MigDevice))

