"""cgroups v2 on the real kernel (root only): eBPF device programs, the
checkpoint, reconcile and faults. A probe process is moved into the v2
cgroup (its v1 devices cgroup, if any, stays the root: allow all)."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import pytest

from actors.devices import (
    PROGRAM_NAME,
    Policy,
    CgroupsV2Backend,
    CheckpointError,
    DeviceControlError,
    ForeignProgramsError,
    DeviceOperation,
    DeviceRule,
    KernelOperationError,
    apply_diff,
    build_device_program,
    checkpoint_file,
    container_policy,
)
from actors.devices.testing import FaultInjectingBackend
from actors.devices import _bpf
from tests.support.kernel import attach_program, detach_program

R = DeviceRule.parse
CONTROL = ["c 195:255 rwm"]


def backend_for(sandbox, work_dir) -> CgroupsV2Backend:
    return CgroupsV2Backend(sandbox.hierarchy, sandbox.cgroups_root, str(work_dir))


def assert_enforces(sandbox, cgroup: str, access: Policy) -> int:
    """Exactly one own program is attached and it is the one ``access`` compiles to."""
    own = [info for info in sandbox.programs(cgroup) if info.name == PROGRAM_NAME]
    assert len(own) == 1, own
    assert own[0].tag in _bpf.program_tags(build_device_program(access))
    return own[0].id


def attach_extra(sandbox, cgroup: str, access: Policy, name: str = PROGRAM_NAME) -> int:
    prog_id = attach_program(os.path.join(sandbox.root, cgroup), build_device_program(access), name)
    sandbox.program_ids.append(prog_id)
    return prog_id


def detach(sandbox, cgroup: str, prog_id: int) -> None:
    detach_program(os.path.join(sandbox.root, cgroup), prog_id)


def test_configure_reconfigure_remove_as_seen_by_a_process(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    allow, deny = container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"])
    access = backend.configure("c1", allow, deny)
    first = assert_enforces(v2_sandbox, "c1", access)
    probe = v2_sandbox.probe("c1")
    assert probe.open(device_nodes["c", 195, 0]) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 1]) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 2]) == errno.EPERM
    assert probe.open(device_nodes["c", 195, 255]) == errno.ENXIO
    assert probe.open(device_nodes["b", 240, 0], os.O_RDONLY) == errno.EPERM
    assert probe.open("/dev/null") == 0

    after = backend.reconfigure("c1", [R("c 195:2 rw")], [R("c 195:1 rw")])
    assert after == backend.state("c1")
    second = assert_enforces(v2_sandbox, "c1", after)
    assert second != first  # replaced in place (BPF_F_REPLACE)
    assert probe.open(device_nodes["c", 195, 1]) == errno.EPERM
    assert probe.open(device_nodes["c", 195, 2]) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 0]) == errno.ENXIO
    assert probe.open("/dev/null") == 0

    probe.close()
    assert backend.remove("c1") is True
    assert not os.path.exists(os.path.join(v2_sandbox.root, "c1"))
    assert backend.state("c1") is None and backend.list_cgroups() == []


def test_partial_access_and_mknod(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path / "work")
    backend.configure("c1", ["c 1:3 rwm", "c 195:0 r", "c 240:* m"], [])
    probe = v2_sandbox.probe("c1")
    assert probe.open(device_nodes["c", 195, 0], os.O_RDONLY) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 0], os.O_WRONLY) == errno.EPERM
    assert probe.mknod(str(tmp_path), "c", 240, 7) == 0
    assert probe.mknod(str(tmp_path), "c", 195, 0) == errno.EPERM


def test_state_survives_a_new_backend(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    backend.configure("c2", *container_policy(CONTROL, ["c 195:1 rw"]))
    assert os.path.isfile(checkpoint_file(str(tmp_path)))
    fresh = backend_for(v2_sandbox, tmp_path)
    assert fresh.state("c1") == access and fresh.state("c2") == backend.state("c2")
    assert fresh.reconcile("c1", access) == []
    old_id = assert_enforces(v2_sandbox, "c1", access)
    after = fresh.reconfigure("c1", [R("c 195:3 rw")], [R("c 195:0 rw")])
    assert assert_enforces(v2_sandbox, "c1", after) != old_id  # found and replaced its own program
    probe = v2_sandbox.probe("c1")
    assert probe.open(device_nodes["c", 195, 3]) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 0]) == errno.EPERM


def test_checkpoint_drops_removed_cgroups(v2_sandbox, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    backend.configure("c1", *container_policy(CONTROL, []))
    backend.configure("c2", *container_policy(CONTROL, []))
    backend.remove("c1")
    assert backend_for(v2_sandbox, tmp_path).state("c1") is None
    assert backend_for(v2_sandbox, tmp_path).state("c2") is not None


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "it is empty (truncated)"),
        (b'{"version":1,"root":', "truncated or garbled"),
        (b"\x00\xffgarbage", "truncated or garbled"),
        (b'{"version":1,"root":"ROOT","cgroups":{"c1":{"allow":["c 195:0 zz"],"deny":[]}}}', "bad entry for cgroup 'c1'"),
        (b'{"version":1,"root":"ROOT","cgroups":{"../x":{"allow":[],"deny":[]}}}', "bad entry for cgroup '../x'"),
        (b'{"version":1,"root":"ROOT","cgroups":{"c1":{"allow":[]}}}', "truncated or garbled"),
        (b'{"version":2,"root":"ROOT","cgroups":{}}', "unknown version 2"),
        (b'{"version":1,"root":"/elsewhere","cgroups":{}}', "it belongs to cgroup root '/elsewhere'"),
    ],
)
def test_a_bad_checkpoint_stops_the_start_with_a_hint(v2_sandbox, tmp_path, content: bytes, reason: str) -> None:
    file = checkpoint_file(str(tmp_path))
    os.makedirs(os.path.dirname(file))
    with open(file, "wb") as handle:
        handle.write(content.replace(b"ROOT", v2_sandbox.root.encode()))
    with pytest.raises(CheckpointError) as raised:
        backend_for(v2_sandbox, tmp_path)
    message = str(raised.value)
    assert reason in message and file in message
    assert "never read as empty" in message and "Restore it from a backup" in message


def test_reconcile_detaches_a_leaked_extra_program(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    kept = assert_enforces(v2_sandbox, "c1", access)
    leaked = attach_extra(v2_sandbox, "c1", Policy.create(["a"]))
    assert backend.reconcile("c1", access) == [
        f"{v2_sandbox.root}/c1: detached leaked extra device program {leaked}"
    ]
    assert assert_enforces(v2_sandbox, "c1", access) == kept


def test_reconcile_reattaches_a_detached_program(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    probe = v2_sandbox.probe("c1")
    detach(v2_sandbox, "c1", assert_enforces(v2_sandbox, "c1", access))
    assert probe.open(device_nodes["c", 195, 1]) == errno.ENXIO  # drifted: no rules at all
    assert backend.reconcile("c1", access) == [f"{v2_sandbox.root}/c1: attached the missing device program"]
    assert_enforces(v2_sandbox, "c1", access)
    assert probe.open(device_nodes["c", 195, 1]) == errno.EPERM
    assert probe.open(device_nodes["c", 195, 0]) == errno.ENXIO
    assert probe.open("/dev/null") == 0


def test_reconcile_replaces_a_program_with_other_rules(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    ours = assert_enforces(v2_sandbox, "c1", access)
    detach(v2_sandbox, "c1", ours)
    wrong = attach_extra(v2_sandbox, "c1", Policy.create(["a"]))
    repairs = backend.reconcile("c1", access)
    assert repairs == [f"{v2_sandbox.root}/c1: replaced device program {wrong}, whose rules differed"]
    assert_enforces(v2_sandbox, "c1", access)
    probe = v2_sandbox.probe("c1")
    assert probe.open(device_nodes["c", 195, 1]) == errno.EPERM


def test_reconcile_records_new_rules_and_recreates_a_missing_cgroup(v2_sandbox, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    old = assert_enforces(v2_sandbox, "c1", backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"])))
    desired = Policy.create(*container_policy(CONTROL, ["c 195:1 rw"]))
    assert backend.reconcile("c1", desired) == [
        f"{v2_sandbox.root}/c1: recorded the desired device rules in the checkpoint",
        f"{v2_sandbox.root}/c1: replaced device program {old}, whose rules differed",
    ]
    assert_enforces(v2_sandbox, "c1", desired)
    assert backend_for(v2_sandbox, tmp_path).state("c1") == desired
    os.rmdir(os.path.join(v2_sandbox.root, "c1"))
    assert backend.reconcile("c1", desired) == [f"{v2_sandbox.root}/c1: recreated the missing cgroup"]
    assert_enforces(v2_sandbox, "c1", desired)


def test_programs_of_others_are_left_alone_and_still_apply(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"]))
    other = attach_extra(v2_sandbox, "c1", Policy.create(["a"], ["c 195:1 rw"]), name="someone_else")
    with pytest.raises(ForeignProgramsError) as reported:  # reported by reconcile, never detached on a guess
        backend.reconcile("c1", access)
    assert reported.value.program_ids == (other,) and "detach them" in str(reported.value)
    after = backend.reconfigure("c1", [R("c 195:2 rw")], [])
    assert other in v2_sandbox.attached("c1") and assert_enforces(v2_sandbox, "c1", after)
    probe = v2_sandbox.probe("c1")
    assert probe.open(device_nodes["c", 195, 0]) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 1]) == errno.EPERM  # the other program refuses it


def test_a_program_attached_without_allow_multi_is_explained(v2_sandbox, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    os.makedirs(os.path.join(v2_sandbox.root, "c1"))
    prog_fd = _bpf.prog_load(build_device_program(Policy.create(["a"])), "exclusive")
    cgroup_fd = os.open(os.path.join(v2_sandbox.root, "c1"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        _bpf.prog_attach(cgroup_fd, prog_fd, flags=0)
        v2_sandbox.program_ids.append(_bpf.prog_info(prog_fd).id)
    finally:
        os.close(cgroup_fd)
        os.close(prog_fd)
    with pytest.raises(KernelOperationError) as raised:
        backend.configure("c1", *container_policy(CONTROL, []))
    assert raised.value.errno == errno.EPERM
    assert "without BPF_F_ALLOW_MULTI" in "".join(getattr(raised.value, "__notes__", []))
    assert backend.state("c1") is None and backend_for(v2_sandbox, tmp_path).state("c1") is None


def test_remove_keeps_a_cgroup_with_processes(v2_sandbox, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, []))
    probe = v2_sandbox.probe("c1")
    with caplog.at_level(logging.WARNING):
        assert backend.remove("c1") is False
    assert "still has processes" in caplog.text
    assert backend.state("c1") == access and assert_enforces(v2_sandbox, "c1", access)
    probe.close()
    assert backend.remove("c1") is True and not backend.exists("c1")


def test_one_checkpoint_write_per_batch(v2_sandbox, tmp_path) -> None:
    backend = FaultInjectingBackend(backend_for(v2_sandbox, tmp_path))
    allow, deny = container_policy(CONTROL, ["c 195:0 rw"])
    results = backend.apply_batch(
        [DeviceOperation("configure", (f"c{i}", allow, deny)) for i in range(5)]
        + [DeviceOperation("reconfigure", ("c0", [R("c 195:1 rw")], [])), DeviceOperation("state", ("c0",))]
    )
    assert not [r for r in results if isinstance(r, BaseException)]
    assert [op for op, _ in backend.log].count("write checkpoint") == 1
    assert results[-1] == results[-2] and results[-1].is_granted("c", 195, 1, "rw")
    backend.arm(None)
    backend.apply_batch([DeviceOperation("remove", (f"c{i}",)) for i in range(5)])
    assert [op for op, _ in backend.log].count("write checkpoint") == 0  # removals need no fsync
    with open(checkpoint_file(str(tmp_path))) as handle:
        assert '"c0"' in handle.read()  # a leftover entry, for a cgroup that is gone ...
    assert backend_for(v2_sandbox, tmp_path).state("c0") is None  # ... is pruned at load
    backend.configure("c9", allow, deny)
    with open(checkpoint_file(str(tmp_path))) as handle:
        content = handle.read()
    assert '"c0"' not in content and '"c9"' in content, content


def test_a_failure_in_a_batch_fails_later_operations_on_that_cgroup_only(v2_sandbox, tmp_path) -> None:
    backend = FaultInjectingBackend(backend_for(v2_sandbox, tmp_path))
    allow, deny = container_policy(CONTROL, ["c 195:0 rw"])
    # Operation 1 writes the checkpoint, 2 is mkdir of c1, 3 opens it, 4 loads its program.
    os.makedirs(v2_sandbox.root)
    backend.arm(4)
    results = backend.apply_batch(
        [
            DeviceOperation("configure", ("c1", allow, deny)),
            DeviceOperation("configure", ("c2", allow, deny)),
            DeviceOperation("reconfigure", ("c1", [R("c 195:1 rw")], [])),
        ]
    )
    assert isinstance(results[0], KernelOperationError) and "load device program" in str(results[0])
    assert isinstance(results[1], Policy)
    assert isinstance(results[2], DeviceControlError)
    assert "an earlier operation on it in the same batch failed" in str(results[2])
    assert not backend.exists("c1") and backend.state("c1") is None
    fresh = backend_for(v2_sandbox, tmp_path)
    assert fresh.state("c1") is None and fresh.state("c2") == results[1]


def _operations(sandbox, work_dir, call) -> list[str]:
    counting = FaultInjectingBackend(backend_for(sandbox, work_dir))
    call(counting)
    return [op for op, _ in counting.log]


def test_a_fault_at_every_kernel_operation_of_configure_leaves_nothing(v2_sandbox, tmp_path) -> None:
    allow, deny = container_policy(CONTROL, ["c 195:0 rw"])
    os.makedirs(v2_sandbox.root)
    ops = _operations(v2_sandbox, tmp_path / "count", lambda b: b.configure("probe", allow, deny))
    assert ops == [
        "write checkpoint", "mkdir", "open", "load device program for", "read program info for",
        "attach device program to", "query device programs of",
    ]
    for k in range(1, len(ops) + 1):
        work_dir = tmp_path / f"k{k}"
        backend = FaultInjectingBackend(backend_for(v2_sandbox, work_dir), fail_at=k, errno=errno.ENOSPC)
        with pytest.raises(KernelOperationError, match=f"injected at kernel operation #{k}"):
            backend.configure("c1", allow, deny)
        assert not backend.exists("c1"), f"fault at {ops[k - 1]} left the cgroup behind"
        assert backend.state("c1") is None
        assert backend_for(v2_sandbox, work_dir).state("c1") is None


def test_a_fault_at_every_kernel_operation_of_reconfigure_rolls_back(v2_sandbox, device_nodes, tmp_path) -> None:
    plain = backend_for(v2_sandbox, tmp_path)
    before = plain.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    add, remove = [R("c 195:1 rw")], [R("c 195:0 rw")]
    ops = _operations(v2_sandbox, tmp_path, lambda b: b.reconfigure("c1", add, remove) and b.reconfigure("c1", remove, add))
    per_call = len(ops) // 2
    assert ops[:per_call] == [
        "write checkpoint", "open", "query device programs of", "open device program",
        "read info of device program", "load device program for", "read program info for",
        "attach (replace) device program to", "query device programs of",
    ]
    probe = v2_sandbox.probe("c1")
    for k in range(1, per_call + 1):
        backend = FaultInjectingBackend(plain, fail_at=k)
        with pytest.raises(KernelOperationError):
            backend.reconfigure("c1", add, remove)
        assert plain.state("c1") == before, f"fault at {ops[k - 1]} changed the state"
        assert backend_for(v2_sandbox, tmp_path).state("c1") == before
        assert_enforces(v2_sandbox, "c1", before)
        assert probe.open(device_nodes["c", 195, 0]) == errno.ENXIO
        assert probe.open(device_nodes["c", 195, 1]) == errno.EPERM


def test_a_fault_in_remove_keeps_cgroup_and_state(v2_sandbox, tmp_path) -> None:
    plain = backend_for(v2_sandbox, tmp_path)
    access = plain.configure("c1", *container_policy(CONTROL, []))
    backend = FaultInjectingBackend(plain, fail_at=1, errno=errno.EIO)
    with pytest.raises(KernelOperationError, match="Failed to rmdir"):
        backend.remove("c1")
    assert plain.exists("c1") and plain.state("c1") == access
    assert_enforces(v2_sandbox, "c1", access)


def test_nested_cgroups(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox, tmp_path)
    backend.configure("parent", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"]))
    backend.configure("parent/child", *container_policy(CONTROL, ["c 195:1 rw", "c 195:2 rw"]))
    assert backend.list_cgroups() == ["parent", "parent/child"]
    probe = v2_sandbox.probe("parent/child")
    assert probe.open(device_nodes["c", 195, 1]) == errno.ENXIO
    assert probe.open(device_nodes["c", 195, 0]) == errno.EPERM  # the child's program refuses
    assert probe.open(device_nodes["c", 195, 2]) == errno.EPERM  # the parent's program refuses
    assert backend.remove("parent") is False
    probe.close()
    assert backend.remove("parent/child") and backend.remove("parent")
    assert backend_for(v2_sandbox, tmp_path).list_cgroups() == []


def test_a_crash_after_every_kernel_operation_recovers_from_the_checkpoint(v2_sandbox, tmp_path) -> None:
    from actors.devices.testing import SimulatedCrash

    plain = backend_for(v2_sandbox, tmp_path)
    before = plain.configure("c1", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"]))
    after = apply_diff(before, [R("c 195:2 rw")], [R("c 195:1 rw")])
    crashes = 0
    for k in range(1, 100):
        crashing = FaultInjectingBackend(backend_for(v2_sandbox, tmp_path), crash_at=k)
        try:  # a new cgroup, then a GPU swapped (one granted, one revoked)
            crashing.configure("c2", before.allow, before.deny)
            crashing.reconfigure("c1", [R("c 195:2 rw")], [R("c 195:1 rw")])
        except SimulatedCrash:
            crashes += 1
        else:
            break
        finally:
            crashing.close()
        # Recovery: the checkpoint is the truth; reconcile makes the kernel obey it.
        restarted = backend_for(v2_sandbox, tmp_path)
        assert restarted.state("c1") in (before, after), f"crash before operation {k}"
        for cgroup in ("c1", "c2"):
            recorded = restarted.state(cgroup)
            if recorded is None:
                assert cgroup == "c2" and not restarted.exists("c2"), f"crash before operation {k}"
                continue
            restarted.reconcile(cgroup, recorded)
            assert_enforces(v2_sandbox, cgroup, recorded)
        restarted.configure("c1", before.allow, before.deny)
        restarted.remove("c2")
        restarted.close()
    assert crashes >= 10


def test_a_load_the_verifier_broke_off_with_eagain_is_tried_again(v2_sandbox, tmp_path, monkeypatch) -> None:
    """The verifier answers EAGAIN when a signal is pending for the loading
    thread (the random fault run hit it with SIGSTOP/SIGCONT): not an error
    of the program, so the load is tried again, as libbpf does."""
    real = _bpf.bpf
    loads: list[int] = []

    def interrupted(cmd: int, attr: Any) -> int:
        if cmd == _bpf.BPF_PROG_LOAD:
            loads.append(cmd)
            if len(loads) <= failures:
                raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real(cmd, attr)

    monkeypatch.setattr(_bpf, "bpf", interrupted)
    failures = _bpf.PROG_LOAD_ATTEMPTS - 1
    backend = backend_for(v2_sandbox, tmp_path)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:1 rw"]))
    assert len(loads) == _bpf.PROG_LOAD_ATTEMPTS
    assert_enforces(v2_sandbox, "c1", access)
    loads.clear()
    failures = _bpf.PROG_LOAD_ATTEMPTS  # never gets through: the kernel's error, with its errno
    with pytest.raises(KernelOperationError, match=r"Failed to load device program for .*c2.*\(EAGAIN\)") as raised:
        backend.configure("c2", *container_policy(CONTROL, ["c 195:2 rw"]))
    assert raised.value.errno == errno.EAGAIN and len(loads) == _bpf.PROG_LOAD_ATTEMPTS
    assert not os.path.isdir(os.path.join(v2_sandbox.root, "c2"))  # rolled back
    backend.close()
