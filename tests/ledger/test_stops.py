"""SPEC R-SH-4: stops. Leaving ``Runtime()`` in the embedded API writes every
pending ledger return and releases the owner lock: an agent that recovers and
exits at once leaves no lease of a unit nobody holds, and ``recover()``
answers once those units are returned. Each agent is a process of its own
(``tests.support.embedded_agent``), judged by the ledger's files and the
operator's ``gpu-isolator ledger``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from actors.ledger import isolator_owner
from tests.support.ledger import ledger_command, leases

REPO = Path(__file__).resolve().parents[2]
DEVICES = [f"195:{minor}" for minor in range(8)]


def agent(directory: Path, ledger: Path, act: str) -> subprocess.CompletedProcess:
    """``tests.support.embedded_agent`` run to its end (bounded)."""
    return subprocess.run([sys.executable, "-m", "tests.support.embedded_agent", str(directory), str(ledger), act],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_an_agent_that_recovers_and_leaves_the_runtime_at_once_leaves_no_lease_nobody_holds(tmp_path: Path) -> None:
    directory, ledger = tmp_path / "node", tmp_path / "ledger"
    owner = isolator_owner(str(directory / "work"))
    crashed = agent(directory, ledger, "crash")  # dies holding every GPU for c1
    assert crashed.returncode == 0, crashed.stderr
    assert leases(ledger) == {device: (owner, ("c1",)) for device in DEVICES}

    restarted = report(agent(directory, ledger, "exit"))  # c1 is gone: recover returns all 8, then it leaves
    assert restarted["recovered"] == {}, "recover() answered before the units nobody holds were returned"
    assert restarted["left"] == {} and restarted["owner_free"] is True
    shown = ledger_command(f"--node_ledger={ledger}", f"--host_file={directory / 'host.json'}", "--json")
    assert shown.returncode == 0, shown.stderr
    assert {row["unit"]: row["state"] for row in json.loads(shown.stdout)["units"]} == {
        device: "free" for device in DEVICES}


def test_units_in_the_linger_window_are_returned_when_the_runtime_is_left(tmp_path: Path) -> None:
    """A container prepared and cleaned up just before the agent leaves ``Runtime()``: its units are
    still leased, unused, for a linger period; leaving writes their return."""
    directory, ledger = tmp_path / "node", tmp_path / "ledger"
    churned = report(agent(directory, ledger, "churn"))
    assert churned["recovered"] == {}
    assert churned["left"] == {} and churned["owner_free"] is True
    assert leases(ledger) == {}
