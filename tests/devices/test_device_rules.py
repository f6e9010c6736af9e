"""The pure rule model: parsing, normalisation, is_granted, the reconfigure diff."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from actors.devices import STANDARD_CONTAINER_DEVICES, Policy, DeviceRule, DeviceRuleError, apply_diff
from actors.devices import container_policy, is_granted, normalize
from actors.devices._rules import check_diff
from tests.support.rules import ACCESSES, every_rule, exact

R = DeviceRule.parse

# -- parsing and printing ------------------------------------------------------


@pytest.mark.parametrize(
    "text, rule",
    [
        ("c 195:0 rwm", DeviceRule("c", 195, 0, "rwm")),
        ("b 7:* r", DeviceRule("b", 7, None, "r")),
        ("c *:3 w", DeviceRule("c", None, 3, "w")),
        ("c *:* m", DeviceRule("c", None, None, "m")),
        ("a", DeviceRule("a", None, None, "rwm")),
        ("a *:* rw", DeviceRule("a", None, None, "rw")),
        ("c 195:0 mwr", DeviceRule("c", 195, 0, "rwm")),
        ("  c   1:3   rw  ", DeviceRule("c", 1, 3, "rw")),
    ],
)
def test_parse(text: str, rule: DeviceRule) -> None:
    assert DeviceRule.parse(text) == rule


def test_str_is_the_v1_line_and_round_trips() -> None:
    assert str(R("a")) == "a *:* rwm"
    assert str(R("c 195:0 wr")) == "c 195:0 rw"
    assert str(R("c *:7 m")) == "c *:7 m"
    for line in ("c 195:0 rwm", "b 7:* r", "c *:3 w", "a *:* rwm", "c 4095:1048575 m"):
        assert str(R(line)) == line
        assert R(str(R(line))) == R(line)


def test_access_is_kept_in_rwm_order_also_when_constructed_or_decoded() -> None:
    assert DeviceRule("c", 1, 3, "mwr").access == "rwm"
    decoded = msgspec.json.decode(b'{"type":"c","major":1,"minor":3,"access":"wr"}', type=DeviceRule)
    assert decoded == DeviceRule("c", 1, 3, "rw")
    assert msgspec.json.decode(msgspec.json.encode(R("c 195:2 rw")), type=DeviceRule) == R("c 195:2 rw")
    assert hash(DeviceRule("c", 1, 3, "mwr")) == hash(R("c 1:3 rwm"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "expected '{a|b|c} <major|*>:<minor|*> <access>' or 'a'"),
        ("c 195:0", "expected '{a|b|c} <major|*>:<minor|*> <access>' or 'a'"),
        ("c 195:0 rwm extra", "expected '{a|b|c}"),
        ("x 1:3 rwm", "type must be 'a', 'b' or 'c'"),
        ("c 1-3 rwm", "expected '<major|*>:<minor|*>'"),
        ("c one:3 rwm", "'one' is not a number or '*'"),
        ("c -1:3 rwm", "'-1' is not a number or '*'"),
        ("c 1:3 rwx", "access 'rwx' must be a subset of 'rwm' without repeats"),
        ("c 1:3 rr", "access 'rr' must be a subset of 'rwm' without repeats"),
        ("c 4096:0 r", "major must be '*' or 0..4095"),
        ("c 1:1048576 r", "minor must be '*' or 0..1048575"),
        ("a 1:3 rwm", "type 'a' takes '*:*' only"),
        ("a *:3 rwm", "type 'a' takes '*:*' only"),
    ],
)
def test_parse_rejects_with_the_offending_text(text: str, message: str) -> None:
    with pytest.raises(DeviceRuleError) as raised:
        DeviceRule.parse(text)
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_constructor_checks_too() -> None:
    with pytest.raises(DeviceRuleError, match="access must be a non-empty subset of 'rwm'"):
        DeviceRule("c", 1, 3, "")
    with pytest.raises(DeviceRuleError, match="major must be"):
        DeviceRule("c", True, 3, "r")
    with pytest.raises(DeviceRuleError, match="expected a string"):
        DeviceRule.parse(5)  # type: ignore[arg-type]


# -- encompassing and normalisation ---------------------------------------------


def test_encompasses() -> None:
    assert R("a").encompasses(R("c 195:0 rw"))
    assert R("c *:* rwm").encompasses(R("c 195:* r"))
    assert R("c 195:* rw").encompasses(R("c 195:3 w"))
    assert not R("c 195:* r").encompasses(R("c 195:3 rw"))  # access
    assert not R("c 195:3 rwm").encompasses(R("c 195:* r"))  # selector
    assert not R("c *:* rwm").encompasses(R("a *:* r"))  # 'a' names block devices too
    assert not R("b 195:0 rwm").encompasses(R("c 195:0 r"))
    assert R("c *:5 r").encompasses(R("c 9:5 r")) and not R("c *:5 r").encompasses(R("c 9:6 r"))


def test_normalize_merges_same_selector_and_sorts() -> None:
    assert normalize(["c 5:0 rwm", "c 1:3 r", "c 1:3 w"]) == (R("c 1:3 rw"), R("c 5:0 rwm"))
    assert normalize(["c 195:1 rw", "c *:* m", "b 8:0 r", "c 195:* r", "a *:* w"]) == (
        R("a *:* w"), R("b 8:0 r"), R("c *:* m"), R("c 195:* r"), R("c 195:1 rw"),
    )


def test_normalize_drops_encompassed_rules_only() -> None:
    assert normalize(["c 195:0 r", "c 195:1 rwm", "c 195:* rw"]) == (R("c 195:* rw"), R("c 195:1 rwm"))
    assert normalize(["c 1:3 rwm", "a"]) == (R("a"),)
    assert normalize(["c *:* m", "c 1:3 rwm"]) == (R("c *:* m"), R("c 1:3 rwm"))
    assert normalize([]) == ()


# Small domain for exhaustive checks.
ALL_RULES = every_rule([None, 1, 195], [None, 0, 3])
EXACT_RULES = exact(ALL_RULES)
QUERIES = [
    (t, maj, mi, acc) for t in ("b", "c") for maj in (1, 2, 195) for mi in (0, 3, 4) for acc in ACCESSES
]
rules_st = st.lists(st.sampled_from(ALL_RULES), max_size=6)
exact_st = st.lists(st.sampled_from(EXACT_RULES), max_size=4)


def _merged_verdict(rules: list[DeviceRule], t: str, maj: int, mi: int, acc: str) -> bool:
    """The kernel's allow semantics: merge by selector, then one rule must cover."""
    merged: dict[tuple, set[str]] = {}
    for rule in rules:
        merged.setdefault(rule.selector, set()).update(rule.access)
    return any(
        (st_ == "a" or st_ == t) and (smaj is None or smaj == maj) and (smi is None or smi == mi) and set(acc) <= bits
        for (st_, smaj, smi), bits in merged.items()
    )


@settings(max_examples=300, derandomize=True, deadline=None)
@given(rules_st)
def test_normalize_never_changes_a_verdict_and_is_idempotent(rules: list[DeviceRule]) -> None:
    normal = normalize(rules)
    assert normalize(normal) == normal
    for query in QUERIES:
        assert is_granted(normal, [], *query) == _merged_verdict(rules, *query), query


# -- is_granted ----------------------------------------------------------------------


def test_is_granted_wildcards() -> None:
    assert is_granted(["a"], [], "b", 8, 0, "rwm")
    assert is_granted(["c *:* m"], [], "c", 195, 7, "m")
    assert not is_granted(["c *:* m"], [], "b", 195, 7, "m")
    assert is_granted(["c 136:* rwm"], [], "c", 136, 12, "rw")
    assert not is_granted(["c 136:* rwm"], [], "c", 137, 12, "r")
    assert is_granted(["c *:5 r"], [], "c", 9, 5, "r")


def test_is_granted_partial_access_needs_one_rule_covering_every_bit() -> None:
    assert is_granted(["c 195:0 rw"], [], "c", 195, 0, "r")
    assert not is_granted(["c 195:0 r"], [], "c", 195, 0, "rw")
    # Two rules do not add up (the kernel checks one exception at a time) ...
    assert not is_granted(["c 195:* r", "c 195:0 w"], [], "c", 195, 0, "rw")
    # ... but two rules for the same device merge (the kernel or-s them).
    assert is_granted(["c 195:0 r", "c 195:0 w"], [], "c", 195, 0, "rw")


def test_is_granted_deny_overrides_allow_on_any_overlapping_bit() -> None:
    allow = ["c 195:* rwm"]
    assert not is_granted(allow, ["c 195:1 w"], "c", 195, 1, "rw")
    assert not is_granted(allow, ["c 195:1 w"], "c", 195, 1, "w")
    assert is_granted(allow, ["c 195:1 w"], "c", 195, 1, "r")
    assert is_granted(allow, ["c 195:1 w"], "c", 195, 2, "rw")
    assert not is_granted(["a"], ["b 8:0 m"], "b", 8, 0, "m")


def test_is_granted_grants_nothing_by_default() -> None:
    assert not is_granted([], [], "c", 1, 3, "r")
    assert Policy().is_granted("c", 1, 3, "r") is False


def test_is_granted_rejects_bad_queries() -> None:
    with pytest.raises(DeviceRuleError, match="expected 'b' or 'c'"):
        is_granted(["a"], [], "a", 1, 3, "r")
    with pytest.raises(DeviceRuleError, match="access 'x'"):
        is_granted(["a"], [], "c", 1, 3, "x")


# -- policies ------------------------------------------------------------------


def test_create_refuses_wildcard_deny_rules() -> None:
    with pytest.raises(DeviceRuleError, match=r"Invalid deny rule 'c 195:\* rwm': deny rules name exact devices"):
        Policy.create(["c 1:3 rwm"], ["c 195:* rwm"])


def test_create_refuses_an_allow_rule_swallowed_by_a_deny_rule() -> None:
    with pytest.raises(
        DeviceRuleError,
        match="allow entry 'c 195:0 rw' cannot be encompassed by deny entry 'c 195:0 rwm'",
    ):
        Policy.create(["c 195:0 rw"], ["c 195:0 rwm"])


def test_create_normalises_and_lines_give_the_v1_form() -> None:
    access = Policy.create(["c 195:0 r", "c 195:0 w", "c *:* m"], ["c 1:1 m"])
    assert access.allow == (R("c *:* m"), R("c 195:0 rw"))
    assert access.lines() == (("c *:* m", "c 195:0 rw"), ("c 1:1 m",))


def test_standard_container_devices_are_mesos_default_whitelist() -> None:
    assert [str(rule) for rule in STANDARD_CONTAINER_DEVICES] == [
        "c *:* m", "b *:* m", "c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",
        "c 5:0 rwm", "c 5:1 rwm", "c 5:2 rwm", "c 4:0 rwm", "c 4:1 rwm", "c 136:* rwm", "c 10:200 rwm",
    ]


def test_container_policy_denies_all_then_allows_standard_control_and_gpus() -> None:
    allow, deny = container_policy(["c 195:255 rwm", "c 235:0 rwm"], ["c 195:0 rw", R("c 195:3 rw")])
    assert deny == ()
    assert allow == normalize([*STANDARD_CONTAINER_DEVICES, "c 195:255 rwm", "c 235:0 rwm", "c 195:0 rw", "c 195:3 rw"])
    assert is_granted(allow, deny, "c", 1, 3, "rwm")  # /dev/null
    assert is_granted(allow, deny, "c", 136, 4, "rw")  # a pty
    assert is_granted(allow, deny, "c", 195, 255, "rw")  # nvidiactl
    assert is_granted(allow, deny, "c", 195, 0, "rw") and is_granted(allow, deny, "c", 195, 3, "rw")
    assert not is_granted(allow, deny, "c", 195, 1, "r")  # another container's GPU
    assert is_granted(allow, deny, "c", 195, 1, "m")  # mknod of anything char, as Mesos
    assert not is_granted(allow, deny, "b", 8, 0, "r")


# -- the reconfigure diff ------------------------------------------------------------


def test_diff_adds_and_removes_exact_rules() -> None:
    current = Policy.create(["c 1:3 rwm", "c 195:0 rw"])
    after = apply_diff(current, ["c 195:1 rw"], ["c 195:0 rw"])
    assert after == Policy((R("c 1:3 rwm"), R("c 195:1 rw")), ())


def test_diff_removal_under_a_wildcard_becomes_a_deny_rule() -> None:
    current = Policy.create(["c *:* m", "c 195:* r", "c 195:0 rw"])
    after = apply_diff(current, [], ["c 195:0 rwm"])
    assert after.allow == (R("c *:* m"), R("c 195:* r"))  # sorted
    assert after.deny == (R("c 195:0 rm"),)
    assert not after.is_granted("c", 195, 0, "r") and not after.is_granted("c", 195, 0, "m")
    assert after.is_granted("c", 195, 1, "r")


def test_diff_addition_lifts_a_deny_rule() -> None:
    current = apply_diff(Policy.create(["c 195:* rw"]), [], ["c 195:0 rw"])
    assert current.deny == (R("c 195:0 rw"),)
    after = apply_diff(current, ["c 195:0 r"], [])
    assert after.deny == (R("c 195:0 w"),)
    assert after.is_granted("c", 195, 0, "r") and not after.is_granted("c", 195, 0, "w")


def test_diff_partial_removal_keeps_the_other_bits() -> None:
    after = apply_diff(Policy.create(["c 195:0 rwm"]), [], ["c 195:0 w"])
    assert after.allow == (R("c 195:0 rm"),) and after.deny == ()


def test_diff_refuses_a_removal_covering_an_addition() -> None:
    with pytest.raises(
        DeviceRuleError,
        match="addition 'c 195:0 rw' cannot be encompassed by removal 'c 195:0 rwm'",
    ):
        apply_diff(Policy(), ["c 195:0 rw"], ["c 195:0 rwm"])
    # A partial overlap is fine: the removal's bits win.
    after = apply_diff(Policy(), ["c 195:0 rw"], ["c 195:0 w"])
    assert after.allow == (R("c 195:0 r"),)


@pytest.mark.parametrize("rule", ["c 195:* rw", "a", "c *:0 r"])
def test_diff_refuses_wildcards(rule: str) -> None:
    with pytest.raises(DeviceRuleError, match="reconfigure takes exact devices only"):
        check_diff([rule], [])
    with pytest.raises(DeviceRuleError, match="reconfigure takes exact devices only"):
        check_diff([], [rule])


@settings(max_examples=400, derandomize=True, deadline=None)
@given(rules_st, st.lists(st.sampled_from(EXACT_RULES), max_size=3), exact_st, exact_st)
def test_diff_verdicts(allow: list[DeviceRule], deny: list[DeviceRule], add: list[DeviceRule], remove: list[DeviceRule]) -> None:
    """After a diff: a query overlapping a removal is refused; one an addition
    covers is granted; a device neither names keeps its verdict."""
    try:
        current = Policy.create(allow, deny)
        after = apply_diff(current, add, remove)
    except DeviceRuleError:
        return
    for t, maj, mi, acc in itertools.product(("b", "c"), (1, 2, 195), (0, 3, 4), ACCESSES):
        named_removals = [r for r in remove if r.selector == (t, maj, mi)]
        named_additions = [r for r in add if r.selector == (t, maj, mi)]
        verdict = after.is_granted(t, maj, mi, acc)
        if any(set(r.access) & set(acc) for r in named_removals):
            assert not verdict, (t, maj, mi, acc)
        elif any(set(acc) <= set(r.access) for r in named_additions):
            assert verdict, (t, maj, mi, acc)
        elif not named_removals and not named_additions:
            assert verdict == current.is_granted(t, maj, mi, acc), (t, maj, mi, acc)
    assert normalize(after.allow) == after.allow and normalize(after.deny) == after.deny
    assert not any(rule.has_wildcard for rule in after.deny)
