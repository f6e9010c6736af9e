"""Recovery planning is a pure function (``isolators._recovery``): from the
cgroups under the root, each one's device state and what the allocator
holds, to the containers recovered, the GPUs to reclaim, the quarantine and
the report -- tested here without any backend, actor or runtime."""

from __future__ import annotations

from actors import Gpu
from actors.devices import Policy
from isolators import ContainerID
from isolators._recovery import BROAD, EXACT, UNKNOWN, plan_recovery, recovery_candidates

TOTAL = {Gpu(195, i) for i in range(4)}
CONTROL = ["c 195:255 rwm", "c 235:0 rwm"]


def grants(*minors: int) -> Policy:
    return Policy.create([*CONTROL, *(f"c 195:{m} rwm" for m in minors)])


def gpus(*minors: int) -> frozenset[Gpu]:
    return frozenset(Gpu(195, m) for m in minors)


def ids(*names: str) -> list[ContainerID]:
    return [ContainerID(n) for n in names]


def by_id(plan) -> dict[str, tuple[str, list[int]]]:
    return {c.container_id.value: (c.kind, sorted(g.minor for g in c.gpus)) for c in plan.containers}


def test_candidates_named_first_then_orphans_nested_known_and_missing_skipped() -> None:
    nested = ContainerID("child", ContainerID("a"))
    named = ids("a", "gone") + [nested] + ids("known")
    existing = ["a", "a/child", "known", "z-orphan", "lingering", "bad name"]
    candidates, report, missing = recovery_candidates(named, existing, known={"known"}, lingering={"lingering"})
    assert [c.value for c in candidates] == ["a", "z-orphan"]
    assert missing == ids("gone")
    assert report == [
        "cgroup 'bad name' under the isolator root is not a container id; left alone",
        "Container z-orphan: cgroup found under the root but named by no state; recovered as an orphan",
    ]


def test_exact_grants_keep_exactly_their_gpus() -> None:
    plan = plan_recovery(ids("a", "b", "c"), {"a": grants(0), "b": grants(1, 2), "c": grants()}, TOTAL, held=())
    assert by_id(plan) == {"a": (EXACT, [0]), "b": (EXACT, [1, 2]), "c": (EXACT, [])}
    assert plan.claim == gpus(0, 1, 2) and plan.quarantine == frozenset() and plan.report == ()


def test_a_wildcard_grant_keeps_only_what_nobody_else_holds_and_is_reported() -> None:
    wiped = Policy.create(["a *:* rwm"])
    plan = plan_recovery(ids("wiped", "b"), {"wiped": wiped, "b": grants(1)}, TOTAL, held={Gpu(195, 3)})
    assert by_id(plan) == {"b": (EXACT, [1]), "wiped": (BROAD, [0, 2])}  # exact claims first
    assert plan.claim == gpus(0, 1, 2)
    assert plan.report == (
        "Container wiped: cgroup 'wiped' grants GPUs beyond exact rules (an interrupted start or a wiped policy);"
        " it keeps GPUs [0, 2] that no other container holds, and its device rules are rewritten to exactly those",
    )


def test_two_cgroups_granting_one_gpu_never_both_keep_it() -> None:
    plan = plan_recovery(ids("a", "b"), {"a": grants(0, 1), "b": grants(1, 2)}, TOTAL, held=())
    assert by_id(plan) == {"a": (EXACT, [0, 1]), "b": (BROAD, [2])}
    assert plan.claim == gpus(0, 1, 2)


def test_an_exact_grant_of_a_gpu_the_allocator_holds_is_not_claimed_twice() -> None:
    # Before: the reclaim of a held GPU failed half-way through recovery.
    plan = plan_recovery(ids("a"), {"a": grants(0, 1)}, TOTAL, held={Gpu(195, 1)})
    assert by_id(plan) == {"a": (BROAD, [0])}
    assert plan.claim == gpus(0)


def test_unknown_states_share_one_quarantine_of_every_free_gpu() -> None:
    plan = plan_recovery(ids("u1", "a", "u2"), {"u1": None, "a": grants(0), "u2": None}, TOTAL, held={Gpu(195, 3)})
    assert by_id(plan) == {"a": (EXACT, [0]), "u1": (UNKNOWN, [1, 2]), "u2": (UNKNOWN, [1, 2])}
    assert plan.quarantine == gpus(1, 2) and plan.claim == gpus(0, 1, 2)
    assert len(plan.report) == 2 and all("GPUs [1, 2] are kept out of the free pool" in line for line in plan.report)
    assert plan.report[0].startswith("Container u1: cgroup 'u1' exists but its device state is unknown")


def test_nothing_to_recover_is_an_empty_plan() -> None:
    plan = plan_recovery([], {}, TOTAL, held=TOTAL, report=["a line"], missing=ids("gone"))
    assert plan.containers == () and plan.claim == frozenset() and plan.report == ("a line",)
    assert plan.missing == tuple(ids("gone"))
