"""How the allocator's node ledger link names units, and what it tells of the ledger.

Rules (SPEC R-NL-1, R-NL-5):
- ``unit_names(inventory, units)``: the ledger names a unit by its NVML
  UUID (a MIG device with its parent GPU's UUID too) and, for people, its
  device (``195:3``, ``195:0/gi1/ci0``); a unit NVML does not list cannot be
  named and is an ``AllocatorError``.
- ``LedgerState`` is a snapshot of what the link knows
  (``GpuAllocatorProcess.ledger_state``): what other owners hold, what this
  owner inherited and leases, its conflicts, jobs and failing jobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from actors.ledger import LeaseConflict
from actors.mig import MigDevice, Unit
from actors.nvml import NodeInventory

from ._errors import AllocatorError

__all__ = ["LedgerState", "UnitName", "unit_names"]


class UnitName(NamedTuple):
    """How the node ledger names one unit."""

    uuid: str
    parent: str | None
    """The parent GPU's UUID (a MIG device), else None."""
    device: str


def unit_names(inventory: NodeInventory, units: Iterable[Unit]) -> dict[Unit, UnitName]:
    """The ledger names of ``units``, from the NVML inventory (UUIDs)."""
    gpus = inventory.by_gpu()
    migs = inventory.by_mig()
    names: dict[Unit, UnitName] = {}
    for unit in units:
        if isinstance(unit, MigDevice):
            info = migs.get(unit)
            parent = gpus.get(unit.parent)
            if info is None or parent is None:
                raise AllocatorError(f"MIG device {unit} is not in the NVML inventory: the node ledger cannot name it")
            names[unit] = UnitName(info.uuid, parent.uuid, str(unit))
        else:
            gpu = gpus.get(unit)
            if gpu is None:
                raise AllocatorError(f"GPU {unit} is not in the NVML inventory: the node ledger cannot name it")
            names[unit] = UnitName(gpu.uuid, None, str(unit))
    return names


class LedgerState:
    """What the allocator's node ledger link knows (``GpuAllocatorProcess.ledger_state``)."""

    __slots__ = ("directory", "owner", "generation", "elsewhere", "inherited", "leased", "conflicts", "jobs",
                 "failing")

    def __init__(self, directory: str, owner: str, generation: int, elsewhere: dict[Unit, LeaseConflict],
                 inherited: frozenset[Unit], leased: frozenset[Unit], conflicts: int, jobs: int,
                 failing: int = 0) -> None:
        self.directory = directory
        self.owner = owner
        self.generation = generation
        """Changes of ``elsewhere`` so far."""
        self.elsewhere = elsewhere
        """Each managed unit another owner keeps from this one -> the lease in the way."""
        self.inherited = inherited
        """Units this owner leases from an earlier life, not reconciled yet."""
        self.leased = leased
        """Managed units this owner leases now (held, or kept a moment before returning)."""
        self.conflicts = conflicts
        """Grants refused so far because another owner held a unit."""
        self.jobs = jobs
        """Executor jobs the link has run (each one batch of file work)."""
        self.failing = failing
        """Jobs failed in a row (0: the last job worked); the link backs off while it is not 0."""

    def __repr__(self) -> str:
        return (f"LedgerState({self.owner} in {self.directory}, generation {self.generation},"
                f" elsewhere {sorted(map(str, self.elsewhere))}, inherited {sorted(map(str, self.inherited))})")
