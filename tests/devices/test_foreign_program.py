"""Other agents' device programs judged by running them, and widened by a prologue (actors.devices._foreign_program)."""

from __future__ import annotations

import itertools
import os

import pytest

from actors.devices import DeviceRule, Policy, allowing, bpf, build_device_program, program_allows, program_grants
from actors.devices._device_program import encode

from tests.support.foreign_programs import runc_style_program
from tests.support.kernel import bpf_unusable

CONTAINER = Policy.create(["c 1:3 rwm", "c 1:5 rwm", "c 5:* rw", "c 195:0 rwm", "c 195:255 rwm", "b 8:* r"],
                          ["c 5:1 w"])
DEVICES = [(t, major, minor) for t in "cb" for major, minor in itertools.product((1, 5, 8, 195), (0, 1, 3, 5, 255))]
ACCESSES = ["r", "w", "m", "rw", "rwm"]
GPU1 = DeviceRule.parse("c 195:1 rw")
RUNC_RULES = [(DeviceRule.parse("c 1:3 rwm"), True),
              (DeviceRule.parse("c 5:* rw"), True), (DeviceRule.parse("c 195:0 rwm"), True)]


def test_a_program_of_ours_is_judged_as_its_policy() -> None:
    code = build_device_program(CONTAINER)
    for (t, major, minor), access in itertools.product(DEVICES, ACCESSES):
        assert program_allows(code, t, major, minor, access) == CONTAINER.is_granted(t, major, minor, access), (
            t, major, minor, access)


def test_a_runc_shaped_program_is_judged_first_match_wins() -> None:
    code = runc_style_program(RUNC_RULES + [(DeviceRule.parse("c 195:* rwm"), False)])
    assert program_allows(code, "c", 195, 0, "rw") is True
    assert program_allows(code, "c", 195, 1, "r") is False
    assert program_allows(code, "c", 5, 9, "rw") is True
    assert program_allows(code, "c", 5, 9, "m") is False  # the rule grants rw only
    assert program_grants(code, DeviceRule.parse("c 1:3 rw")) is True
    assert program_grants(code, DeviceRule.parse("c 5:2 rwm")) is False


def test_widening_adds_exactly_the_rules_and_keeps_every_old_verdict() -> None:
    for old in (build_device_program(CONTAINER), runc_style_program(RUNC_RULES)):
        wider = allowing(old, [GPU1, DeviceRule.parse("c 195:255 r")])
        for (t, major, minor), access in itertools.product(DEVICES + [("c", 195, 1)], ACCESSES):
            added = (t, major, minor) == ("c", 195, 1) and "m" not in access
            added = added or ((t, major, minor) == ("c", 195, 255) and access == "r")
            expected = program_allows(old, t, major, minor, access) or added
            assert program_allows(wider, t, major, minor, access) == expected, (t, major, minor, access)


def test_a_program_it_cannot_read_is_never_judged_nor_widened() -> None:
    with_call = encode([(0x85, 0, 0, 0, 1), (0xB7, 0, 0, 0, 1), (0x95, 0, 0, 0, 0)])  # a helper call
    assert program_allows(with_call, "c", 195, 0, "rw") is None
    assert program_grants(with_call, GPU1) is None
    with pytest.raises(ValueError, match="not readable"):
        allowing(with_call, [GPU1])
    with pytest.raises(ValueError, match="exact device rules"):
        allowing(runc_style_program(RUNC_RULES), [DeviceRule.parse("c 195:* rw")])


@pytest.mark.skipif(os.geteuid() != 0 or bpf_unusable() is not None, reason="loading a device program needs root")
def test_the_kernel_verifier_takes_a_widened_program() -> None:
    for old in (build_device_program(CONTAINER), runc_style_program(RUNC_RULES)):
        fd = bpf.prog_load(allowing(old, [GPU1, DeviceRule.parse("c 10:200 rwm")]), "gpuiso_test")
        os.close(fd)
