"""Recovery planning: from what the kernel says to a plan.

Rules (Mesos ``NvidiaGpuIsolatorProcess::recover``, R-IS-7, plus what Mesos
never finished). Pure: no actor, no I/O; the isolator gathers the facts,
asks ``plan_recovery`` and carries the plan out.
- Which cgroups: every top-level container named by a state or as an orphan
  whose cgroup exists, and every other cgroup directly under the root that
  the isolator does not know (neither a record nor a cgroup a cleanup had
  to leave) is reported ("recovered as an orphan"); one whose name is not a
  valid container id is reported and left alone. Nested ids are skipped
  (they share their parent's cgroup), so are ids the isolator has a record
  of; a named cgroup
  that does not exist is a warning (``missing``), not an error.
- Exact grants first: a cgroup whose rules grant GPUs one by one, none of
  them claimed by another container nor held in the allocator already,
  keeps exactly those GPUs.
- Broad grants next: a cgroup granting GPUs by wildcard (a crash between its
  mkdir and its rules, a wiped policy), or GPUs someone else holds, keeps
  only the GPUs it may use that nobody holds; its rules are rewritten to
  exactly those (reported). No GPU is ever granted to two containers.
- Unknown device states last (v2: a program of ours the kernel holds that
  cannot be read back as one of ours): each
  may use any GPU, so every GPU nobody holds goes into ONE quarantine that
  they all share; none goes back to the pool before the last of them is
  cleaned up (reported, one line each).
- Units (R-MG-3): ``granted(state, units)`` says which units a cgroup's
  state grants and ``covers(rule)`` whether a rule grants them by wildcard
  (defaults: whole GPUs by ``c 195:<minor>`` read and write; a
  ``UnitCatalog`` also recognises a MIG device from its parent node and its
  two capability nodes). Report lines name whole GPUs by minor and MIG
  devices as ``195:0/gi3/ci0``.
- The plan: the containers in that order (exact, broad, unknown), each with
  the GPUs it keeps and whether its rules must be reconciled (every one
  whose device state is known); the GPUs to reclaim from the allocator in
  one call; the quarantine; the report lines, in order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import msgspec

from actors import NVIDIA_MAJOR, Gpu
from actors.devices import Policy, DeviceRule

from ._types import ContainerID

EXACT = "exact"
BROAD = "broad"
UNKNOWN = "unknown"


class RecoveredContainer(msgspec.Struct, frozen=True):
    """One container the plan recovers."""

    container_id: ContainerID
    cgroup: str
    gpus: frozenset[Gpu]
    """The GPUs it keeps (for UNKNOWN: the shared quarantine)."""
    kind: str
    """EXACT, BROAD or UNKNOWN (see the module rules)."""


class RecoveryPlan(msgspec.Struct, frozen=True):
    """What recovery does (see the module rules)."""

    containers: tuple[RecoveredContainer, ...]
    claim: frozenset[Gpu]
    """Every GPU to reclaim from the allocator (one call)."""
    quarantine: frozenset[Gpu]
    """GPUs held back for the containers of unknown device state."""
    report: tuple[str, ...]
    missing: tuple[ContainerID, ...]
    """Named containers whose cgroup does not exist (a warning each)."""


def recovery_candidates(named: Iterable[ContainerID], existing: Iterable[str], known: Iterable[str],
                        lingering: Iterable[str] = ()) -> tuple[list[ContainerID], list[str], list[ContainerID]]:
    """Which containers to read the device state of.

    ``named``: the ids of the states, then the orphans; ``existing``: the
    cgroups directly under the root; ``known``: the ids the isolator has a
    record of (skipped); ``lingering``: the ids whose cgroup a cleanup had to
    leave (never taken for orphans). Returns the containers (named ones first, then
    the unnamed cgroups), the report lines, and the named ids whose cgroup is
    missing."""
    existing = {c for c in existing if "/" not in c}  # nested cgroups belong to their parent
    known = set(known)
    named = list(named)
    report: list[str] = []
    seen = {cid.value for cid in named if not cid.has_parent()} | known | set(lingering)
    unnamed: list[ContainerID] = []
    for name in sorted(existing - seen):
        try:
            cid = ContainerID(name)
        except ValueError:
            report.append(f"cgroup '{name}' under the isolator root is not a container id; left alone")
            continue
        report.append(f"Container {cid}: cgroup found under the root but named by no state; recovered as an orphan")
        unnamed.append(cid)
    candidates: list[ContainerID] = []
    missing: list[ContainerID] = []
    taken: set[str] = set()
    for cid in named + unnamed:
        if cid.has_parent() or cid.value in known or cid.value in taken:
            continue
        if cid.value not in existing:
            missing.append(cid)
            continue
        taken.add(cid.value)
        candidates.append(cid)
    return candidates, report, missing


def plan_recovery(candidates: Iterable[ContainerID], states: Mapping[str, Policy | None],
                  total: Iterable[Gpu], held: Iterable[Gpu], report: Iterable[str] = (),
                  missing: Iterable[ContainerID] = (), *,
                  granted: Callable[[Policy, Iterable[Any]], set] | None = None,
                  covers: Callable[[DeviceRule], bool] | None = None) -> RecoveryPlan:
    """The recovery plan for ``candidates`` (see the module rules).

    ``states``: each candidate cgroup's device state (None when unknown);
    ``total``: the managed GPUs; ``held``: the GPUs the allocator has handed
    out already; ``report``/``missing``: from ``recovery_candidates``."""
    total = sorted(set(total))
    held = set(held)
    covers = covers if covers is not None else covers_gpus
    lines = list(report)
    exact: list[RecoveredContainer] = []
    broad: list[tuple[ContainerID, str, set[Gpu]]] = []
    unknown: list[tuple[ContainerID, str]] = []
    claimed: set[Gpu] = set()
    for cid in candidates:
        cgroup = cid.path()
        state = states.get(cgroup)
        if state is None:
            unknown.append((cid, cgroup))
            continue
        if granted is None:
            gpus = {g for g in total if state.is_granted("c", g.major, g.minor, "rw")}
        else:
            gpus = granted(state, total)
        if gpus & (claimed | held) or any(covers(rule) for rule in state.allow):
            broad.append((cid, cgroup, gpus))
            continue
        claimed |= gpus
        exact.append(RecoveredContainer(cid, cgroup, frozenset(gpus), EXACT))
    containers = list(exact)
    for cid, cgroup, may_use in broad:
        keep = frozenset(g for g in may_use if g not in held and g not in claimed)
        claimed |= keep
        containers.append(RecoveredContainer(cid, cgroup, keep, BROAD))
        lines.append(
            f"Container {cid}: cgroup '{cgroup}' grants GPUs beyond exact rules"
            f" (an interrupted start or a wiped policy); it keeps GPUs {minors(keep)} that no other"
            " container holds, and its device rules are rewritten to exactly those"
        )
    quarantine: frozenset[Gpu] = frozenset()
    if unknown:
        quarantine = frozenset(g for g in total if g not in held and g not in claimed)
        claimed |= quarantine
    for cid, cgroup in unknown:
        containers.append(RecoveredContainer(cid, cgroup, quarantine, UNKNOWN))
        lines.append(
            f"Container {cid}: cgroup '{cgroup}' exists but its device state is unknown"
            f" (its device rules cannot be read back); GPUs {minors(quarantine)} are kept out of the free pool until"
            " it (and every other container of unknown state) is cleaned up"
        )
    return RecoveryPlan(
        containers=tuple(containers), claim=frozenset(claimed), quarantine=quarantine,
        report=tuple(lines), missing=tuple(missing),
    )


def covers_gpus(rule: DeviceRule) -> bool:
    """Whether an allow rule grants read or write to NVIDIA devices by wildcard."""
    return (
        rule.type in ("a", "c")
        and rule.major in (None, NVIDIA_MAJOR)
        and rule.minor is None
        and ("r" in rule.access or "w" in rule.access)
    )


def minors(gpus: Iterable[Gpu]) -> list:
    """The minors of ``gpus``, sorted (for log and report lines); a MIG device
    is written ``195:0/gi3/ci0``, after its parent's minor."""
    units = sorted(gpus)
    if all(type(g) is Gpu for g in units):
        return [g.minor for g in units]
    return [g.minor if isinstance(g, Gpu) else str(g) for g in units]
