"""cgroups v1 on the real kernel (root only): a probe process inside the
container cgroup opens mknod'ed nodes — granted: ENXIO (no driver),
denied: EPERM, /dev/null opens."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from actors.devices import CgroupsV1Backend, DeviceRule, KernelOperationError, container_policy
from actors.devices.testing import FaultInjectingBackend
from tests.support.probes import DENIED, GRANTED, assert_verdicts

R = DeviceRule.parse
CONTROL = ["c 195:255 rwm"]


def devices_list(sandbox, cgroup: str) -> list[str]:
    with open(os.path.join(sandbox.root, cgroup, "devices.list")) as handle:
        return handle.read().splitlines()


def test_configure_reconfigure_remove_as_seen_by_a_process(v1_sandbox, device_nodes) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    allow, deny = container_policy(CONTROL, ["c 195:0 rwm", "c 195:1 rwm"])
    backend.configure("c1", allow, deny)
    assert devices_list(v1_sandbox, "c1")[-3:] == ["c 195:0 rwm", "c 195:1 rwm", "c 195:255 rwm"]
    probe = v1_sandbox.probe("c1")
    assert_verdicts(probe, device_nodes, granted=[("c", 195, 0), ("c", 195, 1), ("c", 195, 255), "/dev/null"],
                    denied=[("c", 195, 2), ("b", 240, 0)])

    state = backend.reconfigure("c1", [R("c 195:2 rwm")], [R("c 195:1 rwm")])
    assert state.is_granted("c", 195, 2, "rw") and not state.is_granted("c", 195, 1, "r")
    assert state == backend.state("c1")
    assert_verdicts(probe, device_nodes, granted=[("c", 195, 2), ("c", 195, 0), "/dev/null"], denied=[("c", 195, 1)])

    probe.close()
    assert backend.remove("c1") is True
    assert not os.path.exists(os.path.join(v1_sandbox.root, "c1"))
    assert backend.list_cgroups() == [] and backend.state("c1") is None


def test_partial_access_and_mknod(v1_sandbox, device_nodes, tmp_path) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    backend.configure("c1", ["c 1:3 rwm", "c 195:0 r", "c 240:* m"], [])
    probe = v1_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 0], os.O_RDONLY) == GRANTED
    assert probe.access(device_nodes["c", 195, 0], os.O_WRONLY) == DENIED
    assert probe.access(device_nodes["c", 195, 0], os.O_RDWR) == DENIED
    assert probe.may_mknod(str(tmp_path), "c", 240, 7) == GRANTED
    assert probe.may_mknod(str(tmp_path), "c", 195, 0) == DENIED
    assert probe.may_mknod(str(tmp_path), "b", 240, 7) == DENIED


def test_one_rule_per_write_is_a_kernel_fact(v1_sandbox) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    backend.configure("c1", ["c 1:3 rwm"], [])
    fd = os.open(os.path.join(v1_sandbox.root, "c1", "devices.allow"), os.O_WRONLY)
    try:
        os.write(fd, b"c 195:0 rw\nc 195:1 rw\n")
    finally:
        os.close(fd)
    assert devices_list(v1_sandbox, "c1") == ["c 1:3 rwm", "c 195:0 rw"]  # only the first rule


def test_configure_an_existing_cgroup_writes_the_difference(v1_sandbox) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rwm"]))
    counting = FaultInjectingBackend(backend)
    counting.configure("c1", *container_policy(CONTROL, ["c 195:1 rwm"]))
    # mkdir first (EEXIST: it exists; no stat), then the difference: allows before denies
    assert [op for op, _ in counting.log] == ["mkdir", "read", "open", "write 'c 195:1 rwm' to", "open",
                                               "write 'c 195:0 rwm' to"]
    assert devices_list(v1_sandbox, "c1")[-1] == "c 195:1 rwm"
    assert "c 195:0 rwm" not in devices_list(v1_sandbox, "c1")


def test_remove_keeps_a_cgroup_with_processes(v1_sandbox, caplog: pytest.LogCaptureFixture) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    backend.configure("c1", *container_policy(CONTROL, []))
    probe = v1_sandbox.probe("c1")
    with caplog.at_level(logging.WARNING):
        assert backend.remove("c1") is False
    assert "still has processes" in caplog.text and "c1" in caplog.text
    assert backend.exists("c1")
    probe.close()
    assert backend.remove("c1") is True and not backend.exists("c1")


def test_reconcile_repairs_an_allow_all_wipe(v1_sandbox, device_nodes) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    allow, deny = container_policy(CONTROL, ["c 195:0 rwm"])
    desired = backend.configure("c1", allow, deny)
    probe = v1_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 1]) == DENIED
    assert backend.reconcile("c1", desired) == []
    with open(os.path.join(v1_sandbox.root, "c1", "devices.allow"), "w") as handle:
        handle.write("a")  # what a systemd reload can do
    assert devices_list(v1_sandbox, "c1") == ["a *:* rwm"]
    assert probe.access(device_nodes["c", 195, 1]) == GRANTED  # drifted: granted
    repairs = backend.reconcile("c1", desired)
    assert repairs == [f"{v1_sandbox.root}/c1: devices.list read 'a *:* rwm' (allow all); denied all and rewrote the rules"]
    assert probe.access(device_nodes["c", 195, 1]) == DENIED
    assert probe.access(device_nodes["c", 195, 0]) == GRANTED
    assert probe.access("/dev/null") == GRANTED
    assert backend.reconcile("c1", desired) == []


def test_reconcile_repairs_single_rules_and_a_missing_cgroup(v1_sandbox) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    desired = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rwm"]))
    with open(os.path.join(v1_sandbox.root, "c1", "devices.deny"), "w") as handle:
        handle.write("c 195:0 rwm")
    with open(os.path.join(v1_sandbox.root, "c1", "devices.allow"), "w") as handle:
        handle.write("c 195:7 r")
    assert backend.reconcile("c1", desired) == [
        f"{v1_sandbox.root}/c1: allowed 'c 195:0 rwm'",
        f"{v1_sandbox.root}/c1: denied 'c 195:7 r'",
    ]
    assert backend.state("c1") == desired and backend.reconcile("c1", desired) == []
    backend.remove("c1")
    assert backend.reconcile("c1", desired) == [f"{v1_sandbox.root}/c1: recreated the missing cgroup with its device rules"]
    assert backend.state("c1") == desired


def _count_operations(sandbox, call) -> int:
    counting = FaultInjectingBackend(CgroupsV1Backend(sandbox.hierarchy, sandbox.cgroups_root))
    call(counting)
    return counting.operations


def test_a_fault_at_every_kernel_operation_of_configure_leaves_nothing(v1_sandbox) -> None:
    allow, deny = container_policy(CONTROL, ["c 195:0 rwm", "c 195:1 rwm"])
    os.mkdir(v1_sandbox.root)  # so every k lands in the container's own operations
    total = _count_operations(v1_sandbox, lambda b: b.configure("probe", allow, deny))
    CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root).remove("probe")
    assert total == 2 + 1 + 1 + len(allow)  # mkdir, open+'a' to deny, open, one write per rule
    for k in range(1, total + 1):
        backend = FaultInjectingBackend(CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root), fail_at=k)
        with pytest.raises(KernelOperationError, match=f"injected at kernel operation #{k}"):
            backend.configure("c1", allow, deny)
        assert not backend.exists("c1"), f"fault at operation {k} left the cgroup behind"


def test_a_fault_at_every_kernel_operation_of_reconfigure_rolls_back(v1_sandbox) -> None:
    plain = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    before = plain.configure("c1", *container_policy(CONTROL, ["c 195:0 rwm", "c 195:1 rwm"]))
    listed = devices_list(v1_sandbox, "c1")
    add, remove = [R("c 195:2 rwm"), R("c 195:3 rwm")], [R("c 195:0 rwm")]
    total = 1 + 2 + 3  # read devices.list, two opens, three writes
    for k in range(1, total + 1):
        backend = FaultInjectingBackend(plain, fail_at=k, errno=errno.EIO)
        with pytest.raises(KernelOperationError) as raised:
            backend.reconfigure("c1", add, remove)
        assert raised.value.errno == errno.EIO
        assert plain.state("c1") == before, f"fault at operation {k} changed the rules"
        assert sorted(devices_list(v1_sandbox, "c1")) == sorted(listed)
    backend.detach()
    after = plain.reconfigure("c1", add, remove)
    assert after.is_granted("c", 195, 3, "rw") and not after.is_granted("c", 195, 0, "r")


def test_a_fault_in_remove_keeps_the_cgroup(v1_sandbox) -> None:
    plain = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    plain.configure("c1", *container_policy(CONTROL, []))
    backend = FaultInjectingBackend(plain, fail_at=1, errno=errno.EBUSY)
    assert backend.remove("c1") is False  # EBUSY reads as "processes remain"
    backend.arm(1, errno.EIO)
    with pytest.raises(KernelOperationError, match="Failed to rmdir"):
        backend.remove("c1")
    assert plain.exists("c1")


def test_nested_cgroups(v1_sandbox, device_nodes) -> None:
    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    backend.configure("parent", *container_policy(CONTROL, ["c 195:0 rwm", "c 195:1 rwm"]))
    backend.configure("parent/child", *container_policy(CONTROL, ["c 195:1 rwm"]))
    assert backend.list_cgroups() == ["parent", "parent/child"]
    probe = v1_sandbox.probe("parent/child")
    assert probe.access(device_nodes["c", 195, 1]) == GRANTED
    assert probe.access(device_nodes["c", 195, 0]) == DENIED
    assert backend.remove("parent") is False  # its child is still there
    probe.close()
    assert backend.remove("parent/child") and backend.remove("parent")
    assert backend.list_cgroups() == []


def test_a_crash_after_every_kernel_operation_is_repaired_by_reconcile(v1_sandbox, device_nodes) -> None:
    from actors.devices.testing import SimulatedCrash

    allow, deny = container_policy(CONTROL, ["c 195:0 rwm"])
    os.mkdir(v1_sandbox.root)
    total = _count_operations(v1_sandbox, lambda b: b.configure("count", allow, deny))
    for k in range(1, total + 1):
        backend = FaultInjectingBackend(CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root), crash_at=k)
        with pytest.raises(SimulatedCrash):
            backend.configure("c1", allow, deny)
        restarted = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
        desired = restarted.configure("reference", allow, deny)
        restarted.reconcile("c1", desired)
        assert restarted.state("c1") == desired, f"crash before operation {k}"
        assert restarted.remove("c1") and restarted.remove("reference")


def test_what_devices_list_reads_after_a_configure_is_the_plans_listing(v1_sandbox) -> None:
    """The kernel lists exceptions in the order written, each as the plan
    writes it: reading a listing back finds its policy with no parsing, and
    parsing it gives the same table."""
    from actors.devices import Policy
    from actors.devices._v1_emulator import parse_devices_list

    backend = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    for minors in ([], [0], [3, 1]):
        policy = Policy.container(["c 195:255 rwm", "c 235:0 rwm"], [f"c 195:{m} rwm" for m in minors])
        backend.configure(f"c{len(minors)}", policy)
        with open(os.path.join(v1_sandbox.root, f"c{len(minors)}", "devices.list")) as listed:
            text = listed.read()
        assert text == policy.v1_plan.listing
        assert parse_devices_list(text) == policy.v1_plan.target
        assert backend.state(f"c{len(minors)}") == policy
    for name in ("c0", "c1", "c2"):
        assert backend.remove(name) is True


def test_an_update_writes_the_transition_between_two_plans_once_worked_out(v1_sandbox) -> None:
    """configure of a cgroup that lists another plan writes the writes from
    that plan's list to this one's (the tables' difference, worked out once
    per pair), and a fault at any of them puts the old list back."""
    from actors.devices import Policy
    from actors.devices._v1_emulator import plan_writes, transition

    one = Policy.container(["c 195:255 rwm"], ["c 195:0 rwm", "c 195:1 rwm"])
    other = Policy.container(["c 195:255 rwm"], ["c 195:1 rwm", "c 195:2 rwm"])
    expected = [(name, line.encode()) for name, line in plan_writes(one.v1_plan.target, other.v1_plan.target)]
    groups = transition(one, other)
    assert [(name, line) for name, lines in groups for line in lines] == expected
    assert transition(one, other) is groups  # worked out once
    plain = CgroupsV1Backend(v1_sandbox.hierarchy, v1_sandbox.cgroups_root)
    plain.configure("c1", one)
    listed = devices_list(v1_sandbox, "c1")
    counting = FaultInjectingBackend(plain)
    counting.configure("c1", one)  # the same list again: mkdir (EEXIST) and the read, nothing written
    assert [op for op, _ in counting.log] == ["mkdir", "read"]
    counting.detach()
    total = 6  # mkdir (EEXIST), read devices.list, open + allow 195:2, open + deny 195:0
    for k in range(1, total + 1):
        backend = FaultInjectingBackend(plain, fail_at=k, errno=errno.EIO)
        with pytest.raises(KernelOperationError, match=f"injected at kernel operation #{k}"):
            backend.configure("c1", other)
        assert devices_list(v1_sandbox, "c1") == listed, f"fault at operation {k} changed the list"
        backend.detach()
    assert plain.configure("c1", other) == other
    assert sorted(devices_list(v1_sandbox, "c1")) == sorted(other.v1_plan.listing.splitlines())
    assert plain.remove("c1") is True
