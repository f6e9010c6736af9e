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
- Health (R-AL-3, R-HE-3/4): ``_health`` (``mark_unhealthy``,
  ``mark_healthy``, ``watch``, ``health_since``, NVML events); the node
  ledger (SPEC 22): ``_ledger_calls`` (``join_ledger``; every grant names
  its ``holder`` and ends in ``_grant``/``_leased``). Both are mixed into this class
  and keep their state here.
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
- Finalize (the handle's ``close``, or leaving ``Runtime()``, which
  terminates every process) leaves the node ledger as ``leave_ledger``
  does: every pending return written, then the owner lock released
  (SPEC R-SH-4; the link's ``close``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgspec

from runtime import MetricSet, Process, ProcessTerminated, Promise, generate_id

from actors.flags import DEFAULT_IGNORED_XIDS, GPU_ALLOCATIONS
from actors.gpu import Gpu
from actors.ledger import describe_conflicts
from actors.mig import MigDevice, Unit
from actors.nvml import NodeInventory

from . import _metrics
from ._errors import AllocatorError, format_gpus, unit_set
from ._health import AllocatorHealth
from ._ledger_calls import LedgerCalls, refused
from ._ledger_link import LedgerLink
from ._topology import PairScores, allocate_best

__all__ = ["GpuAllocatorProcess", "AllocatorState"]

logger = logging.getLogger(__name__)

_MEMO_SIZE = 256


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


class GpuAllocatorProcess(AllocatorHealth, LedgerCalls, Process):
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

    def finalize(self) -> Any:
        if self._metrics is not None:
            self._metrics.close()
        if self._ledger_metrics is not None:
            self._ledger_metrics.close()
        for _gpus, promise in self._watchers:
            promise.fail(ProcessTerminated(f"GPU allocator {self.pid} terminated"))
        self._watchers.clear()
        for promise in self._health_waiters:
            promise.fail(ProcessTerminated(f"GPU allocator {self.pid} terminated"))
        self._health_waiters.clear()
        if self.ledger_link is not None and self.ledger_link.directory is not None:
            return self.ledger_link.close(ended=True)  # pending returns written, then the owner lock released
        return None

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
        chosen = set(self._choose(available, count))
        if self._grant(chosen, holder):
            return chosen
        return self._leased(chosen, lambda: self.allocate_count(count, holder, _tries + 1), _tries, set(chosen))

    def _short(self, name: str, count: int, available: set[Unit], pool: frozenset[Unit]) -> str:
        message = f"Requested {count} {name} but only {len(available)} available"
        withheld = len((self.free & pool) - self._elsewhere - available)
        if withheld:
            message += f" ({withheld} more withheld as unhealthy)"
        elsewhere = sorted(pool & self._elsewhere)
        if elsewhere and self.ledger_link is not None:
            self.ledger_link.conflicts += 1
            described = describe_conflicts(self.ledger_link.elsewhere[unit] for unit in elsewhere)
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
        if self._grant(chosen, holder):
            return chosen
        return self._leased(chosen, lambda: self.allocate_resources(demand, holder, _tries + 1), _tries, set(chosen))

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

    def preferred(self, candidates: Iterable[Unit], count: int, include: Iterable[Unit] = ()) -> list[Unit]:
        """Which ``count`` of ``candidates`` (holding ``include``) would be handed out (see module rules)."""
        pool = unit_set(candidates)
        required = unit_set(include)
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

    def allocate_gpus(self, gpus: Iterable[Gpu], holder: str | None = None, _tries: int = 0) -> Any:
        wanted = unit_set(gpus)
        missing = wanted - self.available()
        if missing:
            if self._may_refresh(missing, _tries):
                return self._after_refresh(lambda: self.allocate_gpus(wanted, holder, _tries + 1))
            if missing & self._elsewhere and self.ledger_link is not None:
                self.ledger_link.conflicts += 1
            raise AllocatorError(f"{format_gpus(missing)} are not available ({self._why(missing)})")
        if self._grant(wanted, holder):
            return None
        return self._leased(wanted, lambda: self.allocate_gpus(wanted, holder, _tries + 1), _tries, None)

    def reclaim(self, gpus: Iterable[Gpu], holders: dict[Unit, str] | None = None,
                quarantine: Iterable[Unit] = ()) -> Any:
        """Recovery's allocate: managed units a surviving container holds, whatever
        their health; with a node ledger, their leases too (``holders``: unit ->
        its holder), or inherited ones kept. ``quarantine``: those of them held
        back for containers of unknown state (which may reach any unit): one that
        another front door holds stays that front door's and out of this pool,
        and is no conflict (only a unit the kernel grants a container is)."""
        wanted = unit_set(gpus)
        held_back = unit_set(quarantine)
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
            granted = [c for c in result.conflicts if link.unit_of.get(c.unit) not in held_back]
            if granted:  # the kernel already grants them: say so loudly, keep them
                link.conflicts += 1
                logger.error("Node ledger %s: units recovered from the kernel are held by another front door too"
                             " (two front doors grant them): %s", link.path,
                             describe_conflicts(granted))
            if len(granted) < len(result.conflicts):
                logger.warning("Node ledger %s: units held back for containers of unknown state are another front"
                               " door's, which keeps them (those containers may reach them too; clean them up): %s",
                               link.path, describe_conflicts(c for c in result.conflicts if c not in granted))
            promise.set_value(None)

        link.take(wanted, True, on_result, proven=wanted - held_back)  # the kernel grants them: SPEC R-SH-3
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

        def on_result(result: Any) -> None:  # the units the ledger leased stay taken; the rest go back
            failed = isinstance(result, BaseException)
            kept = set() if failed else {link.unit_of[uuid] for uuid in result.taken}
            self._put_back(taken - kept)
            if failed:
                promise.fail(result)
            else:
                promise.set_value(kept)

        link.take(taken, True, on_result)
        return promise.future

    def hold(self, units: Iterable[Unit], holder: str) -> Any:
        """``holder`` holds exactly ``units`` (sharing any it already holds with
        other holders of this owner): all or nothing (see module rules). Units
        the owner inherited from an earlier run are held again (a front door
        reconciling from its own truth: then ``release_unclaimed``)."""
        wanted = unit_set(units)
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
                promise.fail(AllocatorError(refused(result.conflicts)))
                return
            promise.set_value(None)

        link.take(wanted, False, on_result)
        return promise.future

    def let_go(self, holder: str, units: Iterable[Unit] | None = None) -> set[Unit]:
        """``holder`` holds ``units`` (None: every unit) no more; the units no holder
        keeps are back in the pool (the ledger gets them back later); those units."""
        link = self._link("let_go")
        candidates = unit_set(units) if units is not None else set(link.holders)
        freed = set()
        for unit in candidates:
            if holder in link.holders.get(unit, ()) and link.remove_holder(unit, holder):
                freed.add(unit)
        self.allocated.difference_update(freed)
        self.free.update(freed)
        link.unused(freed)
        return freed

    def deallocate(self, gpus: Iterable[Gpu]) -> None:
        returned = unit_set(gpus)
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
        elsewhere = []  # other owners' units: each owner named once, where its first unit comes (R-SH-5)
        for gpu in sorted(gpus):
            if gpu not in self.total:
                reasons.append(f"{gpu} is not managed by this allocator")
            elif gpu in self.allocated:
                reasons.append(f"{gpu} is allocated")
            elif link is not None and gpu in link.inherited:
                reasons.append(f"{gpu} is leased by {link.owner} in an earlier run and not recovered yet")
            elif link is not None and gpu in self._elsewhere:
                if not elsewhere:
                    reasons.append("")
                elsewhere.append(link.elsewhere[gpu])
            elif gpu in self.unhealthy:
                reasons.append(f"{gpu} is unhealthy: {self.unhealthy[gpu]}")
        if elsewhere:
            reasons[reasons.index("")] = describe_conflicts(elsewhere)
        return "; ".join(reasons)


def _whole_gpus(units: Iterable[Unit]) -> list[Gpu]:
    return sorted(unit for unit in units if isinstance(unit, Gpu))


def _mig_devices(units: Iterable[Unit]) -> list[MigDevice]:
    return sorted(unit for unit in units if isinstance(unit, MigDevice))
