"""The isolator's view of units (isolators._catalog): rules, grants, demand."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.devices import DeviceRule, Policy
from actors.gpu import Gpu
from actors.mig import MigCapabilityError, MigDevice, read_mig_capabilities
from actors.resources import Resources
from isolators._grant import gpu_rule, requested_count
from isolators._recovery import minors
from isolators._catalog import UnitCatalog
from tests.support.errors import raises_isolator_error

PROC = str(Path(__file__).resolve().parents[2] / "examples" / "h200-mig-proc")
G0, G1 = Gpu(195, 0), Gpu(195, 1)
A, B, C, D = (MigDevice(G0, gi, 0) for gi in (3, 4, 2, 1))  # 1g.18gb x2, 2g.35gb, 3g.71gb
POOLS = {"gpus": {G1}, "mig-1g.18gb": {A, B}, "mig-2g.35gb": {C}, "mig-3g.71gb": {D}}


@pytest.fixture
def catalog() -> UnitCatalog:
    return UnitCatalog(POOLS, read_mig_capabilities(PROC), "mixed")


def test_whole_gpus_keep_meos_rules_and_need_no_capability_facts():
    catalog = UnitCatalog({"gpus": {G0, G1}})
    assert not catalog.has_mig
    assert catalog.rules({G1, G0}) == [gpu_rule(G0), gpu_rule(G1)] == [
        DeviceRule("c", 195, 0, "rwm"), DeviceRule("c", 195, 1, "rwm")
    ]
    assert minors({G1, G0}) == [0, 1]


def test_a_mig_device_needs_its_parent_and_its_two_capabilities(catalog):
    assert catalog.rules({A}) == [
        DeviceRule("c", 195, 0, "rwm"), DeviceRule("c", 239, 30, "r"), DeviceRule("c", 239, 31, "r")
    ]
    # Two MIG devices of one GPU in one container: the parent once.
    assert catalog.rules({B, A}) == [
        DeviceRule("c", 195, 0, "rwm"), DeviceRule("c", 239, 30, "r"), DeviceRule("c", 239, 31, "r"),
        DeviceRule("c", 239, 39, "r"), DeviceRule("c", 239, 40, "r"),
    ]
    assert catalog.rules({G1, D}) == [
        DeviceRule("c", 195, 0, "rwm"), DeviceRule("c", 239, 12, "r"), DeviceRule("c", 239, 13, "r"),
        gpu_rule(G1),
    ]
    assert minors({G1, A}) == ["195:0/gi3/ci0", 1]


def test_a_grant_is_recognised_from_the_parent_and_both_capabilities(catalog):
    control = [DeviceRule("c", 195, 255, "rwm")]
    state = Policy.container(control, catalog.rules({A, G1}))
    everything = set().union(*POOLS.values())
    assert catalog.granted(state, everything) == {A, G1}
    # The parent alone (another container's MIG device) is not a grant of B, C or D.
    only_parent = Policy.container(control, [gpu_rule(G0)])
    assert catalog.granted(only_parent, everything) == set()
    # One capability missing: not a grant.
    partial = Policy.container(control, catalog.rules({A})[:2])
    assert catalog.granted(partial, {A}) == set()
    assert catalog.covers_by_wildcard(DeviceRule("c", 239, None, "r"))
    assert catalog.covers_by_wildcard(DeviceRule("c", 195, None, "rw"))
    assert catalog.covers_by_wildcard(DeviceRule("a"))
    assert not catalog.covers_by_wildcard(DeviceRule("c", None, None, "m"))
    assert not catalog.covers_by_wildcard(DeviceRule("c", 239, 30, "r"))


def test_demand_counts_each_resource_with_clear_errors(catalog):
    assert catalog.demand(Resources.parse("cpus:1;gpus:1;mig-1g.18gb:2")) == {"gpus": 1, "mig-1g.18gb": 2}
    assert catalog.demand(Resources.parse("mem:8")) == {"gpus": 0}
    with raises_isolator_error("The 'mig-1g.18gb' resource must be an unsigned integer"):
        catalog.demand(Resources.parse("mig-1g.18gb:0.5"))
    with raises_isolator_error("The 'gpus' resource must be an unsigned integer"):
        catalog.demand(Resources.parse("gpus:[1-2]"))
    single = UnitCatalog({"gpus": {A, B}}, read_mig_capabilities(PROC), "single")
    with raises_isolator_error() as error:
        single.demand(Resources.parse("mig-1g.18gb:1"))
    assert str(error.value) == (
        "The 'mig-1g.18gb' resource is a MIG device resource: it is offered only with"
        " '--nvidia_mig_strategy=mixed' (this node runs 'single')"
    )
    assert requested_count(Resources.parse("gpus:2"), "gpus") == 2


def test_held_and_surplus_go_by_resource_highest_first(catalog):
    held = {A, B, C, G1}
    assert catalog.held(held) == {"mig-1g.18gb": 2, "mig-2g.35gb": 1, "gpus": 1}
    assert catalog.surplus(held, {"gpus": 1, "mig-1g.18gb": 1, "mig-2g.35gb": 1}) == {B}
    assert catalog.surplus(held, {"gpus": 0}) == held


def test_mig_devices_without_capability_facts_fail_the_start(tmp_path):
    (tmp_path / "devices").write_text("Character devices:\n239 nvidia-caps\n")
    with pytest.raises(MigCapabilityError, match=r"\(4\): MIG device 195:0/gi1/ci0: no line 'gpu0/gi1/access'"):
        UnitCatalog(POOLS, read_mig_capabilities(str(tmp_path)), "mixed")


def test_recovery_recognises_mig_grants_and_keeps_wildcards_to_what_nobody_holds(catalog):
    from isolators._recovery import BROAD, EXACT, plan_recovery
    from isolators._types import ContainerID

    control = [DeviceRule("c", 195, 255, "rwm")]
    states = {
        "a": Policy.container(control, catalog.rules({A})),
        "b": Policy.container(control, catalog.rules({B, G1})),
        # An interrupted start: every capability node by wildcard, the parent exactly.
        "c": Policy.container(control, [gpu_rule(G0), DeviceRule("c", 239, None, "r")]),
    }
    total = set().union(*POOLS.values())
    plan = plan_recovery([ContainerID("a"), ContainerID("b"), ContainerID("c")], states, total, set(),
                         granted=catalog.granted, covers=catalog.covers_by_wildcard)
    kept = {c.container_id.value: (c.kind, set(c.gpus)) for c in plan.containers}
    assert kept == {"a": (EXACT, {A}), "b": (EXACT, {B, G1}), "c": (BROAD, {C, D})}
    assert plan.claim == {A, B, C, D, G1}
    assert plan.report == (
        "Container c: cgroup 'c' grants GPUs beyond exact rules (an interrupted start or a wiped policy);"
        " it keeps GPUs ['195:0/gi1/ci0', '195:0/gi2/ci0'] that no other container holds, and its device"
        " rules are rewritten to exactly those",
    )
