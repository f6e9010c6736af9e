"""GpuLedger: every unit the isolator took from the allocator, and why it is not free.

Rules (R-IS-3/4/6/7, R-DV-5; issue 20 items 2 and 5, issue 29):
- A unit (a whole ``Gpu`` or a ``MigDevice``) is free only when no cgroup
  may reach it. The allocator owns the free set; this ledger holds, for
  every unit the isolator took from it, the reason it is not free:
  *held* by a container (its record grants it), *withheld* for a
  container whose kernel state for it is unknown (its grant is under way,
  or an operation failed with its effects unknown), or *held back* while a
  cgroup may reach any unit. A cgroup may reach any unit when a prepare's
  configure failed part-way (v1 then allows what its parent allows, v2 has
  no program), when drift could not be repaired, or when its device state
  was unknown at recovery (the held-back units are then the quarantine,
  shown as that container's).
- One way in, one way out. Units come in from the allocator (``hold``,
  ``withhold``, ``hold_back``); they leave only by a statement of what the
  kernel now grants (``enforced``, ``not_granted``, ``removed``), and every
  such statement routes the units it lets go through one rule: while any
  cgroup may reach any unit they stay, held back; otherwise they are
  freed. Each returns a ``Released``: ``freed`` (give them back to the
  allocator now) and ``held_back`` (kept). Nothing else frees a unit.
- After ``reaches_any`` the caller takes every free unit from the
  allocator at once (before anything else can be handed out) and gives
  them to ``hold_back``; a ``hold_back`` that comes when nobody may reach
  any unit any more frees them again.
- Owners are cgroups (a container's, or one left behind after its record
  went): the ledger does not know records, only what each cgroup may reach.
- Pure: no I/O, no actor, no logging; the isolator calls the allocator and
  the kernel and tells the ledger what it learnt.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from actors.mig import Unit

__all__ = ["GpuLedger", "Reach", "Released"]

Owner = Hashable
"""A cgroup the isolator answers for, by its container id."""


class Reach:
    """Why a cgroup may reach any unit: one of ``FAILED_PREPARE``, ``DRIFT``
    and ``UNKNOWN_STATE`` (compared by identity; a plain class, not an
    ``enum.Enum``, whose member lookups cost a call on the hot path)."""

    __slots__ = ("name", "why")

    FAILED_PREPARE: "Reach"
    DRIFT: "Reach"
    UNKNOWN_STATE: "Reach"

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.why = why

    def __repr__(self) -> str:
        return f"Reach.{self.name}"


Reach.FAILED_PREPARE = Reach("FAILED_PREPARE", "its prepare failed part-way, so the cgroup may exist without its"
                             " device rules")
Reach.DRIFT = Reach("DRIFT", "its device rules drifted and could not be repaired")
Reach.UNKNOWN_STATE = Reach("UNKNOWN_STATE", "its device state was unknown at recovery")

_EMPTY: frozenset = frozenset()


class Released(NamedTuple):
    """The units a statement let go: ``freed`` go back to the allocator now;
    ``held_back`` stay, held back for a cgroup that may reach any unit."""

    freed: frozenset[Unit]
    held_back: frozenset[Unit]


NOTHING = Released(frozenset(), frozenset())
"""What a statement that let nothing go returns."""


class GpuLedger:
    """Why each unit the isolator took is not free (see the module rules)."""

    __slots__ = ("_held", "_withheld", "_reaching", "_held_back", "reaching")

    def __init__(self) -> None:
        # Invariant: each value is non-empty; the units of every _held and
        # _withheld value and _held_back are pairwise disjoint (the allocator
        # gave each unit once); a unit is in the ledger iff the allocator has
        # it allocated for this isolator.
        self._held: dict[Owner, frozenset[Unit]] = {}
        """Per owner: the units its record grants (a prepare's, before its
        configure answered too: they are its either way)."""
        # Invariant: each value is non-empty and disjoint from the owner's
        # _held; the owner's cgroup may grant any of them.
        self._withheld: dict[Owner, set[Unit]] = {}
        """Per owner: units taken for it beyond its record whose kernel state is
        unknown (a grow under way, or one whose operation failed)."""
        self._reaching: dict[Owner, Reach] = {}
        """Owners whose cgroup may reach any unit, and why."""
        self.reaching: Mapping[Owner, Reach] = MappingProxyType(self._reaching)
        """``_reaching``, read-only: ``reaching.get(owner)`` is why ``owner``'s
        cgroup may reach any unit (None: only its own)."""
        # Invariant: empty whenever _reaching is (the last owner to stop
        # reaching any unit frees them).
        self._held_back: set[Unit] = set()
        """Units no owner holds or withholds, kept because a cgroup may reach any unit."""

    # -- what the ledger says ------------------------------------------------------
    def held(self, owner: Owner) -> frozenset[Unit]:
        """The units ``owner``'s record grants."""
        return self._held.get(owner, _EMPTY)

    def withheld(self, owner: Owner) -> frozenset[Unit]:
        """The units withheld for ``owner`` (its kernel state for them unknown)."""
        return frozenset(self._withheld.get(owner, ()))

    def held_back(self) -> frozenset[Unit]:
        """The units held back while a cgroup may reach any unit."""
        return frozenset(self._held_back)

    def shown(self, owner: Owner) -> frozenset[Unit]:
        """The units ``owner``'s record shows as its own: those it holds, or,
        its device state unknown at recovery, every unit held back (the
        quarantine)."""
        if self._reaching.get(owner) is Reach.UNKNOWN_STATE:
            return frozenset(self._held_back)
        return self._held.get(owner, _EMPTY)

    def has(self, owner: Owner) -> bool:
        """Whether ``owner`` holds, withholds or may reach anything."""
        return owner in self._held or owner in self._withheld or owner in self._reaching

    def owners(self) -> set[Owner]:
        """Every owner the ledger answers for."""
        return set(self._held) | set(self._withheld) | set(self._reaching)

    def units(self) -> frozenset[Unit]:
        """Every unit in the ledger (what the allocator has allocated for the isolator)."""
        every = set(self._held_back)
        for units in self._held.values():
            every |= units
        for units in self._withheld.values():
            every |= units
        return frozenset(every)

    # -- units coming in -------------------------------------------------------------
    def hold(self, owner: Owner, units: Iterable[Unit]) -> None:
        """The allocator gave ``units`` for ``owner``'s record (a prepare, a recovery)."""
        if units:
            units = frozenset(units)
            self._check_new(units)
            self._held[owner] = self._held.get(owner, _EMPTY) | units

    def withhold(self, owner: Owner, units: Iterable[Unit]) -> None:
        """The allocator gave ``units`` for ``owner`` beyond its record (a grow
        under way): its cgroup may be granted them, whatever the outcome."""
        units = frozenset(units)
        if units:
            self._check_new(units)
            self._withheld.setdefault(owner, set()).update(units)

    def reaches_any(self, owner: Owner, reach: Reach) -> None:
        """``owner``'s cgroup may reach any unit: from now on every unit let go
        is held back; the caller takes every free unit (``hold_back``)."""
        self._reaching[owner] = reach

    def hold_back(self, units: Iterable[Unit]) -> Released:
        """The allocator gave ``units`` (every free one) to keep while a cgroup
        may reach any unit; freed again at once if none may any more."""
        units = frozenset(units)
        self._check_new(units)
        return self._let_go(units)

    # -- units going out: what the kernel now grants -----------------------------------
    def enforced(self, owner: Owner, units: Iterable[Unit]) -> Released:
        """The kernel enforces exactly ``units`` for ``owner`` (a whole policy
        written, or the record reconciled): its record holds them, and its
        cgroup reaches nothing else of its own any more."""
        units = frozenset(units)
        mine = self.held(owner) | self.withheld(owner)
        if not units <= mine:
            raise ValueError(f"{owner}: cannot enforce units it does not hold: {sorted(units - mine)}")
        self._withheld.pop(owner, None)
        if units:
            self._held[owner] = units
        else:
            self._held.pop(owner, None)
        self._reaching.pop(owner, None)
        return self._let_go(mine - units)

    def not_granted(self, owner: Owner, units: Iterable[Unit]) -> Released:
        """Read back: ``owner``'s cgroup does not grant ``units``; those withheld for it go."""
        withheld = self._withheld.get(owner)
        if not withheld:
            return NOTHING
        going = withheld & set(units)
        withheld -= going
        if not withheld:
            del self._withheld[owner]
        return self._let_go(frozenset(going))

    def removed(self, owner: Owner) -> Released:
        """``owner``'s cgroup is gone: it reaches nothing."""
        if owner not in self._held and owner not in self._withheld and owner not in self._reaching:
            return NOTHING
        going = self._held.pop(owner, frozenset()) | frozenset(self._withheld.pop(owner, ()))
        self._reaching.pop(owner, None)
        return self._let_go(going)

    # -- the one rule ---------------------------------------------------------------
    def _let_go(self, units: frozenset[Unit]) -> Released:
        """Units no owner holds or withholds any more: held back while a cgroup
        may reach any unit, else freed (with those held back before)."""
        if self._reaching:
            self._held_back |= units
            return Released(frozenset(), units)
        if self._held_back:
            units = units | frozenset(self._held_back)
            self._held_back = set()
        return Released(units, frozenset()) if units else NOTHING

    def _check_new(self, units: frozenset[Unit]) -> None:
        taken = units & self.units()
        if taken:
            raise ValueError(f"units already in the ledger: {sorted(taken)}")
