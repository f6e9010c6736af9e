"""Allocation units as the isolator sees them: what each needs from the kernel.

Rules (R-MG-2/3; a unit is a whole ``Gpu`` or a ``MigDevice``):
- ``UnitCatalog`` is built once at start from the allocator's pools, the
  inventory and, when any MIG device is managed, the node's capability
  facts (``MigCapabilities``); a MIG device without them fails the start
  with one clear error (``MigCapabilities.require``).
- Device rules: a GPU is ``c 195:<minor> rwm`` (Mesos); a MIG device is its
  parent's rule (the same line, so two holders of one GPU's MIG devices
  share it and nothing else) plus ``c <caps major>:<minor> r`` for its GPU-
  and compute-instance capability nodes. Rules are in unit order; a parent
  shared by two MIG devices of one container appears once.
- A grant is recognised from the kernel's state (recovery, R-IS-7): a GPU
  when the state grants its node read and write; a MIG device when it
  grants its parent read and write and both capability nodes read.
  ``may_use`` is the cautious reading (a unit withheld after an unknown
  kernel outcome goes back only when the state cannot use it): a GPU's
  node readable or writable, one of a MIG device's capability nodes
  readable. A rule
  that grants NVIDIA nodes, or capability nodes, by wildcard makes the
  state "broad" (the recovery planner then keeps only what nobody holds).
- Demand (``demand(resources)``): ``gpus`` from the resources (a range, set
  or fraction → "The 'gpus' resource must be an unsigned integer"), and
  under the ``mixed`` strategy every ``mig-<profile>`` the same way; a
  ``mig-<profile>`` under another strategy is an error naming the flag.
  ``held(units)`` counts units by the resource they belong to, ``fits``
  says whether they are exactly what resources ask for;
  ``surplus(units, demand)`` picks, per resource, the highest units to
  give back (``update`` shrinks highest first, as for GPUs).
- Launch info (``container_files``): a container with its own rootfs gets
  the capability nodes of every MIG device the isolator hands out (copied,
  like every ``/dev/nvidia*`` node in Mesos, so an update needs no new
  node: the cgroup decides what opens) and their capability proc files,
  bound read-only (``MigFiles``).
- Pure once built: no I/O, no actor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import msgspec

from actors.devices import DeviceRule
from actors.gpu import NVIDIA_MAJOR, Gpu
from actors.resources import Resources
from actors.mig import (
    MIG_RESOURCE_PREFIX,
    MigCapabilities,
    MigDevice,
    Unit,
    unit_sort_key,
)

from ._errors import IsolatorError
from ._grant import gpu_rule, gpu_rules, requested_count

__all__ = ["UnitCatalog", "MigFiles"]

GPUS = "gpus"


class MigFiles(msgspec.Struct, frozen=True):
    """What a container with its own rootfs gets of the MIG devices: capability
    nodes to copy (host paths under ``<dev_dir>/nvidia-caps``) and proc files
    to bind read-only (host path, path in the container)."""

    cap_nodes: tuple[str, ...]
    proc_files: tuple[tuple[str, str], ...]


class UnitCatalog:
    """Rules, grants and demand of the units an isolator hands out (see module rules)."""

    def __init__(self, pools: Mapping[str, Iterable[Unit]], caps: MigCapabilities | None = None,
                 strategy: str = "none") -> None:
        self.pools = {name: frozenset(units) for name, units in pools.items()}
        self.strategy = strategy
        self._pool_of = {unit: name for name, units in self.pools.items() for unit in units}
        self._one_pool = len(self.pools) <= 1
        """Every unit counts under ``gpus``."""
        self.mig_devices = frozenset(unit for unit in self._pool_of if isinstance(unit, MigDevice))
        self.has_mig = bool(self.mig_devices)
        """Whether any MIG device is handed out (else the whole-GPU paths apply unchanged)."""
        if self.has_mig:
            if caps is None:
                raise IsolatorError("MIG devices are managed but the node's capability facts were not read")
            caps.require(self.mig_devices)
        self.caps = caps
        self._rules: dict[MigDevice, tuple[DeviceRule, ...]] = {
            device: tuple(caps.mig_device_rules(device)) for device in self.mig_devices
        } if caps is not None else {}
        self.caps_major = caps.major if caps is not None and self.has_mig else None

    # -- the kernel -------------------------------------------------------------
    def rules(self, units: Iterable[Unit]) -> list[DeviceRule]:
        """The device rules granting ``units`` (see module rules)."""
        if not self.has_mig:
            return gpu_rules(units)
        rules: list[DeviceRule] = []
        seen: set[DeviceRule] = set()
        for unit in sorted(units, key=unit_sort_key):
            for rule in (gpu_rule(unit),) if isinstance(unit, Gpu) else self._rules[unit]:
                if rule not in seen:
                    seen.add(rule)
                    rules.append(rule)
        return rules

    def granted(self, state, units: Iterable[Unit]) -> set[Unit]:
        """The units of ``units`` that a cgroup's device state grants."""
        found: set[Unit] = set()
        for unit in units:
            if isinstance(unit, Gpu):
                if state.is_granted("c", unit.major, unit.minor, "rw"):
                    found.add(unit)
                continue
            parent, gi, ci = self._rules[unit]
            if (
                state.is_granted("c", parent.major, parent.minor, "rw")
                and state.is_granted("c", gi.major, gi.minor, "r")
                and state.is_granted("c", ci.major, ci.minor, "r")
            ):
                found.add(unit)
        return found

    def may_use(self, state, unit: Unit) -> bool:
        """Whether a cgroup's state lets it use ``unit`` at all: a GPU's node
        readable or writable; one of a MIG device's capability nodes readable
        (its parent alone may be another MIG device's)."""
        if isinstance(unit, Gpu):
            return state.is_granted("c", unit.major, unit.minor, "r") or state.is_granted(
                "c", unit.major, unit.minor, "w")
        _parent, gi, ci = self._rules[unit]
        return state.is_granted("c", gi.major, gi.minor, "r") or state.is_granted("c", ci.major, ci.minor, "r")

    def covers_by_wildcard(self, rule: DeviceRule) -> bool:
        """Whether an allow rule grants NVIDIA or capability nodes by wildcard."""
        if rule.type not in ("a", "c") or rule.minor is not None:
            return False
        if rule.major in (None, NVIDIA_MAJOR) and ("r" in rule.access or "w" in rule.access):
            return True
        return self.caps_major is not None and rule.major == self.caps_major and "r" in rule.access

    # -- resources --------------------------------------------------------------
    def pool_of(self, unit: Unit) -> str | None:
        return self._pool_of.get(unit)

    def demand(self, resources: Resources) -> dict[str, int]:
        """Units asked for per resource (see module rules)."""
        wanted = {GPUS: requested_count(resources, GPUS)}
        scalars = resources.scalars
        if not resources.others and (not scalars or (len(scalars) == 1 and GPUS in scalars)):
            return wanted  # the common case: nothing but gpus
        for name in (*resources.scalars, *resources.others):
            if not name.startswith(MIG_RESOURCE_PREFIX):
                continue
            if self.strategy != "mixed":
                raise IsolatorError(
                    f"The '{name}' resource is a MIG device resource: it is offered only with"
                    f" '--nvidia_mig_strategy=mixed' (this node runs '{self.strategy}')"
                )
            wanted[name] = requested_count(resources, name)
        return wanted

    def held(self, units: Iterable[Unit]) -> dict[str, int]:
        """How many of ``units`` count under each resource."""
        counts: dict[str, int] = {}
        for unit in units:
            name = self._pool_of.get(unit, GPUS)
            counts[name] = counts.get(name, 0) + 1
        return counts

    def fits(self, units: Iterable[Unit], resources: Resources) -> bool:
        """Whether ``units`` are exactly what ``resources`` ask for (an update with nothing to do)."""
        scalars = resources.scalars
        if self._one_pool and not resources.others and (not scalars or (len(scalars) == 1 and GPUS in scalars)):
            return requested_count(resources, GPUS) == len(units)  # type: ignore[arg-type]  # the hot path
        demand = self.demand(resources)
        held = self.held(units)
        return all(held.get(name, 0) == count for name, count in demand.items()) and all(
            name in demand for name in held)

    def surplus(self, units: Iterable[Unit], demand: Mapping[str, int]) -> set[Unit]:
        """The units to give back so that ``units`` fit ``demand``, highest first per resource."""
        by_pool: dict[str, list[Unit]] = {}
        for unit in units:
            by_pool.setdefault(self._pool_of.get(unit, GPUS), []).append(unit)
        give_back: set[Unit] = set()
        for name, held in by_pool.items():
            extra = len(held) - demand.get(name, 0)
            if extra > 0:
                give_back.update(sorted(held, key=unit_sort_key, reverse=True)[:extra])
        return give_back

    # -- launch info ------------------------------------------------------------
    def container_files(self, dev_dir: str) -> MigFiles | None:
        """The MIG files of a container with its own rootfs (see module rules)."""
        if not self.has_mig:
            return None
        nodes: list[str] = []
        files: list[tuple[str, str]] = []
        for device in sorted(self.mig_devices, key=unit_sort_key):
            nodes += self.caps.cap_node_paths(device, dev_dir)
            for host in self.caps.proc_files(device):
                files.append((host, "/proc/" + os.path.relpath(host, self.caps.proc_dir)))
        return MigFiles(cap_nodes=tuple(nodes), proc_files=tuple(files))

