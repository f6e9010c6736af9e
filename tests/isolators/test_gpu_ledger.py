"""The ledger (``isolators._ledger``): why each unit the isolator took is not
free, and the one rule that frees it -- never while a cgroup may reach it.

Unit tests read like the rules; the property test drives the ledger the way
the isolator does against a model kernel and allocator: random grants,
failures with unknown effects, drift that cannot be repaired, unknown states
at recovery, repairs, read-backs and removals, and after every step no unit
the allocator has free is one a cgroup may reach, and no unit is lost."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from actors import Gpu
from isolators._ledger import GpuLedger, Reach, Released


def gpus(*minors: int) -> frozenset[Gpu]:
    return frozenset(Gpu(195, m) for m in minors)


def released(freed: frozenset = frozenset(), held_back: frozenset = frozenset()) -> Released:
    return Released(frozenset(freed), frozenset(held_back))


# -- the rules, one by one -----------------------------------------------------------------


def test_a_held_unit_is_freed_when_its_cgroup_is_removed() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0, 1))
    assert ledger.held("a") == gpus(0, 1) and ledger.units() == gpus(0, 1)
    assert ledger.removed("a") == released(gpus(0, 1))
    assert not ledger.has("a") and ledger.units() == frozenset()


def test_enforcing_fewer_units_frees_the_rest() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0, 1, 2))
    assert ledger.enforced("a", gpus(0)) == released(gpus(1, 2))
    assert ledger.held("a") == gpus(0)
    assert ledger.enforced("a", frozenset()) == released(gpus(0))
    assert not ledger.has("a")


def test_withheld_units_stay_until_the_kernel_is_made_to_match_the_record() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0))
    ledger.withhold("a", gpus(1, 2))  # a grow whose outcome is unknown
    assert ledger.withheld("a") == gpus(1, 2) and ledger.held("a") == gpus(0)
    assert ledger.enforced("a", gpus(0)) == released(gpus(1, 2))  # reconciled to the record
    assert ledger.withheld("a") == frozenset()


def test_a_grow_that_answered_moves_its_units_into_the_record() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0))
    ledger.withhold("a", gpus(1))
    assert ledger.enforced("a", gpus(0, 1)) == released()
    assert ledger.held("a") == gpus(0, 1) and ledger.withheld("a") == frozenset()


def test_a_read_back_frees_only_what_the_kernel_does_not_grant() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0))
    ledger.withhold("a", gpus(1, 2))
    assert ledger.not_granted("a", gpus(2, 3)) == released(gpus(2))
    assert ledger.withheld("a") == gpus(1)
    assert ledger.not_granted("a", gpus(0)) == released()  # never a held unit
    assert ledger.not_granted("nobody", gpus(1)) == released()


def test_while_a_cgroup_may_reach_any_unit_nothing_is_freed() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0))
    ledger.hold("b", gpus(1))
    ledger.reaches_any("x", Reach.FAILED_PREPARE)
    assert ledger.hold_back(gpus(2, 3)) == released(held_back=gpus(2, 3))  # every free unit, taken
    assert ledger.removed("a") == released(held_back=gpus(0))  # released elsewhere: held back too
    assert ledger.held_back() == gpus(0, 2, 3) and ledger.reaching.get("x") is Reach.FAILED_PREPARE
    assert ledger.removed("x") == released(gpus(0, 2, 3))  # the last one that could reach them is gone
    assert ledger.held_back() == frozenset() and ledger.reaching == {}
    assert ledger.units() == gpus(1)


def test_held_back_units_wait_for_the_last_cgroup_that_may_reach_them() -> None:
    ledger = GpuLedger()
    ledger.reaches_any("u1", Reach.UNKNOWN_STATE)
    ledger.reaches_any("u2", Reach.UNKNOWN_STATE)
    ledger.hold_back(gpus(0, 1))  # the quarantine, shared
    assert ledger.removed("u1") == released()
    assert ledger.held_back() == gpus(0, 1)
    assert ledger.removed("u2") == released(gpus(0, 1))


def test_a_container_of_unknown_state_shows_the_quarantine_as_its_own() -> None:
    ledger = GpuLedger()
    ledger.hold("known", gpus(0))
    ledger.reaches_any("unknown", Reach.UNKNOWN_STATE)
    ledger.reaches_any("drifted", Reach.DRIFT)
    ledger.hold_back(gpus(1, 2))
    assert ledger.shown("unknown") == gpus(1, 2)
    assert ledger.shown("known") == gpus(0) and ledger.shown("drifted") == frozenset()  # its record's own


def test_a_repaired_drift_frees_what_was_held_back_for_it() -> None:
    ledger = GpuLedger()
    ledger.hold("c1", gpus(0))
    ledger.hold("c2", gpus(1))
    ledger.reaches_any("c1", Reach.DRIFT)
    ledger.hold_back(gpus(2, 3))
    assert ledger.removed("c2") == released(held_back=gpus(1))
    assert ledger.enforced("c1", gpus(0)) == released(gpus(1, 2, 3))  # reconciled: the kernel enforces its record
    assert ledger.reaching.get("c1") is None and ledger.held("c1") == gpus(0)


def test_units_taken_when_nobody_reaches_any_more_are_freed_again() -> None:
    ledger = GpuLedger()
    ledger.reaches_any("x", Reach.FAILED_PREPARE)
    assert ledger.removed("x") == released()  # its removal answered before the allocator did
    assert ledger.hold_back(gpus(0, 1)) == released(gpus(0, 1))
    assert ledger.units() == frozenset()


def test_a_unit_is_taken_once() -> None:
    ledger = GpuLedger()
    ledger.hold("a", gpus(0))
    for take in (lambda: ledger.hold("b", gpus(0)), lambda: ledger.withhold("b", gpus(0)),
                 lambda: ledger.hold_back(gpus(0))):
        with pytest.raises(ValueError, match="already in the ledger"):
            take()
    with pytest.raises(ValueError, match="cannot enforce units it does not hold"):
        ledger.enforced("b", gpus(0))
    assert ledger.units() == gpus(0) and ledger.held("a") == gpus(0)


def test_an_owner_with_nothing_has_no_entry() -> None:
    ledger = GpuLedger()
    ledger.hold("a", frozenset())
    ledger.withhold("a", frozenset())
    assert not ledger.has("a") and ledger.owners() == set()
    assert ledger.removed("a") == released() and ledger.enforced("a", frozenset()) == released()


# -- the property: no unit is free while a cgroup may reach it --------------------------------

UNITS = gpus(*range(5))
OWNERS = ("a", "b", "c", "d")
ALL = UNITS
"""What a cgroup of unknown state may reach (the model takes the worst)."""

outcomes = st.sampled_from(["ok", "unknown"])


class LedgerAgainstTheKernel(RuleBasedStateMachine):
    """The isolator's use of the ledger, against a model kernel (what each
    cgroup may reach: the worst that its operations' outcomes allow) and a
    model allocator (the free set). Drift is outside the isolator's sight
    until a reconcile finds it, so it enters with the reconcile that cannot
    repair it."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = GpuLedger()
        self.free: set[Gpu] = set(UNITS)
        self.reach: dict[str, frozenset[Gpu]] = {}  # cgroups that exist, and what they may reach
        self.records: set[str] = set()

    # -- what the isolator does with the ledger's answers --
    def apply(self, release: Released) -> None:
        assert not release.freed & self.free, "freed twice"
        self.free |= release.freed

    def take_free(self) -> None:
        taken, self.free = frozenset(self.free), set()
        self.apply(self.ledger.hold_back(taken))

    def allocate(self, count: int) -> frozenset[Gpu] | None:
        if count > len(self.free):
            return None
        units = frozenset(sorted(self.free)[:count])
        self.free -= units
        return units

    def remove_or_deny(self, owner: str, removal: str, deny: str) -> bool:
        """A cleanup's (or an undo's) kernel work; True once nothing of it reaches a unit."""
        if removal == "removed":
            del self.reach[owner]
            self.apply(self.ledger.removed(owner))
            return True
        if removal == "busy" and deny == "ok":  # processes inside: every unit denied
            self.reach[owner] = frozenset()
            self.apply(self.ledger.enforced(owner, frozenset()))
            return True
        return False  # its effects unknown: it stays as it is

    # -- the rules --
    @precondition(lambda self: len(self.reach) < len(OWNERS))
    @rule(data=st.data(), count=st.integers(0, 3), configure=outcomes,
          removal=st.sampled_from(["removed", "busy", "unknown"]), deny=outcomes)
    def prepare(self, data, count, configure, removal, deny) -> None:
        owner = data.draw(st.sampled_from([o for o in OWNERS if o not in self.reach]))
        units = self.allocate(count)
        if units is None:
            return  # refused: nothing taken
        self.ledger.hold(owner, units)
        if configure == "ok":
            self.reach[owner] = units
            self.records.add(owner)
            return
        self.reach[owner] = ALL  # made, its rules maybe not: it may reach any unit
        self.ledger.reaches_any(owner, Reach.FAILED_PREPARE)
        self.take_free()
        self.remove_or_deny(owner, removal, deny)  # the undo; what stays lingers

    def updatable(self) -> list[str]:
        return sorted(o for o in self.records if self.ledger.reaching.get(o) is not Reach.UNKNOWN_STATE)

    @precondition(lambda self: self.updatable())
    @rule(data=st.data(), count=st.integers(1, 2), outcome=outcomes,
          settle=st.sampled_from(["reconciled", "read", "unknown"]))
    def grow(self, data, count, outcome, settle) -> None:
        """One configure of the whole policy of the units kept and the extra ones."""
        owner = data.draw(st.sampled_from(self.updatable()))
        extra = self.allocate(count)
        if extra is None:
            return
        self.ledger.withhold(owner, extra)
        wanted = self.ledger.held(owner) | extra
        if outcome == "ok":
            self.reach[owner] = wanted
            self.apply(self.ledger.enforced(owner, wanted))
            return
        granted = data.draw(st.sets(st.sampled_from(sorted(extra))))  # any part of it may be in the kernel
        if self.reach[owner] is not ALL:
            self.reach[owner] = self.reach[owner] | frozenset(granted)
        if settle == "reconciled":  # the kernel made to match the record
            self.reach[owner] = self.ledger.held(owner)
            self.apply(self.ledger.enforced(owner, self.ledger.held(owner)))
        elif settle == "read":  # the kernel read back
            self.apply(self.ledger.not_granted(owner, extra - self.reach[owner]))

    @precondition(lambda self: any(self.ledger.held(o) for o in self.updatable()))
    @rule(data=st.data(), outcome=outcomes)
    def shrink(self, data, outcome) -> None:
        """One configure of the whole policy of the units kept; then the surplus goes."""
        owner = data.draw(st.sampled_from([o for o in self.updatable() if self.ledger.held(o)]))
        held = sorted(self.ledger.held(owner))
        keep = frozenset(data.draw(st.sets(st.sampled_from(held), max_size=len(held) - 1)))
        if outcome == "ok":
            self.reach[owner] = keep
            self.apply(self.ledger.enforced(owner, keep))
        # unknown: a mix of the old rules and the new; the record keeps every unit

    @precondition(lambda self: self.records)
    @rule(data=st.data(), removal=st.sampled_from(["removed", "busy", "unknown"]), deny=outcomes)
    def cleanup(self, data, removal, deny) -> None:
        owner = data.draw(st.sampled_from(sorted(self.records)))
        if self.remove_or_deny(owner, removal, deny):
            self.records.discard(owner)

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def drift_found_unrepairable(self, data) -> None:
        owner = data.draw(st.sampled_from(sorted(self.records)))
        self.reach[owner] = ALL
        self.ledger.reaches_any(owner, Reach.DRIFT)
        self.take_free()

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def reconcile(self, data) -> None:
        """The kernel made to enforce the record (a drift repaired, withheld units settled)."""
        owner = data.draw(st.sampled_from(sorted(self.records)))
        if self.ledger.reaching.get(owner) is Reach.UNKNOWN_STATE:
            return  # only a cleanup ends it
        self.reach[owner] = self.ledger.held(owner)
        self.apply(self.ledger.enforced(owner, self.ledger.held(owner)))

    @precondition(lambda self: len(self.reach) < len(OWNERS))
    @rule(data=st.data())
    def recovered_of_unknown_state(self, data) -> None:
        owner = data.draw(st.sampled_from([o for o in OWNERS if o not in self.reach]))
        self.reach[owner] = ALL
        self.records.add(owner)
        self.ledger.reaches_any(owner, Reach.UNKNOWN_STATE)
        self.take_free()

    @precondition(lambda self: set(self.reach) - self.records)
    @rule(data=st.data(), removal=st.sampled_from(["removed", "busy", "unknown"]), deny=outcomes)
    def lingering_retried(self, data, removal, deny) -> None:
        owner = data.draw(st.sampled_from(sorted(set(self.reach) - self.records)))
        if not self.ledger.has(owner) and removal != "removed":
            return
        self.remove_or_deny(owner, removal, deny)

    # -- what must always hold --
    @invariant()
    def no_free_unit_is_reachable(self) -> None:
        for owner, reach in self.reach.items():
            assert not reach & self.free, f"{sorted(reach & self.free)} free while {owner}'s cgroup may reach them"

    @invariant()
    def no_unit_is_lost_or_taken_twice(self) -> None:
        assert self.ledger.units() | self.free == UNITS
        assert not self.ledger.units() & self.free
        seen: set[Gpu] = set()
        for owner in self.ledger.owners():
            mine = self.ledger.held(owner) | self.ledger.withheld(owner)
            assert not mine & seen, f"{sorted(mine & seen)} held for two cgroups"
            seen |= mine
        assert not self.ledger.held_back() & seen

    @invariant()
    def held_back_only_while_a_cgroup_may_reach_any(self) -> None:
        """Nothing is held back without need: only while the model has a cgroup that may reach any unit."""
        if not any(reach is ALL for reach in self.reach.values()):
            assert self.ledger.held_back() == frozenset() and self.ledger.reaching == {}

    def teardown(self) -> None:
        """Every cgroup removed at last: every unit is free again (none leaked)."""
        for owner in sorted(self.reach):
            self.remove_or_deny(owner, "removed", "ok")
        assert self.free == set(UNITS) and self.ledger.units() == frozenset()


def test_no_unit_is_ever_free_while_a_cgroup_may_reach_it() -> None:
    run_state_machine_as_test(
        LedgerAgainstTheKernel,
        settings=settings(max_examples=300, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
