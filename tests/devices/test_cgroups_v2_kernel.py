"""cgroups v2 on the real kernel (root only): eBPF device programs, the
policy read back from the kernel (no file: the kernel is the record),
reconcile, faults and crashes. A probe process is moved into the v2 cgroup
(its v1 devices cgroup, if any, stays the root: allow all)."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from actors.devices import PROGRAM_NAME, Policy, CgroupsV2Backend, DeviceControlError, ForeignProgramsError
from actors.devices import DeviceOperation, DeviceRule, KernelOperationError, apply_diff, build_device_program
from actors.devices import container_policy
from actors.devices.testing import FaultInjectingBackend
from actors.devices import _bpf
from actors.devices._cgroups_v2 import ALLOW_ALL
from tests.support.probes import DENIED, GRANTED, assert_verdicts
from tests.support.kernel import attach_program, detach_program

R = DeviceRule.parse
CONTROL = ["c 195:255 rwm"]


def backend_for(sandbox) -> CgroupsV2Backend:
    return CgroupsV2Backend(sandbox.hierarchy, sandbox.cgroups_root)


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
    backend = backend_for(v2_sandbox)
    allow, deny = container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"])
    access = backend.configure("c1", allow, deny)
    first = assert_enforces(v2_sandbox, "c1", access)
    probe = v2_sandbox.probe("c1")
    assert_verdicts(probe, device_nodes, granted=[("c", 195, 0), ("c", 195, 1), ("c", 195, 255), "/dev/null"],
                    denied=[("c", 195, 2), ("b", 240, 0)])

    after = backend.reconfigure("c1", [R("c 195:2 rw")], [R("c 195:1 rw")])
    assert after == backend.state("c1")
    second = assert_enforces(v2_sandbox, "c1", after)
    assert second != first  # replaced in place (BPF_F_REPLACE)
    assert_verdicts(probe, device_nodes, granted=[("c", 195, 2), ("c", 195, 0), "/dev/null"], denied=[("c", 195, 1)])

    probe.close()
    assert backend.remove("c1") is True
    assert not os.path.exists(os.path.join(v2_sandbox.root, "c1"))
    assert backend.state("c1") is None and backend.list_cgroups() == []


def test_partial_access_and_mknod(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    backend.configure("c1", ["c 1:3 rwm", "c 195:0 r", "c 240:* m"], [])
    probe = v2_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 0], os.O_RDONLY) == GRANTED
    assert probe.access(device_nodes["c", 195, 0], os.O_WRONLY) == DENIED
    assert probe.may_mknod(str(tmp_path), "c", 240, 7) == GRANTED
    assert probe.may_mknod(str(tmp_path), "c", 195, 0) == DENIED


def test_state_is_read_back_from_the_kernel_by_a_new_backend(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    backend.configure("c2", *container_policy(CONTROL, ["c 195:1 rw"]))
    assert os.listdir(tmp_path) == []  # no file anywhere: the kernel holds the record
    fresh = backend_for(v2_sandbox)
    assert fresh.state("c1") == access and fresh.state("c2") == backend.state("c2")
    assert fresh.reconcile("c1", access) == []
    old_id = assert_enforces(v2_sandbox, "c1", access)
    after = fresh.reconfigure("c1", [R("c 195:3 rw")], [R("c 195:0 rw")])
    assert assert_enforces(v2_sandbox, "c1", after) != old_id  # found and replaced its own program
    probe = v2_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 3]) == GRANTED
    assert probe.access(device_nodes["c", 195, 0]) == DENIED


def test_a_removed_cgroup_has_no_state(v2_sandbox, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    backend.configure("c1", *container_policy(CONTROL, []))
    backend.configure("c2", *container_policy(CONTROL, []))
    backend.remove("c1")
    assert backend_for(v2_sandbox).state("c1") is None
    assert backend_for(v2_sandbox).state("c2") is not None


def test_state_says_what_the_kernel_lets_the_cgroup_use(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    gpu0 = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    ours = assert_enforces(v2_sandbox, "c1", gpu0)
    # several programs of ours (a leak): the first, which grants at least what they grant together
    leaked = attach_extra(v2_sandbox, "c1", Policy.create(*container_policy(CONTROL, [])))
    assert backend_for(v2_sandbox).state("c1") == gpu0
    detach(v2_sandbox, "c1", ours)
    assert backend_for(v2_sandbox).state("c1") == Policy.create(*container_policy(CONTROL, []))
    # no program of ours: nothing of ours restricts it (a process inside may open any device)
    detach(v2_sandbox, "c1", leaked)
    other = attach_extra(v2_sandbox, "c1", Policy.create(["a"], ["c 195:1 rw"]), name="someone_else")
    assert backend_for(v2_sandbox).state("c1") == ALLOW_ALL == Policy.create(["a"])
    probe = v2_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 0]) == GRANTED
    # a program of our name that this library did not write: unknown, never read as a policy
    odd = attach_program(os.path.join(v2_sandbox.root, "c1"), bytes.fromhex("b7000000010000009500000000000000"),
                         PROGRAM_NAME)  # r0 = 1; exit
    v2_sandbox.program_ids.append(odd)
    assert backend_for(v2_sandbox).state("c1") is None
    assert backend_for(v2_sandbox).state("missing") is None
    assert other in v2_sandbox.attached("c1")


def test_reconcile_detaches_a_leaked_extra_program(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    kept = assert_enforces(v2_sandbox, "c1", access)
    leaked = attach_extra(v2_sandbox, "c1", Policy.create(["a"]))
    assert backend.reconcile("c1", access) == [
        f"{v2_sandbox.root}/c1: detached leaked extra device program {leaked}"
    ]
    assert assert_enforces(v2_sandbox, "c1", access) == kept


def test_reconcile_reattaches_a_detached_program(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    probe = v2_sandbox.probe("c1")
    detach(v2_sandbox, "c1", assert_enforces(v2_sandbox, "c1", access))
    assert probe.access(device_nodes["c", 195, 1]) == GRANTED  # drifted: no rules at all
    assert backend.reconcile("c1", access) == [f"{v2_sandbox.root}/c1: attached the missing device program"]
    assert_enforces(v2_sandbox, "c1", access)
    assert probe.access(device_nodes["c", 195, 1]) == DENIED
    assert probe.access(device_nodes["c", 195, 0]) == GRANTED
    assert probe.access("/dev/null") == GRANTED


def test_reconcile_replaces_a_program_with_other_rules(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    ours = assert_enforces(v2_sandbox, "c1", access)
    detach(v2_sandbox, "c1", ours)
    wrong = attach_extra(v2_sandbox, "c1", Policy.create(["a"]))
    repairs = backend.reconcile("c1", access)
    assert repairs == [f"{v2_sandbox.root}/c1: replaced device program {wrong}, whose rules differed"]
    assert_enforces(v2_sandbox, "c1", access)
    probe = v2_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 1]) == DENIED


def test_reconcile_replaces_the_rules_and_recreates_a_missing_cgroup(v2_sandbox, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    old = assert_enforces(v2_sandbox, "c1", backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"])))
    desired = Policy.create(*container_policy(CONTROL, ["c 195:1 rw"]))
    assert backend.reconcile("c1", desired) == [
        f"{v2_sandbox.root}/c1: replaced device program {old}, whose rules differed",
    ]
    assert_enforces(v2_sandbox, "c1", desired)
    assert backend_for(v2_sandbox).state("c1") == desired
    os.rmdir(os.path.join(v2_sandbox.root, "c1"))
    assert backend.reconcile("c1", desired) == [f"{v2_sandbox.root}/c1: recreated the missing cgroup"]
    assert_enforces(v2_sandbox, "c1", desired)


def test_a_replace_finds_the_cgroup_as_it_is_when_someone_changed_it(v2_sandbox, device_nodes, tmp_path) -> None:
    """The backend replaces the program it attached last straight away; when
    that program is gone, or another of ours was added meanwhile, it looks
    the programs up and still leaves exactly one, the right one."""
    backend = backend_for(v2_sandbox)
    gpu0 = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    gpu1 = Policy.create(*container_policy(CONTROL, ["c 195:1 rw"]))
    probe = v2_sandbox.probe("c1")
    detach(v2_sandbox, "c1", assert_enforces(v2_sandbox, "c1", gpu0))  # ours went away
    stranger = attach_extra(v2_sandbox, "c1", Policy.create(["a"]))  # and another of our name came
    assert backend.configure("c1", gpu1.allow, gpu1.deny) == gpu1
    assert assert_enforces(v2_sandbox, "c1", gpu1) != stranger  # replaced in place
    assert probe.access(device_nodes["c", 195, 0]) == DENIED
    leaked = attach_extra(v2_sandbox, "c1", Policy.create(["a"]))  # an extra one beside ours
    assert backend.configure("c1", gpu0.allow, gpu0.deny) == gpu0
    assert leaked not in v2_sandbox.attached("c1")
    assert_enforces(v2_sandbox, "c1", gpu0)
    assert probe.access(device_nodes["c", 195, 0]) == GRANTED
    assert probe.access(device_nodes["c", 195, 1]) == DENIED
    assert backend.configure("c1", gpu0.allow, gpu0.deny) == gpu0  # the same policy: nothing to swap
    assert_enforces(v2_sandbox, "c1", gpu0)


def test_programs_of_others_are_left_alone_and_still_apply(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"]))
    other = attach_extra(v2_sandbox, "c1", Policy.create(["a"], ["c 195:1 rw"]), name="someone_else")
    with pytest.raises(ForeignProgramsError) as reported:  # reported by reconcile, never detached on a guess
        backend.reconcile("c1", access)
    assert reported.value.program_ids == (other,) and "detach them" in str(reported.value)
    after = backend.reconfigure("c1", [R("c 195:2 rw")], [])
    assert other in v2_sandbox.attached("c1") and assert_enforces(v2_sandbox, "c1", after)
    probe = v2_sandbox.probe("c1")
    assert probe.access(device_nodes["c", 195, 0]) == GRANTED
    assert probe.access(device_nodes["c", 195, 1]) == DENIED  # the other program refuses it


def test_a_program_attached_without_allow_multi_is_explained(v2_sandbox, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
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
    assert backend.state("c1") == ALLOW_ALL  # no program of ours there (another's restricts it)


def test_remove_keeps_a_cgroup_with_processes(v2_sandbox, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, []))
    probe = v2_sandbox.probe("c1")
    with caplog.at_level(logging.WARNING):
        assert backend.remove("c1") is False
    assert "still has processes" in caplog.text
    assert backend.state("c1") == access and assert_enforces(v2_sandbox, "c1", access)
    probe.close()
    assert backend.remove("c1") is True and not backend.exists("c1")


def test_a_batch_writes_no_file_and_applies_its_operations_one_by_one(v2_sandbox, tmp_path) -> None:
    backend = FaultInjectingBackend(backend_for(v2_sandbox))
    allow, deny = container_policy(CONTROL, ["c 195:0 rw"])
    results = backend.apply_batch(
        [DeviceOperation("configure", (f"c{i}", allow, deny)) for i in range(5)]
        + [DeviceOperation("reconfigure", ("c0", [R("c 195:1 rw")], [])), DeviceOperation("state", ("c0",))]
    )
    assert not [r for r in results if isinstance(r, BaseException)]
    assert results[-1] == results[-2] and results[-1].is_granted("c", 195, 1, "rw")
    assert {op for op, _ in backend.log} <= {
        "mkdir", "open", "load device program for", "read program info for", "attach device program to",
        "query device programs of", "open device program", "read info of device program",
        "read the instructions of device program", "attach (replace) device program to",
    }, backend.log
    assert [op for op, _ in backend.log].count("load device program for") == 2  # one per distinct policy
    assert os.listdir(tmp_path) == []
    backend.arm(None)
    backend.apply_batch([DeviceOperation("remove", (f"c{i}",)) for i in range(5)])
    assert [op for op, _ in backend.log] == ["rmdir"] * 5


def test_a_failure_in_a_batch_leaves_the_other_operations_alone(v2_sandbox, tmp_path) -> None:
    backend = FaultInjectingBackend(backend_for(v2_sandbox))
    allow, deny = container_policy(CONTROL, ["c 195:0 rw"])
    # Operation 1 is mkdir of c1, 2 opens it, 3 loads its program.
    os.makedirs(v2_sandbox.root)
    backend.arm(3)
    results = backend.apply_batch(
        [
            DeviceOperation("configure", ("c1", allow, deny)),
            DeviceOperation("configure", ("c2", allow, deny)),
            DeviceOperation("reconfigure", ("c1", [R("c 195:1 rw")], [])),
        ]
    )
    assert isinstance(results[0], KernelOperationError) and "load device program" in str(results[0])
    assert isinstance(results[1], Policy)
    assert isinstance(results[2], DeviceControlError) and "does not exist" in str(results[2])  # c1 was undone
    assert not backend.exists("c1") and backend.state("c1") is None
    fresh = backend_for(v2_sandbox)
    assert fresh.state("c1") is None and fresh.state("c2") == results[1]


def _operations(sandbox, call) -> list[str]:
    return _operations_on(backend_for(sandbox), call)


def _operations_on(backend, call) -> list[str]:
    counting = FaultInjectingBackend(backend)
    call(counting)
    counting.detach()
    return [op for op, _ in counting.log]


def test_a_fault_at_every_kernel_operation_of_configure_leaves_nothing(v2_sandbox, tmp_path) -> None:
    allow, deny = container_policy(CONTROL, ["c 195:0 rw"])
    os.makedirs(v2_sandbox.root)
    ops = _operations(v2_sandbox, lambda b: b.configure("probe", allow, deny))
    assert ops == [  # no query after: a cgroup this call made had no program, the attach left ours alone
        "mkdir", "open", "load device program for", "read program info for", "attach device program to",
    ]
    for k in range(1, len(ops) + 1):
        backend = FaultInjectingBackend(backend_for(v2_sandbox), fail_at=k, errno=errno.ENOSPC)
        with pytest.raises(KernelOperationError, match=f"injected at kernel operation #{k}"):
            backend.configure("c1", allow, deny)
        assert not backend.exists("c1"), f"fault at {ops[k - 1]} left the cgroup behind"
        assert backend.state("c1") is None
        assert backend_for(v2_sandbox).state("c1") is None


def test_a_fault_at_every_kernel_operation_of_reconfigure_rolls_back(v2_sandbox, device_nodes, tmp_path) -> None:
    plain = backend_for(v2_sandbox)
    before = plain.configure("c1", *container_policy(CONTROL, ["c 195:0 rw"]))
    add, remove = [R("c 195:1 rw")], [R("c 195:0 rw")]
    # A backend that did not attach c1's program reads it back first (what to put back on failure).
    reading = ["open", "query device programs of", "open device program", "read info of device program",
               "read the instructions of device program"]
    replacing = [
        "open", "query device programs of", "open device program",
        "read info of device program", "load device program for", "read program info for",
        "attach (replace) device program to", "query device programs of",
    ]
    probe = v2_sandbox.probe("c1")
    for k in range(1, len(reading + replacing) + 1):  # a fault at each: the cgroup keeps its program
        backend = FaultInjectingBackend(backend_for(v2_sandbox), fail_at=k)
        with pytest.raises(KernelOperationError, match=f"injected at kernel operation #{k}"):
            backend.reconfigure("c1", add, remove)
        assert backend_for(v2_sandbox).state("c1") == before, f"fault at {(reading + replacing)[k - 1]}"
        assert probe.access(device_nodes["c", 195, 1]) == DENIED
        backend.close()
    assert _operations(v2_sandbox, lambda b: b.reconfigure("c1", add, remove)) == reading + replacing
    assert_enforces(v2_sandbox, "c1", apply_diff(before, add, remove))
    # The backend that attached c1's program last goes straight to the replace; here the kernel
    # holds another backend's program since, so the check after finds it and looks every one up.
    counting = FaultInjectingBackend(plain)
    counting.reconfigure("c1", remove, add)
    ops = [op for op, _ in counting.log]
    looking_up = ["open", "query device programs of", "open device program", "read info of device program",
                  "attach (replace) device program to", "query device programs of"]  # its program is loaded
    assert ops == ["open", "query device programs of", "open device program", "read info of device program",
                   *looking_up]
    assert_enforces(v2_sandbox, "c1", before)
    # Now its program is c1's: the quick replace, and a fault at each of its operations (each k
    # grants another GPU, so that its program is loaded anew).
    quick = ["open", "load device program for", "read program info for", "attach (replace) device program to",
             "query device programs of"]
    for k in range(1, len(quick) + 1):
        grant = [R(f"c 195:{10 + k} rw")]
        backend = FaultInjectingBackend(plain, fail_at=k)
        if quick[k - 1] == "attach (replace) device program to":
            # A failed replace of the program this backend attached is looked up again (the kernel may
            # hold another's): the fault is absorbed, the reconfigure done; put c1 back.
            assert backend.reconfigure("c1", grant, remove) == apply_diff(before, grant, remove)
            assert backend.injected and plain.state("c1") == apply_diff(before, grant, remove)
            backend.arm(None)
            backend.reconfigure("c1", remove, grant)
        else:
            with pytest.raises(KernelOperationError):
                backend.reconfigure("c1", grant, remove)
            assert [op for op, _ in backend.log][:k] == quick[:k]  # the quick replace, up to the fault
        assert plain.state("c1") == before, f"fault at {quick[k - 1]} changed the state"
        assert backend_for(v2_sandbox).state("c1") == before
        assert_enforces(v2_sandbox, "c1", before)
        assert probe.access(device_nodes["c", 195, 0]) == GRANTED
        assert probe.access(device_nodes["c", 195, 1]) == DENIED


def test_a_fault_in_remove_keeps_cgroup_and_state(v2_sandbox, tmp_path) -> None:
    plain = backend_for(v2_sandbox)
    access = plain.configure("c1", *container_policy(CONTROL, []))
    backend = FaultInjectingBackend(plain, fail_at=1, errno=errno.EIO)
    with pytest.raises(KernelOperationError, match="Failed to rmdir"):
        backend.remove("c1")
    assert plain.exists("c1") and plain.state("c1") == access
    assert_enforces(v2_sandbox, "c1", access)


def test_nested_cgroups(v2_sandbox, device_nodes, tmp_path) -> None:
    backend = backend_for(v2_sandbox)
    backend.configure("parent", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"]))
    backend.configure("parent/child", *container_policy(CONTROL, ["c 195:1 rw", "c 195:2 rw"]))
    assert backend.list_cgroups() == ["parent", "parent/child"]
    probe = v2_sandbox.probe("parent/child")
    assert probe.access(device_nodes["c", 195, 1]) == GRANTED
    assert probe.access(device_nodes["c", 195, 0]) == DENIED  # the child's program refuses
    assert probe.access(device_nodes["c", 195, 2]) == DENIED  # the parent's program refuses
    assert backend.remove("parent") is False
    probe.close()
    assert backend.remove("parent/child") and backend.remove("parent")
    assert backend_for(v2_sandbox).list_cgroups() == []


def test_a_crash_after_every_kernel_operation_is_read_back_from_the_kernel(v2_sandbox, tmp_path) -> None:
    """No file is written on the way, so there is no crash between an attach
    and a record of it: whatever the kernel held when the agent died is what
    a new backend reads back -- the old rules or the new ones, never a mix."""
    from actors.devices.testing import SimulatedCrash

    plain = backend_for(v2_sandbox)
    before = plain.configure("c1", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw"]))
    after = apply_diff(before, [R("c 195:2 rw")], [R("c 195:1 rw")])
    c1 = os.path.join(v2_sandbox.root, "c1")
    crashes = swapped = fresh = 0
    for k in range(1, 100):
        crashing = FaultInjectingBackend(backend_for(v2_sandbox), crash_at=k)
        try:  # a new cgroup, then a GPU swapped (one granted, one revoked)
            crashing.configure("c2", before.allow, before.deny)
            crashing.reconfigure("c1", [R("c 195:2 rw")], [R("c 195:1 rw")])
        except SimulatedCrash:
            crashes += 1
        else:
            break
        finally:
            crashing.close()
        restarted = backend_for(v2_sandbox)
        attached = ("attach (replace) device program to", c1) in crashing.log
        state = restarted.state("c1")
        if attached:  # the replace was tried (the quick one fails when the kernel holds another's program)
            assert state in (before, after), f"crash before operation {k}"
        else:
            assert state == before, f"crash before operation {k}"
        swapped += state == after
        assert_enforces(v2_sandbox, "c1", state)
        state = restarted.state("c2")
        if not restarted.exists("c2"):
            assert state is None, f"crash before operation {k}"
        elif state == ALLOW_ALL:  # made, its program not attached yet: nothing of ours restricts it
            fresh += 1
            assert v2_sandbox.attached("c2") == [], f"crash before operation {k}"
        else:
            assert state == before, f"crash before operation {k}"
        if restarted.exists("c2"):
            assert restarted.reconcile("c2", before) in ([], [f"{v2_sandbox.root}/c2: attached the missing device program"])
            assert_enforces(v2_sandbox, "c2", before)
        restarted.configure("c1", before.allow, before.deny)
        restarted.remove("c2")
        restarted.close()
    assert crashes >= 10 and swapped >= 1 and fresh >= 1


def _jit_harden() -> str:
    try:
        with open("/proc/sys/net/core/bpf_jit_harden") as handle:
            return handle.read().strip()
    except OSError:
        return "unknown"


@pytest.mark.skipif(_jit_harden() != "2", reason="the kernel blinds constants only with net.core.bpf_jit_harden=2"
                    f" (here {_jit_harden()}); tests/devices/test_device_program.py checks the rewrite offline")
def test_a_kernel_that_blinds_constants_still_holds_a_readable_record(v2_sandbox) -> None:
    backend = backend_for(v2_sandbox)
    access = backend.configure("c1", *container_policy(CONTROL, ["c 195:0 rw", "c 195:1 rw", "c 195:5 rw"]))
    (prog_id,) = v2_sandbox.attached("c1")
    fd = _bpf.prog_get_fd_by_id(prog_id)
    try:
        xlated = _bpf.prog_xlated(fd, _bpf.prog_info(fd).xlated_len)
    finally:
        os.close(fd)
    assert xlated != access.program[0]  # blinded
    assert backend_for(v2_sandbox).state("c1") == access
    backend.close()
