"""The backend port without a kernel: cgroup validation, the in-memory
backend, the fault-injecting wrapper, the v1 planner and backend detection."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from actors.devices import Policy, DeviceControlError, DeviceOperation, DeviceRule, DeviceRuleError
from actors.devices import InvalidCgroupError, KernelOperationError, MemoryBackend, container_policy
from actors.devices import detect_backend, resolve_backend, validate_cgroup, validate_cgroups_root
from actors.devices.testing import FaultInjectingBackend
from actors.devices._v1_emulator import parse_devices_list, plan_writes, table_access, v1_exceptions

R = DeviceRule.parse
POLICY = container_policy(["c 195:255 rwm"], ["c 195:0 rw"])


@pytest.mark.parametrize("good", ["c1", "parent/child", "a-b_c.d", "x" * 255])
def test_valid_cgroups(good: str) -> None:
    assert validate_cgroup(good) == good


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "must be a non-empty relative path"),
        (None, "must be a non-empty relative path"),
        ("/sys/fs/cgroup/x", "must be relative, not absolute"),
        ("..", "every component must be a plain name"),
        ("a/../../etc", "every component must be a plain name"),
        ("a//b", "every component must be a plain name"),
        ("a/", "every component must be a plain name"),
        ("./a", "every component must be a plain name"),
        ("a\\b", "is not a valid directory name"),
        ("a\0b", "is not a valid directory name"),
        ("x" * 256, "is not a valid directory name"),
    ],
)
def test_invalid_cgroups_name_the_value(bad: object, message: str) -> None:
    with pytest.raises(InvalidCgroupError) as raised:
        validate_cgroup(bad)
    assert message in str(raised.value) and repr(bad)[:20] in str(raised.value)


def test_invalid_cgroups_root() -> None:
    with pytest.raises(InvalidCgroupError, match="Invalid cgroups_root '/abs'"):
        validate_cgroups_root("/abs")
    with pytest.raises(InvalidCgroupError, match="Invalid cgroups_root '../up'"):
        validate_cgroups_root("../up")


# -- in memory -------------------------------------------------------------------


def test_memory_backend_lifecycle() -> None:
    backend = MemoryBackend()
    assert backend.state("c1") is None and not backend.exists("c1")
    access = backend.configure("c1", *POLICY)
    assert access == Policy.create(*POLICY)
    assert backend.exists("c1") and backend.state("c1") == access
    after = backend.reconfigure("c1", [R("c 195:1 rw")], [R("c 195:0 rw")])
    assert after.is_granted("c", 195, 1, "rw") and not after.is_granted("c", 195, 0, "r")
    assert backend.list_cgroups() == ["c1"]
    assert backend.remove("c1") is True and backend.list_cgroups() == []
    assert backend.remove("c1") is True  # idempotent


def test_memory_backend_reconfigure_needs_a_configured_cgroup() -> None:
    with pytest.raises(DeviceControlError, match="Cannot reconfigure cgroup 'nope': it is not configured"):
        MemoryBackend().reconfigure("nope", [R("c 195:0 rw")], [])


def test_memory_backend_keeps_a_parent_with_children(caplog: pytest.LogCaptureFixture) -> None:
    backend = MemoryBackend()
    backend.configure("p", *POLICY)
    backend.configure("p/c", *POLICY)
    with caplog.at_level(logging.WARNING):
        assert backend.remove("p") is False
    assert "still has child cgroups" in caplog.text
    assert backend.remove("p/c") and backend.remove("p")


def test_memory_reconcile_reports_and_restores() -> None:
    backend = MemoryBackend()
    desired = Policy.create(*POLICY)
    backend.configure("c1", *POLICY)
    assert backend.reconcile("c1", desired) == []
    backend.reconfigure("c1", [], [R("c 195:0 rw")])
    assert backend.reconcile("c1", desired) == ["memory:/gpu-isolator/c1: restored the device policy"]
    assert backend.state("c1") == desired


def test_apply_batch_returns_one_result_per_operation_and_isolates_failures() -> None:
    backend = MemoryBackend()
    results = backend.apply_batch(
        [
            DeviceOperation("configure", ("a", *POLICY)),
            DeviceOperation("reconfigure", ("missing", [R("c 195:1 rw")], [])),
            DeviceOperation("exists", ("a",)),
            DeviceOperation("list_cgroups"),
            DeviceOperation("bogus"),
        ]
    )
    assert isinstance(results[0], Policy)
    assert isinstance(results[1], DeviceControlError)
    assert results[2:4] == [True, ["a"]]
    assert isinstance(results[4], ValueError)


# -- fault injection -----------------------------------------------------------------


def test_fault_wrapper_counts_and_fails_exactly_the_kth_operation() -> None:
    counting = FaultInjectingBackend(MemoryBackend())
    counting.configure("c1", *POLICY)
    counting.reconfigure("c1", [R("c 195:1 rw")], [])
    counting.remove("c1")
    assert counting.operations == 4
    assert [op for op, _target in counting.log] == ["mkdir", "apply", "apply", "rmdir"]
    for k in range(1, 5):
        backend = FaultInjectingBackend(MemoryBackend(), fail_at=k, errno=errno.ENOSPC)
        calls = [
            lambda: backend.configure("c1", *POLICY),
            lambda: backend.reconfigure("c1", [R("c 195:1 rw")], []),
            lambda: backend.remove("c1"),
        ]
        failures = []
        for call in calls:
            try:
                call()
            except KernelOperationError as error:
                failures.append(error)
                break
        assert len(failures) == 1 and backend.injected and backend.operations == k
        assert failures[0].errno == errno.ENOSPC
        assert f"injected at kernel operation #{k}" in str(failures[0])
        assert "No space left on device" in str(failures[0])


def test_memory_configure_fault_leaves_no_cgroup() -> None:
    backend = FaultInjectingBackend(MemoryBackend(), fail_at=2)
    with pytest.raises(KernelOperationError, match="Failed to apply memory:/gpu-isolator/c1"):
        backend.configure("c1", *POLICY)
    assert backend.list_cgroups() == []
    backend.arm(None)
    backend.configure("c1", *POLICY)
    assert backend.operations == 2 and not backend.injected


# -- the v1 planner (pure) ---------------------------------------------------------------


def test_v1_exceptions_follow_the_kernel() -> None:
    access = Policy.create(["a *:* r", "c 195:* rw", "c 195:1 rwm"], ["c 195:1 w"])
    table = v1_exceptions(access)
    # 'a' is written as its c and b rules; a deny takes bits off the exact rule only.
    assert [str(rule) for rule in table_access(table).allow] == ["b *:* r", "c *:* r", "c 195:* rw", "c 195:1 rm"]


def test_v1_refuses_what_the_kernel_would_merge_into_more() -> None:
    with pytest.raises(DeviceRuleError, match=r"cgroups v1 cannot hold 'b \*:\* wm' beside 'b \*:\* r'"):
        v1_exceptions(Policy.create(["a *:* r", "b *:* wm"]))
    # A subset merges into what one rule already grants: fine.
    assert v1_exceptions(Policy.create(["a *:* r", "b *:* rw"])) == {
        ("b", None, None): "rw", ("c", None, None): "r",
    }


def test_v1_plan_for_a_new_cgroup_denies_all_first() -> None:
    target = v1_exceptions(Policy.create(["c 1:3 rwm", "c 195:0 rw"]))
    assert plan_writes(None, target) == [
        ("devices.deny", "a"), ("devices.allow", "c 1:3 rwm"), ("devices.allow", "c 195:0 rw"),
    ]


def test_v1_plan_for_an_existing_cgroup_writes_only_the_difference_allows_first() -> None:
    current = parse_devices_list("c 1:3 rwm\nc 195:0 rw\nc 195:1 rwm\n")
    target = v1_exceptions(Policy.create(["c 1:3 rwm", "c 195:1 rw", "c 195:2 rw"]))
    assert plan_writes(current, target) == [("devices.allow", "c 195:2 rw"), ("devices.deny", "c 195:0 rw"), ("devices.deny", "c 195:1 m")]
    assert plan_writes(target, target) == []


def test_v1_plan_after_allow_all_drift_rewrites() -> None:
    target = v1_exceptions(Policy.create(["c 1:3 rwm"]))
    assert plan_writes(parse_devices_list("a *:* rwm\n"), target) == [("devices.deny", "a"), ("devices.allow", "c 1:3 rwm")]


# -- detection -------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="detection answers memory for non-root")
def test_detect_backend(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("")
    assert detect_backend(str(v2)) == ("cgroups_v2", str(v2))
    hybrid = tmp_path / "hybrid"
    (hybrid / "devices").mkdir(parents=True)
    (hybrid / "devices" / "devices.allow").write_text("")
    assert detect_backend(str(hybrid)) == ("cgroups_v1", str(hybrid / "devices"))
    with caplog.at_level(logging.WARNING):
        assert detect_backend(str(tmp_path / "none")) == ("memory", None)
    assert "nothing is isolated" in caplog.text
    assert resolve_backend("auto", str(v2)) == ("cgroups_v2", str(v2))
    assert resolve_backend("auto", str(hybrid / "devices")) == ("cgroups_v1", str(hybrid / "devices"))
    with pytest.raises(DeviceControlError, match="is neither a cgroups v1 devices hierarchy nor a cgroup2 mount"):
        resolve_backend("auto", str(tmp_path))


def test_resolve_backend() -> None:
    assert resolve_backend("memory", None) == ("memory", None)
    assert resolve_backend("cgroups_v1", None) == ("cgroups_v1", "/sys/fs/cgroup/devices")
    assert resolve_backend("cgroups_v2", "/x") == ("cgroups_v2", "/x")
    with pytest.raises(DeviceControlError, match="Unknown device backend 'v3': expected one of auto, cgroups_v1"):
        resolve_backend("v3", None)


def test_a_simulated_crash_rolls_nothing_back() -> None:
    from actors.devices.testing import SimulatedCrash

    inner = MemoryBackend()
    backend = FaultInjectingBackend(inner, crash_at=2)  # after mkdir, before the rules
    with pytest.raises(SimulatedCrash, match="simulated crash before kernel operation #2: apply"):
        backend.configure("c1", *POLICY)
    assert backend.injected and backend.operations == 1
    assert inner.state("c1") == Policy()  # left part-way: exists, denies all
    desired = Policy.create(*POLICY)
    backend.detach()  # "restarted" without the fault injector
    assert inner.reconcile("c1", desired) == ["memory:/gpu-isolator/c1: restored the device policy"]
