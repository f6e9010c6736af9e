"""SPEC 22 (R-NL-1..3, R-NL-5): the node ledger's files -- leases, owner locks
judged by the kernel, the mutex, the pure take/return decision, where the
directory is by default."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.flags import Flags, FlagsError
from actors.ledger import (
    DEFAULT_NODE_LEDGER,
    Lease,
    LeaseBatch,
    LedgerDirectory,
    LedgerError,
    TakeRequest,
    LeaseConflict,
    decide,
    describe_conflicts,
    describe_node_ledger,
    isolator_owner,
    lease_file_name,
    node_ledger_dir,
    serve_owner,
)

from tests.support.ledger import ledger_command

A = "isolator:/var/lib/a"
B = "serve:/run/gpu-isolator/gpu-isolator.sock"
GPU0, GPU1 = "GPU-0000", "GPU-1111"
MIG01 = "MIG-0001"


def lease(unit: str, owner: str, *holders: str, parent: str | None = None) -> Lease:
    return Lease(unit=unit, owner=owner, holders=holders, parent=parent)


def take(*leases: Lease, partial: bool = False) -> TakeRequest:
    return TakeRequest(leases=leases, partial=partial)


# -- the decision ------------------------------------------------------------------------
def test_a_take_is_all_or_nothing_and_names_every_unit_in_the_way() -> None:
    held = {GPU1: lease(GPU1, B, "exec-1")}
    after, [result] = decide(held, A, LeaseBatch(takes=(take(lease(GPU0, A, "c1"), lease(GPU1, A, "c1")),)))
    assert after == held and result.taken == ()
    assert [conflict.describe() for conflict in result.conflicts] == [f"{GPU1} is held by {B} for exec-1"]
    after, [result] = decide(held, A, LeaseBatch(takes=(take(lease(GPU0, A, "c1"), lease(GPU1, A, "c1"),
                                                             partial=True),)))
    assert result.taken == (GPU0,) and after[GPU0].owner == A and after[GPU1].owner == B


def test_a_refusal_names_each_other_owner_once_with_its_units() -> None:
    """R-SH-5: one sentence an owner, its units listed in it; every fact of the per-unit text kept: each
    unit, the owner and its state (what to do when it is gone), the holders (per unit when they differ),
    a unit in the way through another, an unreadable file to remove."""
    dead = " (not running: its units wait for it to restart and reconcile, or for 'gpu-isolator ledger release"
    units = [f"GPU-{n:04d}" for n in range(4)]
    conflicts = [LeaseConflict(unit=u, device=f"195:{n}", lease=Lease(unit=u, owner=B, holders=("job",),
                                                                      device=f"195:{n}"), alive=False)
                 for n, u in enumerate(units[:3])]
    conflicts.insert(1, LeaseConflict(unit=units[3], lease=lease(units[3], A, "c1", "c2"), alive=True))
    mig = LeaseConflict(unit=GPU0, lease=Lease(unit=MIG01, owner=B, holders=("claim-1",), parent=GPU0,
                                               device="195:0/gi1/ci0"), alive=False)
    assert describe_conflicts(conflicts + [mig]) == (
        f"GPU-0000 (195:0), GPU-0001 (195:1), GPU-0002 (195:2), {GPU0} through {MIG01} (195:0/gi1/ci0) are held"
        f" by {B}{dead} --owner {B}') (195:0, 195:1, 195:2 for job; 195:0/gi1/ci0 for claim-1);"
        f" GPU-0003 is held by {A} (running) for c1, c2")
    assert describe_conflicts(conflicts[:1]) == conflicts[0].describe()  # one unit: the text it always was
    # an unreadable lease file is an owner of its own (one unit each): each file named, to remove
    unreadable = [LeaseConflict(unit=u, lease=lease(u, f"unreadable:/l/units/{u}.lease")) for u in units[:2]]
    assert describe_conflicts(unreadable) == "; ".join(
        f"{u} is held by unreadable:/l/units/{u}.lease (its lease file cannot be read; once no container uses the"
        f" unit, remove /l/units/{u}.lease) with no holder (its owner keeps it for a moment before returning it,"
        " or is recovering)" for u in units[:2])


def test_a_mig_device_and_its_parent_gpu_conflict_both_ways() -> None:
    mig_held = {MIG01: lease(MIG01, B, "claim-1", parent=GPU0)}
    _, [whole] = decide(mig_held, A, LeaseBatch(takes=(take(lease(GPU0, A, "c1")),)))
    assert [c.describe() for c in whole.conflicts] == [f"{GPU0} conflicts with {MIG01}, held by {B} for claim-1"]
    gpu_held = {GPU0: lease(GPU0, A, "c1")}
    _, [part] = decide(gpu_held, B, LeaseBatch(takes=(take(lease(MIG01, B, "claim-1", parent=GPU0)),)))
    assert part.conflicts[0].lease == gpu_held[GPU0]
    # the same owner holds both without conflict (sharing stays inside one owner)
    after, [ok] = decide(gpu_held, A, LeaseBatch(takes=(take(lease(MIG01, A, "c2", parent=GPU0)),)))
    assert ok.ok and set(after) == {GPU0, MIG01}


def test_only_the_owners_own_leases_are_returned_or_rewritten_and_a_return_frees_for_a_take() -> None:
    held = {GPU0: lease(GPU0, A, "c1"), GPU1: lease(GPU1, B, "exec-1")}
    batch = LeaseBatch(returns=(GPU0, GPU1), rewrites=(lease(GPU1, A, "c9"),),
                       takes=(take(lease(GPU0, A, "c2")),))
    after, [result] = decide(held, A, batch)
    assert result.ok and after == {GPU0: lease(GPU0, A, "c2"), GPU1: held[GPU1]}


# -- names and where the directory is --------------------------------------------------------
def test_lease_file_names_are_one_plain_component_for_any_uuid() -> None:
    assert lease_file_name("GPU-1a2b") == "GPU-1a2b.lease"
    assert lease_file_name("MIG-GPU-1a2b/1/0") == "MIG-GPU-1a2b%2F1%2F0.lease"
    assert lease_file_name("../x") == "%2E%2E%2Fx.lease"
    for bad in ("", "x" * 129, "GPU-\n", "GPU-\u202e"):
        with pytest.raises(LedgerError, match="Invalid unit UUID"):
            lease_file_name(bad)
    assert len(lease_file_name("MIG-" + "/" * 80)) == 250  # the longest file name it makes: 255 with '..tmp'
    with pytest.raises(LedgerError, match=r"^Invalid unit UUID 'MIG-/{81}' for the node ledger: its lease file"
                                          r" name would be 253 bytes \(85 characters, each but letters, digits and"
                                          r" '-' written as three\), beyond what a file name may be \(255 bytes"
                                          r" with its '.<name>.tmp'\)$"):
        lease_file_name("MIG-" + "/" * 81)
    assert isolator_owner("/var/lib/../lib/a") == "isolator:/var/lib/a"
    assert serve_owner("/run/x.sock") == "serve:/run/x.sock"


def test_the_default_directory_is_shared_on_the_real_nvml_and_off_on_a_simulated_node() -> None:
    real, simulated = Flags(), Flags(host_file="node.toml")
    assert node_ledger_dir(real, {}) == DEFAULT_NODE_LEDGER == "/run/gpu-isolator/ledger"
    assert node_ledger_dir(real, {"GPU_ISOLATOR_NODE_LEDGER": "/srv/ledger"}) == "/srv/ledger"
    assert node_ledger_dir(real, {"GPU_ISOLATOR_NODE_LEDGER": ""}) is None
    with pytest.raises(LedgerError, match=r"^Invalid \$GPU_ISOLATOR_NODE_LEDGER 'run/ledger': expected an absolute"
                                          r" directory \(as --node_ledger\), or an empty value to turn the node"
                                          r" ledger off$"):
        node_ledger_dir(real, {"GPU_ISOLATOR_NODE_LEDGER": "run/ledger"})
    assert node_ledger_dir(simulated, {"GPU_ISOLATOR_NODE_LEDGER": "/srv/ledger"}) is None
    given = Flags.from_args(["--host_file=node.toml", "--node_ledger=/tmp/l"])
    assert node_ledger_dir(given, {"GPU_ISOLATOR_NODE_LEDGER": "/srv/ledger"}) == "/tmp/l"
    off = Flags.from_args(["--node_ledger="])
    assert off.node_ledger == "" and node_ledger_dir(off, {"GPU_ISOLATOR_NODE_LEDGER": "/srv/ledger"}) is None
    assert describe_node_ledger(off, {}).startswith("node ledger off (--node_ledger is empty)")
    assert "simulated node" in describe_node_ledger(simulated, {})
    with pytest.raises(FlagsError, match="Invalid '--node_ledger' 'ledger': expected an absolute directory"):
        Flags(node_ledger="ledger")


# -- the directory -------------------------------------------------------------------------------
def test_leases_are_files_named_by_uuid_and_a_return_removes_the_file(tmp_path: Path) -> None:
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        result = ledger.apply(A, LeaseBatch(takes=(take(lease(GPU0, A, "c1")),)))
        assert result.takes[0].ok
        assert sorted(os.listdir(tmp_path / "ledger" / "units")) == [f"{GPU0}.lease"]
        assert ledger.read() == {GPU0: lease(GPU0, A, "c1")}
        assert (tmp_path / "ledger").stat().st_mode & 0o777 == 0o700
        ledger.apply(A, LeaseBatch(returns=(GPU0,)))
        assert os.listdir(tmp_path / "ledger" / "units") == [] and ledger.read() == {}
    finally:
        ledger.close()


def test_an_unreadable_lease_holds_its_unit_for_nobody_to_take(tmp_path: Path) -> None:
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        (tmp_path / "ledger" / "units" / f"{GPU0}.lease").write_bytes(b'{"unit": "GPU-0000", "own')
        result = ledger.apply(A, LeaseBatch(takes=(take(lease(GPU0, A, "c1")),)))
        [conflict] = result.takes[0].conflicts
        file = f"{tmp_path}/ledger/units/{GPU0}.lease"
        assert conflict.lease.owner == f"unreadable:{file}"
        assert conflict.describe() == (f"{GPU0} is held by unreadable:{file} (its lease file cannot be read; once no"
                                       f" container uses the unit, remove {file}) with no holder (its owner keeps"
                                       " it for a moment before returning it, or is recovering)")
    finally:
        ledger.close()
    # the operator's commands say the same: no front door to release, a file to remove
    table = ledger_command(f"--node_ledger={tmp_path}/ledger").stdout
    assert f"unreadable:{file} (unreadable: remove the file once no container uses the unit)" in table
    release = ledger_command("release", f"--node_ledger={tmp_path}/ledger", f"--owner=unreadable:{file}")
    assert (release.returncode, release.stderr.strip()) == (2, (
        f"gpu-isolator: error: unreadable:{file} is no front door: its lease file cannot be read; once no container"
        f" uses the unit, remove {file}"))
    assert os.path.exists(file)


@pytest.mark.parametrize("planted", ["symlink", "writable", "other owner"])
def test_a_directory_anyone_else_could_write_is_refused(tmp_path: Path, planted: str) -> None:
    target = tmp_path / "ledger"
    if planted == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere")
        expected = "symbolic link"
    elif planted == "writable":
        target.mkdir()
        target.chmod(0o733)
        expected = r"writable by group or others \(mode 0733\)"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        target.mkdir(mode=0o700)
        os.chown(target, 65534, 65534)
        expected = "is owned by uid 65534, not by this user"
    with pytest.raises(LedgerError, match=expected):
        LedgerDirectory.open(str(target))


def test_the_operators_reader_never_makes_a_directory(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="There is no node ledger at .*: no front door has run with it"):
        LedgerDirectory.open(str(tmp_path / "absent"), create=False)
    assert not (tmp_path / "absent").exists()


_HOLDER = r"""
import sys
from actors.ledger import LedgerDirectory
ledger = LedgerDirectory.open(sys.argv[1])
lock = ledger.hold_owner(sys.argv[2])
print("held", flush=True)
sys.stdin.read()
"""


def _owner_process(directory: Path, owner: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), owner], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert process.stdout.readline() == "held\n"
    return process


def test_an_owner_is_alive_while_its_process_holds_the_lock_and_dead_once_killed(tmp_path: Path) -> None:
    directory = tmp_path / "ledger"
    ledger = LedgerDirectory.open(str(directory))
    process = _owner_process(directory, A)
    try:
        assert ledger.owner_alive(A) and not ledger.owner_alive(B)
        with pytest.raises(LedgerError, match=f"The node ledger owner {A} is already running on this node"):
            ledger.hold_owner(A)
        ledger.apply(A, LeaseBatch(takes=(take(lease(GPU0, A, "c1")),)))
        with pytest.raises(LedgerError, match=f"The node ledger owner {A} is running .*: it returns its units"):
            ledger.release_owner(A)
        [conflict] = ledger.apply(B, LeaseBatch(takes=(take(lease(GPU0, B, "exec-1")),))).takes[0].conflicts
        assert conflict.describe() == f"{GPU0} is held by {A} (running) for c1"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        assert not ledger.owner_alive(A)  # the kernel dropped the lock with the process: no pid, no time
        # a dead owner's units wait for it: nobody else takes them
        [conflict] = ledger.apply(B, LeaseBatch(takes=(take(lease(GPU0, B, "exec-1")),))).takes[0].conflicts
        assert conflict.describe() == (
            f"{GPU0} is held by {A} (not running: its units wait for it to restart and reconcile, or for"
            f" 'gpu-isolator ledger release --owner {A}') for c1")
        assert ledger.release_owner(A) == [lease(GPU0, A, "c1")] and ledger.read() == {}
        lock = ledger.hold_owner(A)  # it may start again
        lock.release()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        ledger.close()


def test_a_mutex_held_too_long_fails_within_its_bound_instead_of_hanging(tmp_path: Path) -> None:
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"), timeout=0.3)
    stuck = os.open(tmp_path / "ledger" / "lock", os.O_RDONLY)
    try:
        fcntl.flock(stuck, fcntl.LOCK_EX)  # another open file: another holder, as a stopped process would be
        started = time.monotonic()
        with pytest.raises(LedgerError, match="stayed locked by another process for 0.3 s"):
            ledger.apply(A, LeaseBatch(takes=(take(lease(GPU0, A, "c1")),)))
        assert time.monotonic() - started < 5
        fcntl.flock(stuck, fcntl.LOCK_UN)
        assert ledger.apply(A, LeaseBatch(takes=(take(lease(GPU0, A, "c1")),))).takes[0].ok
    finally:
        os.close(stuck)
        ledger.close()


def test_health_reports_are_kept_per_owner_for_the_operator(tmp_path: Path) -> None:
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        lock = ledger.hold_owner(A)
        ledger.apply(A, LeaseBatch(health={GPU1: "Xid 79"}))
        view = ledger.view()
        assert view.health == {A: {GPU1: "Xid 79"}} and view.alive == {A: True}
        ledger.apply(A, LeaseBatch(health={}))
        assert ledger.view().health == {}
        lock.release()
    finally:
        ledger.close()
