"""A lease: one unit of the node held by one owner, for its holders.

Rules (SPEC R-NL-1, R-NL-2):
- ``Lease`` is what one lease file holds: the unit's UUID, the ``owner``
  (``<kind>:<name>``), the ``holders`` inside that owner (container ids,
  claim uids, pods; empty while the owner keeps a unit it no longer uses
  and is about to return), ``parent`` (the GPU's UUID for a MIG device,
  None for a whole GPU) and ``device`` (``195:3``, ``195:0/gi1/ci0``: for
  people). A msgspec Struct, encoded as JSON.
- Conflicts: a unit is held by at most one owner; a MIG device and its
  parent GPU conflict. ``blocking(leases, uuid, parent, owner)`` lists the
  leases of *other* owners that keep ``owner`` from taking the unit: the
  unit's own lease, the parent GPU's lease (a MIG device), or the leases of
  the GPU's MIG devices (a whole GPU).
- ``LeaseConflict`` is one refusal: the unit asked for and the lease in
  the way, with whether its owner runs (None: not known).
  ``describe()`` is the text every refusal uses, naming the unit (UUID),
  the owner and its holders, and what to do when the owner is gone (or,
  for a lease file nobody can read, owned by ``unreadable:<file>``: that
  the operator removes the file once no container uses the unit).
- ``describe_conflicts(conflicts)`` is the text of a refusal of several
  units (SPEC R-SH-5): each other owner named once, with its units and
  their holders, its state and what to do about it -- one sentence an
  owner, ``; `` between owners, in the order they first appear. An owner in
  the way of one unit reads as that conflict's ``describe()``; of several,
  ``<units> are held by <owner> (<state>) for <holders>`` when their
  holders are the same, else ``(<devices> for <holders>; ...)`` after the
  owner. A unit in the way through another one (a MIG device and its
  parent) is listed as ``<asked> through <held>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

__all__ = ["Lease", "LeaseConflict", "blocking", "describe_conflicts", "UNREADABLE", "unreadable_help"]

UNREADABLE = "unreadable:"
"""The owner a lease file nobody can read holds its unit for (``unreadable:<file>``)."""


def unreadable_help(owner: str) -> str | None:
    """What an operator does about a lease of ``owner`` when it is an unreadable file's (else None)."""
    if not owner.startswith(UNREADABLE):
        return None
    return (f"its lease file cannot be read; once no container uses the unit, remove"
            f" {owner[len(UNREADABLE):]}")


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """One unit held by one owner (see module rules)."""

    unit: str
    """The unit's UUID (``GPU-…`` or ``MIG-…``)."""
    owner: str
    holders: tuple[str, ...] = ()
    parent: str | None = None
    """The parent GPU's UUID when the unit is a MIG device."""
    device: str = ""
    """The unit as people write it: ``195:3`` or ``195:0/gi1/ci0``."""

    def named(self) -> str:
        """``GPU-… (195:3)``."""
        return f"{self.unit} ({self.device})" if self.device else self.unit

    def held_for(self) -> str:
        """``for c1, c2``, or what an empty holder list means."""
        if self.holders:
            return "for " + ", ".join(self.holders)
        return "with no holder (its owner keeps it for a moment before returning it, or is recovering)"


class LeaseConflict(msgspec.Struct, frozen=True, kw_only=True):
    """A unit that could not be taken, and the lease in the way."""

    unit: str
    """The UUID asked for."""
    device: str = ""
    lease: Lease
    alive: bool | None = None
    """Whether the lease's owner runs (its lock is held); None: not known."""

    def describe(self) -> str:
        asked, state = self.asked(), self.owner_state()
        if self.lease.unit == self.unit:
            return f"{asked} is held by {self.lease.owner}{state} {self.lease.held_for()}"
        return (f"{asked} conflicts with {self.lease.named()}, held by {self.lease.owner}{state}"
                f" {self.lease.held_for()}")

    def asked(self) -> str:
        """``GPU-… (195:3)``: the unit asked for."""
        return f"{self.unit} ({self.device})" if self.device else self.unit

    def owner_state(self) -> str:
        """`` (running)``, or what to do about an owner that is gone (empty: not known)."""
        unreadable = unreadable_help(self.lease.owner)
        if unreadable is not None:
            return f" ({unreadable})"
        if self.alive is None:
            return ""
        if self.alive:
            return " (running)"
        return (" (not running: its units wait for it to restart and reconcile, or for"
                f" 'gpu-isolator ledger release --owner {self.lease.owner}')")


def describe_conflicts(conflicts: Iterable[LeaseConflict]) -> str:
    """A refusal of several units: each other owner once, with its units (see module rules)."""
    by_owner: dict[str, list[LeaseConflict]] = {}
    for conflict in conflicts:
        by_owner.setdefault(conflict.lease.owner, []).append(conflict)
    return "; ".join(_owner_holds(group) for group in by_owner.values())


def _owner_holds(group: list[LeaseConflict]) -> str:
    """One owner's sentence of a refusal."""
    if len(group) == 1:
        return group[0].describe()
    first = group[0]
    units = ", ".join(c.asked() if c.lease.unit == c.unit else f"{c.asked()} through {c.lease.named()}"
                      for c in group)
    by_holders: dict[str, list[str]] = {}
    for conflict in group:
        by_holders.setdefault(conflict.lease.held_for(), []).append(conflict.lease.device or conflict.lease.unit)
    if len(by_holders) == 1:
        held = first.lease.held_for()
    else:
        held = "(" + "; ".join(f"{', '.join(devices)} {held_for}" for held_for, devices in by_holders.items()) + ")"
    return f"{units} are held by {first.lease.owner}{first.owner_state()} {held}"


def blocking(leases: Mapping[str, Lease], uuid: str, parent: str | None, owner: str) -> list[Lease]:
    """The leases of other owners that keep ``owner`` from taking ``uuid`` (see module rules)."""
    found = []
    own = leases.get(uuid)
    if own is not None and own.owner != owner:
        found.append(own)
    if parent is not None:
        above = leases.get(parent)
        if above is not None and above.owner != owner:
            found.append(above)
    else:
        for lease in leases.values():
            if lease.parent == uuid and lease.owner != owner:
                found.append(lease)
    return found
