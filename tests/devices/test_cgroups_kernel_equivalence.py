"""Equivalence on the real kernel: for random rule sets, what a process in
the cgroup may do equals ``is_granted`` (root only; fixed seed, bounded).

v2: the compiled eBPF program. v1: the kernel's own rules (allow lists;
a v1 deny only removes exact entries, so its deny semantics are tested in
test_cgroups_v1_kernel.py)."""

from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from actors.devices import Policy, CgroupsV1Backend, CgroupsV2Backend, DeviceRule, DeviceRuleError
from tests.support.probes import DENIED, GRANTED
from tests.support.rules import every_rule, exact, policies

ALLOW = every_rule([None, 195, 240], [None, 0, 1, 255])
DENY = exact(ALLOW)
OPEN_MODES = [(os.O_RDONLY, "r"), (os.O_WRONLY, "w"), (os.O_RDWR, "rw")]
MKNOD_DEVICES = [("c", 195, 0), ("c", 240, 9), ("b", 240, 1), ("b", 195, 255)]


def check_verdicts(probe, device_nodes, scratch: str, access: Policy) -> int:
    """Compare every probe answer with ``access.is_granted``; the number of checks."""
    checks = 0
    for kind, major, minor in sorted(device_nodes.paths):
        for flags, bits in OPEN_MODES:
            answer = probe.access(device_nodes[kind, major, minor], flags)
            assert answer in (GRANTED, DENIED), (kind, major, minor, bits, answer)
            granted = access.is_granted(kind, major, minor, bits)
            assert (answer == GRANTED) == granted, (
                f"{kind} {major}:{minor} {bits}: kernel {answer}, model {granted};"
                f" allow={[str(r) for r in access.allow]} deny={[str(r) for r in access.deny]}"
            )
            checks += 1
    for kind, major, minor in MKNOD_DEVICES:
        answer = probe.may_mknod(scratch, kind, major, minor)
        assert answer in (GRANTED, DENIED)
        assert (answer == GRANTED) == access.is_granted(kind, major, minor, "m"), (kind, major, minor, access)
        checks += 1
    return checks


def test_v2_program_verdicts_equal_is_granted(v2_sandbox, device_nodes, tmp_path) -> None:
    """... and the kernel holds the record: a backend that never configured
    the cgroup reads the policy back from the program's translated
    instructions (the verifier must not have rewritten them)."""
    backend = CgroupsV2Backend(v2_sandbox.hierarchy, v2_sandbox.cgroups_root)
    reader = CgroupsV2Backend(v2_sandbox.hierarchy, v2_sandbox.cgroups_root)
    backend.configure("eq", [], [])
    probe = v2_sandbox.probe("eq")
    scratch = str(tmp_path)
    total = [0, 0]

    @settings(max_examples=100, derandomize=True, deadline=None, database=None)
    @given(policies(st.lists(st.sampled_from(ALLOW), max_size=8), st.lists(st.sampled_from(DENY), max_size=3)))
    def check(access: Policy) -> None:
        assert backend.configure("eq", access.allow, access.deny) == access
        back = reader.state("eq")
        assert back is not None and back.program[0] == access.program[0], (str(access), back)
        if access.allow:  # (an empty allow list compiles to "deny everything", whatever the deny list)
            assert back == access
        total[0] += 1
        total[1] += check_verdicts(probe, device_nodes, scratch, access)

    try:
        check()
    finally:
        backend.close()
        reader.close()
    assert total[0] >= 50 and total[1] >= 50 * 31


def test_v2_container_policies_are_read_back_from_the_kernel(v2_sandbox) -> None:
    """The policies the isolator writes (control devices, runs and gaps of
    GPU minors, MIG capability nodes, a deny list) read back from the kernel
    exactly, by a backend that did not write them."""
    from actors.devices import container_policy

    control = ["c 195:255 rwm", "c 195:254 rwm", "c 235:0 rwm", "c 235:1 rwm"]
    gpu_sets = [[], [0], [7], [0, 1], [1, 2, 3], [0, 2, 4, 6], [0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 9, 10, 11, 200],
                list(range(0, 128, 3))]
    backend = CgroupsV2Backend(v2_sandbox.hierarchy, v2_sandbox.cgroups_root)
    try:
        for index, gpus in enumerate(gpu_sets):
            allow, deny = container_policy(control + ["c 240:1 r", "c 240:2 r"],
                                           [f"c 195:{g} rwm" for g in gpus])
            access = backend.configure(f"c{index}", allow, deny)
            reader = CgroupsV2Backend(v2_sandbox.hierarchy, v2_sandbox.cgroups_root)
            try:
                assert reader.state(f"c{index}") == access, gpus
            finally:
                reader.close()
            probe = Policy.create([*allow, "c 240:* rw"], ["c 240:5 rw", "c 240:7 w"])  # with a deny list
            assert backend.configure(f"c{index}", probe.allow, probe.deny) == probe
            assert CgroupsV2Backend(v2_sandbox.hierarchy, v2_sandbox.cgroups_root).state(f"c{index}") == probe
    finally:
        backend.close()


def test_v1_kernel_verdicts_equal_is_granted(v1_sandbox, device_nodes, tmp_path) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    backend.configure("eq", [], [])
    probe = v1_sandbox.probe("eq")
    scratch = str(tmp_path)

    @settings(max_examples=40, derandomize=True, deadline=None, database=None)
    @given(st.lists(st.sampled_from(ALLOW), max_size=8))
    def check(allow: list[DeviceRule]) -> None:
        access = Policy.create(allow, [])
        try:
            state = backend.configure("eq", access.allow, [])
        except DeviceRuleError as error:  # 'a *:* r' beside 'b *:* w': v1 cannot hold it
            assert "the kernel would merge them" in str(error)
            return
        assert state == backend.state("eq")
        check_verdicts(probe, device_nodes, scratch, access)
        check_verdicts(probe, device_nodes, scratch, state)

    check()
