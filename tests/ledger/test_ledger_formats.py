"""SPEC R-SH-3 on the node ledger's files: each names its format version (release 0.1.0's
unnumbered ones are version 0), one of a version this release does not know is unreadable, and a lease
nobody can read is re-taken only by the owner whose own truth shows it using the unit (a ``proven``
take), its file moved aside. The upgrade from 0.1.0's own files: tests/upgrades/test_upgrade_isolator.py."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import msgspec

from actors.ledger import Lease, LeaseBatch, LedgerDirectory, TakeRequest, decide, owner_file_name

A = "isolator:/var/lib/a"
B = "serve:/run/gpu-isolator/gpu-isolator.sock"
GPU0, GPU1 = "GPU-0000", "GPU-1111"
MIG01 = "MIG-0001"


def lease(unit: str, owner: str, *holders: str, parent: str | None = None) -> Lease:
    return Lease(unit=unit, owner=owner, holders=holders, parent=parent)


def unreadable(file: str) -> Lease:
    return Lease(unit=os.path.basename(file)[: -len(".lease")], owner=f"unreadable:{file}")


def test_every_ledger_file_names_its_format_and_0_1_0s_unnumbered_ones_are_read(tmp_path: Path) -> None:
    units = tmp_path / "ledger" / "units"
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        (units / f"{GPU1}.lease").write_text(json.dumps(  # as release 0.1.0 wrote it
            {"unit": GPU1, "owner": B, "holders": ["exec-1"], "parent": None, "device": "195:1"}))
        assert ledger.read()[GPU1] == Lease(unit=GPU1, owner=B, holders=("exec-1",), device="195:1")
        lock = ledger.hold_owner(A)
        ledger.apply(A, LeaseBatch(takes=(TakeRequest(leases=(lease(GPU0, A, "c1"),)),), health={GPU0: "Xid 79"}))
        written = json.loads((units / f"{GPU0}.lease").read_text())
        assert written == {"version": 1, "unit": GPU0, "owner": A, "holders": ["c1"], "parent": None, "device": ""}
        owners = tmp_path / "ledger" / "owners"
        assert json.loads((owners / owner_file_name(A)).read_text()) == {"owner": A, "version": 1}
        health = owners / (owner_file_name(A)[: -len(".owner")] + ".health")
        assert json.loads(health.read_text()) == {"owner": A, "unhealthy": {GPU0: "Xid 79"}, "version": 1}
        # a release still running during a rolling update (it knows no version) reads the new file
        assert msgspec.json.decode((units / f"{GPU0}.lease").read_bytes(), type=Lease) == lease(GPU0, A, "c1")
        (units / f"{GPU1}.lease").write_text(json.dumps({"version": 2, "unit": GPU1, "owner": B}))
        assert ledger.read()[GPU1] == unreadable(str(units / f"{GPU1}.lease"))
        assert ledger.unreadable == {GPU1: "it is in format version 2, and this release reads versions 0, 1 (a later"
                                           " release wrote it?)"}
        lock.release()
    finally:
        ledger.close()


def test_only_a_proven_take_re_takes_a_lease_nobody_can_read() -> None:
    file = "/run/l/units/GPU-0000.lease"
    held = {GPU0: unreadable(file), GPU1: lease(GPU1, B, "exec-1")}
    mine = (lease(GPU0, A, "c1"), lease(GPU1, A, "c1"))
    after, [result] = decide(held, A, LeaseBatch(takes=(TakeRequest(leases=mine, partial=True),)))
    assert after == held and [c.lease.owner for c in result.conflicts] == [f"unreadable:{file}", B]
    proven = TakeRequest(leases=mine, partial=True, proven=(GPU0, GPU1))
    after, [result] = decide(held, A, LeaseBatch(takes=(proven,)))
    assert result.taken == (GPU0,) and after[GPU0] == mine[0]  # re-taken from the owner's truth
    assert [c.lease for c in result.conflicts] == [held[GPU1]]  # another owner's readable lease stays its own
    # a MIG device the kernel shows in use does not re-take its parent GPU's unreadable lease
    part = TakeRequest(leases=(lease(MIG01, A, "c1", parent=GPU0),), partial=True, proven=(MIG01,))
    after, [result] = decide({GPU0: unreadable(file)}, A, LeaseBatch(takes=(part,)))
    assert result.taken == () and after == {GPU0: unreadable(file)}


def test_a_proven_take_moves_the_unreadable_lease_file_aside_and_says_where(tmp_path: Path) -> None:
    units = tmp_path / "ledger" / "units"
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        file = units / f"{GPU0}.lease"
        file.write_bytes(b'{"unit": "GPU-0000", "own')
        request = TakeRequest(leases=(lease(GPU0, A, "c1"),), partial=True, proven=(GPU0,))
        result = ledger.apply(A, LeaseBatch(takes=(request,)))
        assert result.takes[0].taken == (GPU0,) and ledger.read() == {GPU0: lease(GPU0, A, "c1")}
        [moved] = glob.glob(f"{file}.unreadable-*")
        assert result.set_aside == {GPU0: (str(file), moved, "it is not a JSON object: truncated or not this"
                                           " project's file (Input data was truncated)")}
        assert open(moved, "rb").read() == b'{"unit": "GPU-0000", "own'
        assert sorted(os.listdir(units)) == sorted([f"{GPU0}.lease", os.path.basename(moved)])  # no temporary left
        assert ledger.apply(A, LeaseBatch(returns=(GPU0,))).set_aside == {} and ledger.read() == {}
    finally:
        ledger.close()


def test_an_unreadable_health_file_is_passed_over_and_its_owner_moves_it_aside(tmp_path: Path) -> None:
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        health = tmp_path / "ledger" / "owners" / (owner_file_name(A)[: -len(".owner")] + ".health")
        text = json.dumps({"version": 7, "owner": A, "unhealthy": {GPU0: "Xid 79"}})
        health.write_text(text)
        assert ledger.view().health == {}
        assert ledger.set_aside_own_health(B) is None  # nothing of B's
        file, moved, why = ledger.set_aside_own_health(A)
        assert (file, open(moved).read(), os.path.dirname(moved)) == (str(health), text, str(health.parent))
        assert why == "it is in format version 7, and this release reads versions 0, 1 (a later release wrote it?)"
        assert not health.exists() and ledger.set_aside_own_health(A) is None
    finally:
        ledger.close()


def test_a_name_that_is_no_regular_file_is_never_re_taken(tmp_path: Path) -> None:
    """Nothing could be renamed over a directory: the unit stays out of reach, and the owner's job works."""
    units = tmp_path / "ledger" / "units"
    ledger = LedgerDirectory.open(str(tmp_path / "ledger"))
    try:
        (units / f"{GPU0}.lease").mkdir()
        request = TakeRequest(leases=(lease(GPU0, A, "c1"), lease(GPU1, A, "c1")), partial=True, proven=(GPU0, GPU1))
        result = ledger.apply(A, LeaseBatch(takes=(request,)))
        assert result.takes[0].taken == (GPU1,) and result.set_aside == {}
        assert ledger.read()[GPU0] == unreadable(str(units / f"{GPU0}.lease"))
        assert ledger.unreadable == {GPU0: "it is not a regular file (a directory or a symbolic link?)"}
    finally:
        ledger.close()
