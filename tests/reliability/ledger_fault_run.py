"""The node ledger's random fault run (SPEC R-NL-3, issue 43): front doors of one node SIGKILLed at random.

One 8-GPU node (one host file), one node ledger, three front doors, each
with a cgroups root and work directory of its own: two isolator agents
(``fault_agent``: 6 concurrent lifecycles of ``gpus:1`` each, in processes
of their own, the seed's "multiple containerizers") and ``serve`` (a
driver thread prepares and cleans up ``gpus:1`` containers on its socket,
as an agent would). Every front door asks for more GPUs than are free, so
grants are refused all the time. At random moments a front door is
SIGKILLed (and started again, recovering what it held), or the node is
judged.

The kernel is the judge, as in ``fault_run``: every front door and its
device worker are frozen (SIGSTOP), a probe moved into each cgroup under
each root opens every GPU node. Counted:
- double grants: a GPU two cgroups can open at once, whichever front doors
  own them (cgroups whose prepare is in flight, or was in flight when their
  front door died and are not cleaned up yet, are left out: between mkdir
  and its rules a cgroup allows what its parent allows, with no process
  inside yet);
- unleased grants: a GPU a cgroup can open whose lease in the ledger does
  not name that cgroup's front door (take before any effect, return only
  after it is undone);
- hangs: a front door that did not start (recover) within its bound, an
  isolator call or a service request that did not answer within its own;
- leaks: once every front door has cleaned up and stopped, a lease left in
  the ledger or a cgroup left under a root.

``python -m tests.reliability.ledger_fault_run --backends cgroups_v1,cgroups_v2
--steps 200 --seed 43`` prints the figures; the test runs a short one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from actors.devices import default_hierarchy
from actors.ledger import Lease, isolator_owner, serve_owner
from actors.nvml import load_host_file
from isolators.simulated_node import SimulatedNode, backend_unavailable, remove_cgroup_tree
from tests.reliability.fault_run import START_BOUND, Agent, Judge
from tests.reliability.fault_run import Ledger as AgentEvents
from tests.reliability.fault_run import _signal, _wait_stopped
from tests.support.services import ServeProcess, ask

GPUS = 8
REQUEST_BOUND = 30.0
"""Seconds a service request may take before it counts as a hang."""
AGENTS = ("a", "b")


@dataclass
class Figures:
    backend: str
    seed: int = 0
    steps: int = 0
    judgements: int = 0
    agent_kills: int = 0
    serve_kills: int = 0
    lifecycles: int = 0
    serve_lifecycles: int = 0
    refused_grants: int = 0
    """Grants refused because another front door held the units (expected: the node is over-asked)."""
    double_grants: int = 0
    unleased_grants: int = 0
    hangs: int = 0
    leaks: int = 0
    wrong_error_types: int = 0
    problems: list[str] = field(default_factory=list)


class ServeDriver(threading.Thread):
    """Prepares and cleans up ``gpus:1`` containers on the service's socket, as an agent would."""

    def __init__(self, service: ServeProcess, seed: int) -> None:
        super().__init__(daemon=True)
        self.service = service
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.preparing: set[str] = set()
        """Containers whose prepare may be in flight (or was, when the service died) and not cleaned up."""
        self.known: set[str] = set()
        self.lifecycles = 0
        self.refused = 0
        self.hangs: list[str] = []
        self.stopping = threading.Event()
        self.idle = threading.Event()
        self._n = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            self.idle.clear()
            self._clean_known()
            if self.stopping.is_set():
                break
            cid = f"s{self._n}"
            self._n += 1
            with self.lock:
                self.known.add(cid)
                self.preparing.add(cid)
            answer = self._ask("prepare", container_id=cid, gpus=1)
            if answer is None:  # the service died: cleaned up once it is back
                continue
            with self.lock:
                self.preparing.discard(cid)
                if answer.get("error"):
                    self.known.discard(cid)
                    if "held by" in answer["error"] or "available" in answer["error"]:
                        self.refused += 1
                    continue
            time.sleep(self.rng.uniform(0.0, 0.05))
            self._clean_known()
        self.idle.set()

    def _clean_known(self) -> None:
        for cid in sorted(self.known):
            answer = self._ask("cleanup", container_id=cid)
            if answer is None or answer.get("error"):
                return
            with self.lock:
                self.known.discard(cid)
                self.preparing.discard(cid)
                self.lifecycles += 1

    def _ask(self, verb: str, **body: Any) -> dict[str, Any] | None:
        started = time.monotonic()
        try:
            return ask(self.service, verb, timeout=REQUEST_BOUND, **body)
        except Exception:  # noqa: BLE001 - the service is down (killed): try again later
            if time.monotonic() - started >= REQUEST_BOUND:
                self.hangs.append(f"{verb} {body.get('container_id')}")
            time.sleep(0.05)
            return None

    def clean_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.known and time.monotonic() < deadline:
            self._clean_known()
        return not self.known


def _workers_of(pid: int) -> list[int]:
    from tests.support.kernel import children

    found = []
    for child in sorted(children(pid)):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if b"_worker_child" in cmdline.read():
                    found.append(child)
        except OSError:
            pass
    return found


def _read_leases(directory: str) -> dict[str, Lease]:
    """The lease files as they are (no mutex: a frozen front door may hold it; a file is renamed whole)."""
    units = os.path.join(directory, "units")
    found = {}
    for name in os.listdir(units) if os.path.isdir(units) else ():
        if name.startswith(".") or not name.endswith(".lease"):
            continue
        try:
            with open(os.path.join(units, name), "rb") as handle:
                lease = msgspec.json.decode(handle.read(), type=Lease)
        except (OSError, msgspec.DecodeError):
            continue
        found[lease.unit] = lease
    return found


def run(backend: str, steps: int, seed: int, workers: int = 6, log: Any = None) -> Figures:
    """The fault run on one backend (see module rules); its figures."""
    reason = backend_unavailable(backend)
    if reason is not None or backend == "memory":
        raise RuntimeError(f"the ledger fault run needs a kernel backend: {reason or backend}")
    rng = random.Random(seed)
    figures = Figures(backend, seed=seed)
    base = tempfile.mkdtemp(prefix="gpu-isolator-ledger-faults-")
    tag = f"gpu-isolator-test-{os.getpid()}-ledger-{uuid.uuid4().hex[:8]}"
    roots = {name: f"{tag}-{name}" for name in (*AGENTS, "s")}
    hierarchy = default_hierarchy(backend)
    host_node = SimulatedNode(os.path.join(base, "host"), backend, gpus=GPUS)
    host_node.create_files()
    host_file = host_node.host_file or os.path.join(base, "host", "host.json")
    uuids = {gpu.minor: gpu.uuid for gpu in load_host_file(host_file).gpus}
    ledger = os.path.join(base, "ledger")
    agent_log = os.path.join(base, "agents.log")
    configs = {name: {"dir": os.path.join(base, name), "host": host_file, "backend": backend, "root": roots[name],
                      "workers": workers, "gpu_workers": workers, "seed": seed, "final": False, "ledger": ledger}
               for name in AGENTS}
    for name in AGENTS:
        SimulatedNode(configs[name]["dir"], backend, host=host_file, cgroups_root=roots[name]).create_files()
    serve_node = SimulatedNode(os.path.join(base, "s"), backend, host=host_file, cgroups_root=roots["s"])
    serve_node.create_files()
    service = ServeProcess(serve_node, os.path.join(base, "serve"), node_ledger=ledger, device_worker="process")
    owners = {name: isolator_owner(os.path.join(configs[name]["dir"], "work")) for name in AGENTS}
    owners["s"] = serve_owner(service.socket)
    judges = {name: Judge(hierarchy, os.path.join(hierarchy, roots[name]), os.path.join(base, f"nodes-{name}"))
              for name in roots}
    events = {name: AgentEvents() for name in AGENTS}
    rounds = {name: 0 for name in AGENTS}
    agents: dict[str, Agent] = {}
    driver: ServeDriver | None = None

    def problem(kind: str, text: str) -> None:
        figures.problems.append(f"step {figures.steps}: {kind}: {text}")
        if log is not None:
            print(f"[{backend}] step {figures.steps}: {kind}: {text}", file=log, flush=True)

    def start_agent(name: str, final: bool = False) -> Agent:
        config = {**configs[name], "round": rounds[name], "known": sorted(events[name].known), "final": final}
        rounds[name] += 1
        agent = Agent(config, agent_log)
        if not final:
            if agent.wait_for("ready", START_BOUND) is None:
                figures.hangs += 1
                problem("hang", f"agent {name} did not get ready in {START_BOUND:g} s")
            events[name].feed(agent.take())
        return agent

    def judge_now() -> None:
        frozen = [pid for agent in agents.values() for pid in (agent.pid, *agent.workers())]
        if service.process is not None and service.process.poll() is None:
            frozen += [service.process.pid, *_workers_of(service.process.pid)]
        for pid in frozen:
            _signal(pid, signal.SIGSTOP)
        _wait_stopped(frozen)
        try:
            for name, agent in agents.items():
                events[name].feed(agent.take())
            excluded = {name: set(events[name].preparing) for name in AGENTS}
            with driver.lock:  # type: ignore[union-attr]
                excluded["s"] = set(driver.preparing)  # type: ignore[union-attr]
            figures.judgements += 1
            reach: dict[int, list[str]] = {}
            leases = _read_leases(ledger)
            for name, judge in judges.items():
                for cgroup, minors in judge.grants().items():
                    if cgroup in excluded[name]:
                        continue
                    for minor in minors:
                        reach.setdefault(minor, []).append(f"{name}/{cgroup}")
                        lease = leases.get(uuids[minor])
                        if lease is None or lease.owner != owners[name]:
                            figures.unleased_grants += 1
                            problem("unleased grant", f"GPU {minor} can be opened from {name}'s {cgroup} but its lease"
                                    f" is {lease.owner + ' for ' + ','.join(lease.holders) if lease else 'absent'}")
            for minor, holders in sorted(reach.items()):
                if len(holders) > 1:
                    figures.double_grants += 1
                    problem("double grant", f"GPU {minor} can be opened from {holders}")
        finally:
            for pid in frozen:
                _signal(pid, signal.SIGCONT)

    try:
        service.start(timeout=START_BOUND)
        driver = ServeDriver(service, seed)
        driver.start()
        for name in AGENTS:
            agents[name] = start_agent(name)
        for step in range(steps):
            figures.steps = step + 1
            time.sleep(rng.uniform(0.02, 0.25))
            action = rng.random()
            if action < 0.15:
                name = rng.choice(AGENTS)
                events[name].feed(agents[name].kill())
                figures.agent_kills += 1
                agents[name] = start_agent(name)
            elif action < 0.25:
                service.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                service.process.wait(timeout=10)  # type: ignore[union-attr]
                service.process.stdout.close()  # type: ignore[union-attr]
                figures.serve_kills += 1
                try:
                    service.start(timeout=START_BOUND)
                except AssertionError as error:
                    figures.hangs += 1
                    problem("hang", f"serve did not start again: {error}")
            else:
                judge_now()
        judge_now()
        # Everyone cleans up and stops: then every unit must be free again.
        driver.stopping.set()
        driver.join(REQUEST_BOUND * 2)
        if driver.is_alive() or not driver.clean_all(REQUEST_BOUND):
            figures.hangs += 1
            problem("hang", f"serve's containers {sorted(driver.known)} were not cleaned up")
        service.stop()
        for name in AGENTS:
            events[name].feed(agents[name].kill())
            final = start_agent(name, final=True)
            done = final.wait_for("final", START_BOUND * 2)
            events[name].feed(final.take())
            try:
                final.process.wait(timeout=START_BOUND)  # it returns its unused leases as it stops
            except Exception:  # noqa: BLE001
                figures.hangs += 1
                problem("hang", f"the final agent {name} did not stop")
            events[name].feed(final.kill())
            if done is None:
                figures.hangs += 1
                problem("hang", f"the final agent {name} did not finish")
            elif done["containers"]:
                figures.leaks += len(done["containers"])
                problem("leak", f"agent {name}'s containers left after cleanup: {done['containers']}")
        left = _read_leases(ledger)
        if left:
            figures.leaks += len(left)
            problem("leak", "leases left once every front door cleaned up and stopped: "
                    + "; ".join(f"{lease.device or lease.unit} by {lease.owner}" for lease in left.values()))
        for name, judge in judges.items():
            if os.path.isdir(judge.root) and (name == "s" or judge.grants()):
                cgroups = sorted(judge.grants())
                if cgroups:
                    figures.leaks += len(cgroups)
                    problem("leak", f"cgroups left under {name}'s root: {cgroups}")
        figures.lifecycles = sum(e.lifecycles for e in events.values())
        figures.serve_lifecycles = driver.lifecycles
        figures.refused_grants = driver.refused + sum(
            count for e in events.values() for reason, count in e.reasons.items() if "held by" in reason
            or "more held by other front doors" in reason)
        figures.hangs += len(driver.hangs) + sum(len(e.hangs) for e in events.values())
        figures.wrong_error_types = sum(len(e.wrong_types) for e in events.values())
        for e in events.values():
            for text in e.wrong_types[:5]:
                problem("error type", f"an isolator call failed with {text}")
        return figures
    finally:
        if driver is not None:
            driver.stopping.set()
        serve_log = service.log()
        service.close()
        for agent in agents.values():
            if agent.process.poll() is None:
                agent.kill()
        for judge in judges.values():
            judge.close()
            remove_cgroup_tree(judge.root, busy_timeout=5.0)
        if figures.problems and os.path.exists(agent_log):
            kept = shutil.copy(agent_log, tempfile.mkstemp(prefix=f"ledger-fault-run-{backend}-", suffix=".log")[1])
            figures.problems.append(f"the agents' log is kept in {kept}; serve's ends: {serve_log[-2000:]}")
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="cgroups_v1,cgroups_v2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=43)
    args = parser.parse_args(argv)
    results = []
    for backend in args.backends.split(","):
        started = time.monotonic()
        figures = run(backend, args.steps, args.seed, log=sys.stderr)
        results.append(figures)
        print(f"{backend}: seed {figures.seed}, {figures.steps} steps, {figures.judgements} judgements,"
              f" {figures.agent_kills} agent kills, {figures.serve_kills} serve kills, {figures.lifecycles} agent"
              f" lifecycles, {figures.serve_lifecycles} serve lifecycles, {figures.refused_grants} grants refused"
              f" (another front door held the units): {figures.double_grants} double grants,"
              f" {figures.unleased_grants} unleased grants, {figures.hangs} hangs, {figures.leaks} leaks,"
              f" {figures.wrong_error_types} wrong error types in {time.monotonic() - started:.0f} s", flush=True)
    print(json.dumps({"benchmark": "ledger_fault_run", "seed": args.seed, "results": [asdict(r) for r in results]}))
    return 0 if all(not (r.double_grants or r.unleased_grants or r.hangs or r.leaks or r.wrong_error_types)
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
