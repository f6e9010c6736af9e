"""SPEC R-SH-4: stops. Leaving ``Runtime()`` in the embedded API writes every
pending ledger return and releases the owner lock: an agent that recovers and
exits at once leaves no lease of a unit nobody holds, and ``recover()``
answers once those units are returned. SIGTERM to each front door (``serve``,
``kubelet-plugin``, ``dra-plugin``: what a rolling update sends) answers what
waits, returns what no container, pod or claim holds, releases the owner lock
and exits 0 within 10 s; what they still hold stays leased (the next start
carries on from it). Each agent and front door is a process of its own
(``tests.support.embedded_agent``; the commands on a simulated node, the
kubelet's and the API server's fakes: ``tests.support.kube_node``), judged by
the ledger's files, its owner locks and the operator's ``gpu-isolator
ledger``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.ledger import dra_plugin_owner, isolator_owner, serve_owner
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.support.kube_node import DRIVER, KubeNode
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import BOUND, ledger_command, leases, owner_free
from tests.support.nodes import Node
from tests.support.services import ServeProcess, ask, connect

REPO = Path(__file__).resolve().parents[2]
DEVICES = [f"195:{minor}" for minor in range(8)]
STOP_BOUND = 10.0
"""Seconds a front door may take to exit after SIGTERM (R-SH-4)."""


def sigterm(process: subprocess.Popen) -> tuple[int | None, float]:
    """SIGTERM, then the exit status and how long it took (None: still running after ``STOP_BOUND``)."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(STOP_BOUND)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - started
    return code, time.monotonic() - started


def wait_for(check: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``check()`` holds: the state a test asserts, never a time."""
    deadline = time.monotonic() + BOUND
    while not check():
        assert time.monotonic() < deadline, f"not within {BOUND:g} s: {what}"
        time.sleep(0.01)


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


# -- SIGTERM to each front door --------------------------------------------------------------
def test_serve_on_sigterm_answers_who_waits_returns_what_no_container_holds_and_exits_0(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    node = Node(tmp_path / "node", "memory", 8, host=str(DGX8))
    service = ServeProcess(node, tmp_path / "serve", node_ledger=str(ledger))
    owner = serve_owner(service.socket)
    try:
        service.start()
        assert ask(service, "prepare", container_id="kept", gpus=2)["error"] is None
        assert ask(service, "prepare", container_id="gone", gpus=4)["error"] is None
        with connect(service) as waiter:
            waiter.on_queued = lambda body: None
            waiter.send("prepare", {"request": "w", "container_id": "waiter", "gpus": 8, "wait": True})
            service.wait_state(lambda state: len(state["waiting"]) == 1)  # in flight: waiting in line
            assert ask(service, "cleanup", container_id="gone")["error"] is None  # its units linger, unused
            assert not owner_free(ledger, owner)
            code, took = sigterm(service.process)
            assert code == 0 and took < STOP_BOUND, (code, took, service.log())
            assert waiter.receive(10).body["error"] == "the gpu-isolator service is stopping; ask again once it runs"
        assert owner_free(ledger, owner)
        # kept's command runs on (serve touches no container): its units stay serve's; gone's went back
        assert leases(ledger) == {"195:0": (owner, ("kept",)), "195:1": (owner, ("kept",))}
    finally:
        service.close()
        node.teardown()


@pytest.fixture
def kube(tmp_path: Path):
    with plugin_directory() as sockets:
        node = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"))
        try:
            yield node
        finally:
            node.close()


def test_the_device_plugin_on_sigterm_returns_what_no_pod_holds_and_exits_0(kube: KubeNode) -> None:
    kube.start(dra=False)
    uuid = kube.uuids
    kube.allocate("p1", [uuid["gpu-0"]])
    kube.allocate("p2", [uuid["gpu-1"], uuid["gpu-2"]])
    assert not owner_free(kube.ledger, PLUGIN_OWNER)
    wait_for(lambda: leases(kube.ledger).get("195:1") == (PLUGIN_OWNER, ("ns/p2/gpu",)), "a pass saw p2")
    kube.remove_pod("p2")  # its units go back once a pass sees it gone: the stop must not lose that return
    kube.device_plugin.wait_log("No pod holds")
    code, took = sigterm(kube.device_plugin.process)
    assert code == 0 and took < STOP_BOUND, (code, took, kube.device_plugin.log()[-4000:])
    assert "Stopping on SIGTERM" in kube.device_plugin.log()
    assert owner_free(kube.ledger, PLUGIN_OWNER)
    # p1 runs on through the rolling update: its GPU stays the plugin's for the next one to carry on
    assert leases(kube.ledger) == {"195:0": (PLUGIN_OWNER, ("ns/p1/gpu",))}


def test_the_dra_driver_on_sigterm_returns_what_no_claim_holds_and_exits_0(kube: KubeNode) -> None:
    kube.start()
    owner = dra_plugin_owner(DRIVER)
    held = kube.claim(["gpu-0"])
    done = kube.claim(["gpu-1", "gpu-2"])
    assert [d["device_name"] for d in kube.prepare(held)["devices"]] == ["gpu-0"]
    assert len(kube.prepare(done)["devices"]) == 2
    assert kube.unprepare(done) == {}  # its units linger, unused
    assert not owner_free(kube.ledger, owner)
    code, took = sigterm(kube.dra_plugin.process)
    assert code == 0 and took < STOP_BOUND, (code, took, kube.dra_plugin.log()[-4000:])
    assert owner_free(kube.ledger, owner)
    # the prepared claim stays prepared and its GPU the driver's; the device plugin (still running) holds none
    assert leases(kube.ledger) == {"195:0": (owner, (held[2],))}
    assert kube.prepared() == {held[2]: ["gpu-0"]}
