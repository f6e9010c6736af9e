"""The Policy value: frozen, interned, its derived forms computed once, and
correct whether or not callers pass the same objects again (no kernel)."""

from __future__ import annotations

import copy
import pickle

import pytest

from actors.devices import DeviceControl, DeviceRule, DeviceRuleError, MemoryBackend, Policy, container_policy
from actors.devices import _policy
from runtime import Runtime

R = DeviceRule.parse
CONTROL = ["c 195:255 rwm"]


def test_equal_policies_are_one_object_however_they_were_given() -> None:
    a = Policy.create(["c 195:0 rw", "c 1:3 rwm", "c *:* m"], [])
    b = Policy.create([R("c *:* m"), R("c 1:3 rwm"), R("c 195:0 r"), R("c 195:0 w")])  # merged, reordered
    c = Policy(tuple(R(line) for line in ("c *:* m", "c 1:3 rwm", "c 195:0 rw")), ())
    assert a is b is c
    assert a.allow == (R("c *:* m"), R("c 1:3 rwm"), R("c 195:0 rw"))  # normalised
    assert Policy.from_lines(*a.lines()) is a
    assert Policy.container(CONTROL, ["c 195:1 rwm"]) == Policy(*container_policy(CONTROL, ["c 195:1 rwm"]))


def test_a_policy_is_frozen_and_copies_are_itself() -> None:
    policy = Policy.create(["c 1:3 rwm"])
    with pytest.raises(AttributeError, match="Policy is frozen"):
        setattr(policy, "allow", ())
    with pytest.raises(AttributeError, match="Policy is frozen"):
        del policy.deny
    assert copy.copy(policy) is policy and copy.deepcopy(policy) is policy
    assert {policy: 1}[Policy.create(["c 1:3 rwm"])] == 1


def test_what_backends_derive_is_computed_once_on_the_value() -> None:
    policy = Policy.container(CONTROL, ["c 195:2 rwm"])
    assert policy.v1_plan is policy.v1_plan and policy.program is policy.program
    assert policy.lines() is policy.lines()
    assert Policy.container(CONTROL, ["c 195:2 rwm"]).v1_plan is policy.v1_plan  # the same value: the same plan
    code, tags = policy.program
    assert isinstance(code, bytes) and len(code) % 8 == 0 and tags
    assert policy.v1_plan.groups[0] == ("devices.deny", (b"a",))


def test_a_policy_crosses_a_pipe_as_its_text_and_comes_back_as_the_same_object() -> None:
    from actors.devices._frames import FrameReader, encode, unwire, wire

    policy = Policy.container(CONTROL, ["c 195:3 rwm"])
    assert Policy.from_text(policy.text) is policy
    assert policy.text == ";".join(policy.lines()[0]) + " | "
    data = pickle.dumps(policy, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"DeviceRule" not in data and b"c 195:3 rwm" in data
    assert pickle.loads(data) is policy
    reader = FrameReader()
    reader.feed(encode([("configure", wire(("c1", policy)))]))
    ((kind, args),) = reader.next()
    assert kind == "configure" and unwire(args) == ["c1", policy] and unwire(args)[1] is policy


def test_correctness_does_not_depend_on_interning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_policy, "INTERN_CAPACITY", 4)
    first = Policy.create(["c 195:0 rw"])
    for minor in range(1, 20):  # pushes ``first`` out of the table
        Policy.create([f"c 195:{minor} rw"])
    again = Policy.create(["c 195:0 rw"])
    assert again == first and hash(again) == hash(first)
    assert again.v1_plan.target == first.v1_plan.target
    assert again.is_granted("c", 195, 0, "rw") and not again.is_granted("c", 195, 1, "rw")


def test_bad_policies_are_refused_with_mesos_wording() -> None:
    with pytest.raises(DeviceRuleError, match="allow entry 'c 195:0 rw' cannot be encompassed by deny entry"):
        Policy.create(["c 195:0 rw"], ["c 195:0 rwm"])
    with pytest.raises(DeviceRuleError, match="deny rules name exact devices"):
        Policy.create(["c 1:3 rwm"], ["c 195:* rwm"])
    for _ in range(2):  # the verdict is kept on the value: refused again, not let through
        with pytest.raises(DeviceRuleError):
            Policy.create(["c 195:0 rw"], ["c 195:0 rwm"])


@pytest.mark.asyncio
async def test_device_control_takes_a_policy_or_rules() -> None:
    async with Runtime():
        control = await DeviceControl.create(backend_impl=MemoryBackend())
        policy = Policy.container(CONTROL, ["c 195:0 rwm"])
        assert await control.configure("c1", policy) is policy
        assert await control.configure("c2", *container_policy(CONTROL, ["c 195:0 rwm"])) is policy
        assert await control.reconcile("c1", policy) == []
        with pytest.raises(DeviceRuleError, match="Give a Policy alone"):
            await control.configure("c3", policy, ["c 195:1 rwm"])
        await control.close()
