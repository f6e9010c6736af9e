"""LedgerCalls: the allocator's side of the node ledger (SPEC 22).

Rules (part of ``GpuAllocatorProcess``, which mixes this in; the file work
is ``_ledger_link``'s):
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
  reclaimed or ``release_unclaimed()`` (answered once the ledger has them
  back, or its job failed: then they are retried; R-SH-4). What goes back
  (``deallocate``, ``let_go``) is returned to the ledger by the link later.
  ``ledger_state()``, ``ledger_since(generation)`` and ``refresh_ledger()``
  tell who else holds what (the Kubernetes plugins' view).
- A grant's tail is ``_grant`` then, only when the ledger must take a
  lease, ``_leased``: the units leave the pool at once; the answer is
  immediate when the link already leases them to the owner (the churn's
  case), else a Future after the link's take; units it could not lease go
  back to the pool, and a count tries other units (bounded by the managed
  units) before it is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from runtime import Future, Promise

from actors.ledger import describe_conflicts
from actors.mig import Unit

from . import _metrics
from ._errors import AllocatorError
from ._ledger_link import LINGER, LedgerLink
from ._ledger_state import LedgerState, unit_names

__all__ = ["LedgerCalls"]

class LedgerCalls:
    """The allocator's node-ledger calls (see module rules); state lives on the process."""

    total: frozenset[Unit]
    free: set[Unit]
    allocated: set[Unit]
    unhealthy: dict[Unit, str]
    inventory: Any
    ledger_link: LedgerLink | None
    _elsewhere: frozenset[Unit]
    _ledger_metrics: Any

    def _ledger_fields(self) -> dict[str, Any]:
        link = self.ledger_link
        if link is None:
            return {}
        return {"node_ledger": link.path, "ledger_owner": link.owner,
                "held_elsewhere": {str(unit): conflict.describe() for unit, conflict in sorted(link.elsewhere.items())},
                "inherited": [str(unit) for unit in sorted(link.inherited)]}

    def _grant(self, units: set[Unit], holder: str | None) -> bool:
        """``units``, chosen and checked available, now allocated to ``holder``;
        whether that is the whole answer (no ledger, or the owner leases them
        already: the churn's case, no file work); else ``_leased`` answers."""
        link = self.ledger_link
        covered = link is None or link.grant(units, holder)
        self.free.difference_update(units)
        self.allocated.update(units)
        return covered or not units

    def _leased(self, units: set[Unit], again: Callable[[], Any], tries: int, answer: Any) -> Future:
        """``answer`` once the ledger holds ``units`` (just granted, see
        ``_grant``); ``again`` is the grant asked anew, ``tries`` how often it was."""
        link = self.ledger_link
        assert link is not None
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
                link.conflicts += 1
                promise.fail(AllocatorError(refused(result.conflicts)))

        link.take(units, False, on_result)
        return promise.future

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

    def release_unclaimed(self) -> Any:
        """Recovery is done: every unit inherited from an earlier run and not
        reclaimed goes back (see module rules); what went back, as text, once
        the ledger has them back (a Future when there were any)."""
        link = self.ledger_link
        if link is None:
            return []
        units, unmanaged = link.release_unclaimed()
        returned = [str(unit) for unit in sorted(units)] + sorted(unmanaged)
        if not returned:
            return returned
        return link.returned().then(lambda _: returned)

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

    def _put_back(self, units: Iterable[Unit]) -> None:
        """Units a grant took from the pool but could not lease: back in the pool."""
        units = set(units) & self.allocated
        self.allocated.difference_update(units)
        self.free.update(units)
        if self.ledger_link is not None:
            self.ledger_link.unused(units)


def _as_future(fn: Callable[[], Any]) -> Future:
    """``fn()`` as a Future (its value, the Future it returned, or its failure)."""
    try:
        value = fn()
    except Exception as error:
        return Future.failed(error)
    return value if isinstance(value, Future) else Future.ready(value)


def refused(conflicts: Iterable[Any]) -> str:
    """A grant refused because another owner of the node holds its units."""
    return "Held by another front door of this node: " + describe_conflicts(conflicts)
