"""The registry of script actions is the format: each action is one class,
and the step types, the allowed expectations and the error texts follow
from it (R-MS-1)."""

from __future__ import annotations

import pytest

from isolators import load_script
from isolators.script import ACTIONS, Action, CallStep, Expect, Step, action, concurrent_actions

ORDER = ["prepare", "update", "usage", "cleanup", "recover", "create", "concurrent", "advance", "restart",
         "free", "held", "reconcile", "mark_unhealthy"]


def test_the_steps_are_built_from_the_registry() -> None:
    assert list(ACTIONS)[: len(ORDER)] == ORDER  # the order error messages list them in
    assert set(Step.__struct_fields__) == {*ACTIONS, "expect", "name"}
    assert concurrent_actions() == ("prepare", "update", "usage", "cleanup")
    assert set(CallStep.__struct_fields__) == {*concurrent_actions(), "expect", "name"}
    for name, registered in ACTIONS.items():
        assert registered.name == name and set(registered.expects) <= set(Expect.__struct_fields__)


def test_an_action_is_registered_once_with_known_expectations() -> None:
    with pytest.raises(ValueError, match="a script action named 'free' is registered already"):
        @action
        class Again(Action):
            name = "free"
            args = list[int]

    with pytest.raises(ValueError, match=r"action 'probe' expects unknown expectations \['smell'\]"):
        @action
        class Smelly(Action):
            name = "probe"
            args = bool
            expects = ("error", "smell")

    assert "probe" not in ACTIONS and ACTIONS["free"].expects == ()


def test_each_step_knows_its_action_and_title() -> None:
    script = load_script(
        "node: {gpus: 2}\n"
        "steps:\n"
        "  - prepare: {id: a, resources: 'gpus:1', rootfs: r, debug: true}\n"
        "  - concurrent: {steps: [{cleanup: {id: 'c{i}'}}, {usage: {id: a}}], repeat: 2}\n"
        "  - restart: {recover: false}\n"
        "  - create: {}\n"
        "  - advance: 2.5\n",
    )
    titles = [(s.action, ACTIONS[s.action].title(getattr(s, s.action))) for s in script.steps]
    assert titles == [
        ("prepare", "prepare a (gpus:1, rootfs r, DEBUG)"),
        ("concurrent", "4 calls at once: cleanup c{i}; usage of a (x2)"),
        ("restart", "agent restart: drop every actor, rebuild"),
        ("create", "create the isolator (default flags)"),
        ("advance", "advance the clock 2.5 s"),
    ]
