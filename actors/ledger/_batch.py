"""A batch of lease changes, and the pure decision of what it does to the ledger.

Rules (SPEC R-NL-2):
- One ``LeaseBatch`` is everything one owner asks of the ledger in one
  job: ``takes`` (each a ``TakeRequest``), ``rewrites`` (its own leases
  with new holders) and ``returns`` (UUIDs of its own leases to give back).
  The allocator sends one batch per executor job, never one per lease.
- ``decide(leases, owner, batch)`` is pure: from the leases the ledger
  holds now, the leases after the batch and one ``TakeResult`` per take.
  Returns come first, then rewrites, then the takes in order (a unit a
  return frees can be taken by a take of the same batch).
- Only the owner's own leases are returned or rewritten; a lease of
  another owner under that UUID is left alone (nobody changes another's
  leases: the operator's ``release`` is its own path).
- A take is all or nothing: if any unit is held by another owner (or
  conflicts through its MIG parent or children, ``blocking``), nothing of
  that take is written and its result lists every conflict. A ``partial``
  take (recovery's reclaim, holding back every free unit) takes each unit
  that can be taken and lists the others. A take of a unit the owner
  already leases writes the holders given (the owner's own view of its
  holders is the truth: it replaces what an earlier life of it wrote).
- A take's ``proven`` units are those the owner's own truth outside the
  ledger shows it using now (recovery: the kernel grants its containers
  them). A lease nobody can read (owner ``unreadable:<file>``) of such a
  unit is no conflict for it: the owner re-takes the unit (SPEC R-SH-3: an
  unreadable lease never frees a unit someone uses, and the one who uses it
  takes it back). Anything else's unreadable lease still keeps everyone
  out.
- ``BatchResult`` carries the take results and every lease after the
  batch (so the owner learns what other owners hold at no extra cost), and
  the lease files the batch moved aside (``set_aside``: unreadable lease
  files a proven take replaced, UUID -> the file, where it went and why
  it was unreadable).
"""

from __future__ import annotations

import msgspec

from ._lease import UNREADABLE, Lease, LeaseConflict, blocking

__all__ = ["LeaseBatch", "TakeRequest", "TakeResult", "BatchResult", "decide"]


class TakeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Units to take, as their leases would be written (owner and holders set)."""

    leases: tuple[Lease, ...]
    partial: bool = False
    """Take each unit that can be taken (else: all or none)."""
    proven: tuple[str, ...] = ()
    """UUIDs the owner's own truth shows it using: their unreadable leases are re-taken (see module rules)."""


class LeaseBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One owner's changes for one job (see module rules)."""

    takes: tuple[TakeRequest, ...] = ()
    rewrites: tuple[Lease, ...] = ()
    returns: tuple[str, ...] = ()
    health: dict[str, str] | None = None
    """When set: the units this owner holds unhealthy (UUID -> reason), replacing what it reported before."""

    def empty(self) -> bool:
        return not (self.takes or self.rewrites or self.returns) and self.health is None


class TakeResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one take did: the UUIDs taken and the conflicts that stopped the rest."""

    taken: tuple[str, ...] = ()
    conflicts: tuple[LeaseConflict, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.conflicts


class BatchResult(msgspec.Struct, frozen=True, kw_only=True):
    """The takes' results and every lease after the batch."""

    takes: tuple[TakeResult, ...] = ()
    leases: dict[str, Lease] = {}
    alive: dict[str, bool] = {}
    """Each other owner named by a lease: whether it runs."""
    set_aside: dict[str, tuple[str, str, str]] = {}
    """Unreadable lease files a proven take replaced: UUID -> (the file, where it went, why it was unreadable)."""


def decide(leases: dict[str, Lease], owner: str, batch: LeaseBatch) -> tuple[dict[str, Lease], list[TakeResult]]:
    """The leases after ``batch`` and each take's result (see module rules)."""
    after = dict(leases)
    for uuid in batch.returns:
        lease = after.get(uuid)
        if lease is not None and lease.owner == owner:
            del after[uuid]
    for lease in batch.rewrites:
        current = after.get(lease.unit)
        if current is not None and current.owner == owner:
            after[lease.unit] = lease
    results = []
    for take in batch.takes:
        taken: list[str] = []
        conflicts: list[LeaseConflict] = []
        for lease in take.leases:
            found = blocking(after, lease.unit, lease.parent, owner)
            if found and lease.unit in take.proven:
                found = [other for other in found
                         if not (other.unit == lease.unit and other.owner.startswith(UNREADABLE))]
            if found:
                conflicts += [LeaseConflict(unit=lease.unit, device=lease.device, lease=other) for other in found]
            elif take.partial:
                after[lease.unit] = lease
                taken.append(lease.unit)
        if not take.partial and not conflicts:
            for lease in take.leases:
                after[lease.unit] = lease
            taken = [lease.unit for lease in take.leases]
        results.append(TakeResult(taken=tuple(taken), conflicts=tuple(conflicts)))
    return after, results
