"""The random fault run (issue 20): 32-way churn under worker and agent faults, judged by the kernel.

Each round starts an agent (``fault_agent``: an isolator with a device worker
process, in a subprocess of its own) on one node (one cgroups root, one work
directory, 8 GPUs), which recovers and cleans up what the previous agent
left and then runs 32 concurrent lifecycles. Meanwhile, at random moments,
the worker is SIGKILLed, or SIGSTOPped and SIGCONTed later, and the state
is judged; the round ends with the agent SIGKILLed at a random moment
(sometimes while its worker is stopped). A last agent cleans up everything.

The kernel is the judge: the agent and its worker are frozen (SIGSTOP),
and a probe process moved into each cgroup under the root opens every GPU
node (``probes.verdict``: DENIED iff EPERM, else GRANTED). Counted:
- double grants: a GPU two cgroups can open at once (cgroups whose prepare
  is in flight are left out: between mkdir and its rules a v1 cgroup
  allows what its parent allows, with no process inside yet);
- hangs: an isolator call that did not answer within the agent's bound, an
  agent that did not start, a worker that outlived its agent (one stopped
  before it asked for the parent-death signal must exit at its first
  parent check once continued: counted apart, as fenced when continued);
- leaks: after the last cleanup, a cgroup left under the root or a GPU not
  back in the allocator's free pool;
- wrong error types: an isolator call that failed with anything but an
  ``IsolatorError`` (SPEC 11: every failure of an isolator method is one,
  faults included).

``python -m tests.reliability.fault_run --backends cgroups_v1,cgroups_v2
--rounds 50`` prints the figures (one line per backend, then JSON); the
test (``test_random_faults``) runs a few rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from actors.devices import default_hierarchy
from isolators.simulated_node import SimulatedNode, backend_unavailable, remove_cgroup_tree
from tests.support.kernel import children, process_state, wait_gone
from tests.support.probes import DENIED, GRANTED, DeviceProbe, mknod_nodes

GPUS = 8
NVIDIA = 195
START_BOUND = 60.0
"""Seconds an agent has to recover, clean up and say it is ready."""
WORKER_EXIT_BOUND = 5.0
"""Seconds a worker may outlive its SIGKILLed agent."""


@dataclass
class Figures:
    backend: str
    rounds: int = 0
    lifecycles: int = 0
    worker_kills: int = 0
    worker_stops: int = 0
    agent_kills: int = 0
    agent_kills_with_worker_stopped: int = 0
    fenced_when_continued: int = 0
    """Workers stopped before they asked for the parent-death signal that
    exited at their first parent check once continued."""
    judgements: int = 0
    double_grants: int = 0
    hangs: int = 0
    leaks: int = 0
    wrong_error_types: int = 0
    failed_calls: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _describe(pid: int) -> str:
    """State, parent and where in the kernel a process waits (for a problem report)."""
    parts = []
    for name in ("stat", "wchan", "stack"):
        try:
            with open(f"/proc/{pid}/{name}") as handle:
                text = handle.read().strip()
        except OSError as error:
            text = str(error)
        if name == "stat":
            fields = text.rsplit(")", 1)[-1].split()
            text = f"state {fields[0]} ppid {fields[1]}" if len(fields) > 1 else text
        parts.append(f"{name}: {' | '.join(text.splitlines()[:8])}")
    return "; ".join(parts)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_stopped(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(process_state(p) not in ("T", "t", "Z", None) for p in pids):
        time.sleep(0.001)


class Agent:
    """One agent subprocess and the events it wrote."""

    def __init__(self, config: dict[str, Any], log_file: str) -> None:
        with open(log_file, "ab") as log:  # the agent's own log lines (warnings, errors)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.fault_agent", json.dumps(config)],
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=log, cwd=_REPO,
            )
        self.pid = self.process.pid
        os.set_blocking(self.process.stdout.fileno(), False)
        self._buffer = b""
        self.events: list[dict[str, Any]] = []
        self._taken = 0

    def take(self) -> list[dict[str, Any]]:
        """The events read and not taken yet (after ``drain`` or ``wait_for``)."""
        self.drain()
        new, self._taken = self.events[self._taken:], len(self.events)
        return new

    def drain(self, wait: float = 0.0) -> list[dict[str, Any]]:
        """Read the events written so far (waiting up to ``wait`` for more)."""
        fd = self.process.stdout.fileno()
        new: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            self._buffer += data
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    new.append(json.loads(line))
            if new and wait:
                break
        self.events += new
        return new

    def wait_for(self, event: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for item in self.drain(wait=min(0.2, max(0.0, deadline - time.monotonic()))):
                if item["e"] == event:
                    return item
            if self.process.poll() is not None:
                self.drain()
                return next((e for e in self.events if e["e"] == event), None)
        return None

    def workers(self) -> list[int]:
        """The agent's device worker processes (its children running ``_worker_child``)."""
        found = []
        for pid in sorted(children(self.pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if b"_worker_child" in cmdline.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    def kill(self) -> list[dict[str, Any]]:
        """SIGKILL the agent; the events it wrote and were not taken."""
        _signal(self.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        new = self.take()
        self.process.stdout.close()
        return new


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Ledger:
    """What the agents said: containers to recover, prepares in flight."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.preparing: set[str] = set()
        self.lifecycles = 0
        self.failed = 0
        self.reasons: dict[str, int] = {}
        self.hangs: list[dict[str, Any]] = []
        self.wrong_types: list[str] = []

    def feed(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            kind, cid = event["e"], event.get("c")
            if kind == "preparing":
                self.known.add(cid)
                self.preparing.add(cid)
            elif kind in ("prepared", "prepare_failed"):
                self.preparing.discard(cid)
                if kind == "prepare_failed":
                    self.failed += 1
                    self.count(event["error"])
            elif kind == "cleaned":
                self.known.discard(cid)
                self.preparing.discard(cid)
                self.lifecycles += 1
            elif kind == "update_failed":
                self.count(event["error"])
            elif kind == "cleanup_failed":
                self.failed += 1
                self.count(event["error"])
            elif kind == "hang":
                self.hangs.append(event)


    def count(self, error: str) -> None:
        """Failures by kind: the error's first words, without container ids and numbers."""
        if not error.startswith("IsolatorError: "):
            self.wrong_types.append(error)
        words = " ".join(w for w in error.replace(":", " ").split()[:12] if not any(ch.isdigit() for ch in w))
        self.reasons[words] = self.reasons.get(words, 0) + 1


class Judge:
    """Opens every GPU node from inside each cgroup under the root (see module rules)."""

    def __init__(self, hierarchy: str, root: str, directory: str) -> None:
        self.hierarchy = hierarchy
        self.root = root
        os.makedirs(directory, exist_ok=True)
        self.nodes = mknod_nodes(directory, [("c", NVIDIA, m) for m in range(GPUS)])
        self.probe = DeviceProbe()

    def grants(self) -> dict[str, set[int]]:
        """cgroup -> the GPUs a process in it can open."""
        found: dict[str, set[int]] = {}
        if not os.path.isdir(self.root):
            return found
        for directory, subdirs, _files in os.walk(self.root):
            for name in subdirs:
                path = os.path.join(directory, name)
                try:
                    self.probe.move_to(path)
                except OSError:  # removed meanwhile (a dead agent's worker may still be exiting)
                    continue
                try:
                    opened = {m: self.probe.access(self.nodes["c", NVIDIA, m]) for m in range(GPUS)}
                finally:
                    self.probe.move_to(self.hierarchy)
                odd = {m: v for m, v in opened.items() if v not in (GRANTED, DENIED)}
                assert not odd, f"{path}: opening GPU nodes gave {odd}, neither {GRANTED} nor {DENIED}"
                found[os.path.relpath(path, self.root)] = {m for m, v in opened.items() if v == GRANTED}
        return found

    def double_grants(self, excluded: set[str]) -> list[str]:
        grants = {name: minors for name, minors in self.grants().items() if name not in excluded}
        problems = []
        for minor in range(GPUS):
            holders = sorted(name for name, minors in grants.items() if minor in minors)
            if len(holders) > 1:
                problems.append(f"GPU {minor} can be opened from {holders}")
        return problems

    def close(self) -> None:
        self.probe.close()


def run(backend: str, rounds: int, seed: int, workers: int = 32, gpu_workers: int = 8,
        round_seconds: tuple[float, float] = (0.5, 3.0), log: Any = None, agent_log_copy: str | None = None) -> Figures:
    """The fault run on one backend (see module rules); its figures."""
    reason = backend_unavailable(backend)
    if reason is not None or backend == "memory":
        raise RuntimeError(f"the fault run needs a kernel backend: {reason or backend}")
    rng = random.Random(seed)
    figures = Figures(backend)
    directory = tempfile.mkdtemp(prefix="gpu-isolator-faults-")
    root_name = f"gpu-isolator-test-{os.getpid()}-faults-{uuid.uuid4().hex[:8]}"
    node = SimulatedNode(directory, backend, gpus=GPUS, cgroups_root=root_name)
    node.create_files()
    hierarchy = default_hierarchy(backend)
    judge = Judge(hierarchy, os.path.join(hierarchy, root_name), os.path.join(directory, "nodes"))
    ledger = Ledger()
    agent_log = os.path.join(directory, "agents.log")
    config = {"dir": directory, "backend": backend, "root": root_name, "workers": workers,
              "gpu_workers": gpu_workers, "seed": seed, "final": False}

    def problem(kind: str, text: str) -> None:
        figures.problems.append(f"round {figures.rounds}: {kind}: {text}")
        if log is not None:
            print(f"[{backend}] round {figures.rounds}: {kind}: {text}", file=log, flush=True)

    def judge_now(agent: Agent | None) -> None:
        frozen = [agent.pid, *agent.workers()] if agent is not None else []
        for pid in frozen:
            _signal(pid, signal.SIGSTOP)
        _wait_stopped(frozen)
        try:
            if agent is not None:
                ledger.feed(agent.take())
            figures.judgements += 1
            for text in judge.double_grants(excluded=set(ledger.preparing)):
                figures.double_grants += 1
                problem("double grant", text)
        finally:
            for pid in frozen:
                _signal(pid, signal.SIGCONT)

    try:
        for round_ in range(rounds):
            figures.rounds = round_ + 1
            agent = Agent({**config, "round": round_, "known": sorted(ledger.known)}, agent_log)
            ready = agent.wait_for("ready", START_BOUND)
            ledger.feed(agent.take())
            if ready is None:
                figures.hangs += 1
                problem("hang", f"the agent did not get ready in {START_BOUND:g} s")
                ledger.feed(agent.kill())
                continue
            ledger.preparing.clear()  # what was in flight at the last death has been recovered
            end = time.monotonic() + rng.uniform(*round_seconds)
            stopped: int | None = None
            while time.monotonic() < end:
                time.sleep(rng.uniform(0.02, 0.3))
                ledger.feed(agent.take())
                action = rng.random()
                pids = agent.workers()
                if action < 0.25 and pids:
                    figures.worker_kills += 1
                    for pid in pids:
                        _signal(pid, signal.SIGKILL)
                elif action < 0.5 and pids:
                    figures.worker_stops += 1
                    for pid in pids:
                        _signal(pid, signal.SIGSTOP)
                    time.sleep(rng.uniform(0.01, 0.5))
                    if rng.random() < 0.5:
                        judge_now(agent)
                    for pid in pids:
                        _signal(pid, signal.SIGCONT)
                else:
                    judge_now(agent)
            if rng.random() < 0.3 and (pids := agent.workers()):  # the stale-worker case
                stopped = pids[0]
                _signal(stopped, signal.SIGSTOP)
                time.sleep(rng.uniform(0.0, 0.2))
                figures.agent_kills_with_worker_stopped += 1
            workers_before = agent.workers()
            ledger.feed(agent.kill())
            figures.agent_kills += 1
            for pid in workers_before:
                if not wait_gone(pid, WORKER_EXIT_BOUND):
                    # Stopped before it asked for the parent-death signal: it must
                    # exit at its first parent check once it runs again.
                    stopped_early = process_state(pid) in ("T", "t")
                    _signal(pid, signal.SIGCONT)
                    if stopped_early and wait_gone(pid, WORKER_EXIT_BOUND):
                        figures.fenced_when_continued += 1
                    else:
                        figures.hangs += 1
                        problem("hang", f"device worker {pid} outlived its agent by {WORKER_EXIT_BOUND:g} s"
                                f" ({_describe(pid)})")
                        _signal(pid, signal.SIGKILL)
            if stopped is not None:
                _signal(stopped, signal.SIGCONT)
            judge_now(None)
        # the last agent cleans up everything
        agent = Agent({**config, "round": rounds, "known": sorted(ledger.known), "final": True}, agent_log)
        final = agent.wait_for("final", START_BOUND * 2)
        ledger.feed(agent.take())
        ledger.feed(agent.kill())
        if final is None:
            figures.hangs += 1
            problem("hang", "the cleanup agent did not finish")
        else:
            if final["containers"]:
                figures.leaks += len(final["containers"])
                problem("leak", f"containers left after cleanup: {final['containers']}")
            if final["available"] != GPUS:
                figures.leaks += GPUS - final["available"]
                problem("leak", f"{GPUS - final['available']} GPUs not back in the free pool")
        left = sorted(judge.grants())
        if left or os.path.isdir(judge.root):
            figures.leaks += max(1, len(left))
            problem("leak", f"cgroups left under the root: {left}")
        figures.lifecycles = ledger.lifecycles
        figures.failed_calls = ledger.failed
        figures.failure_reasons = dict(sorted(ledger.reasons.items(), key=lambda item: -item[1]))
        figures.hangs += len(ledger.hangs)
        figures.wrong_error_types = len(ledger.wrong_types)
        for text in ledger.wrong_types[:10]:
            problem("error type", f"an isolator call failed with {text}")
        for hang in ledger.hangs:
            problem("hang", f"{hang['op']} of {hang['c']} did not answer")
        return figures
    finally:
        judge.close()
        remove_cgroup_tree(judge.root, busy_timeout=5.0)
        if agent_log_copy is not None and os.path.exists(agent_log):
            shutil.copy(agent_log, agent_log_copy)
        if figures.problems and os.path.exists(agent_log):
            kept = shutil.copy(agent_log, tempfile.mkstemp(prefix=f"fault-run-{backend}-", suffix=".log")[1])
            figures.problems.append(f"the agents' log is kept in {kept}")
        shutil.rmtree(directory, ignore_errors=True)


def run_backends(benchmark: str, seed: int, backends: str, run_one: Callable[[str], Any],
                 line: Callable[[Any], str], failed: Callable[[Any], bool]) -> int:
    """A fault run's command: ``run_one(backend)`` for each backend, one summary
    ``line`` each, then the JSON of every run; exit 1 when any ``failed``."""
    results = []
    for backend in backends.split(","):
        started = time.monotonic()
        figures = run_one(backend)
        results.append(figures)
        print(f"{backend}: {line(figures)} in {time.monotonic() - started:.0f} s", flush=True)
    print(json.dumps({"benchmark": benchmark, "seed": seed, "results": [asdict(r) for r in results]}))
    return 1 if any(failed(r) for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="cgroups_v1,cgroups_v2")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--agent-log", help="keep the agents' log lines here (one file per backend: PATH.<backend>)")
    args = parser.parse_args(argv)
    return run_backends(
        "random_fault_run", args.seed, args.backends,
        lambda backend: run(backend, args.rounds, args.seed, workers=args.workers, log=sys.stderr,
                            agent_log_copy=f"{args.agent_log}.{backend}" if args.agent_log else None),
        lambda figures: (
            f"{figures.rounds} rounds, {figures.lifecycles} lifecycles, {figures.worker_kills} worker"
            f" kills, {figures.worker_stops} worker stops, {figures.agent_kills} agent kills"
            f" ({figures.agent_kills_with_worker_stopped} with the worker stopped; {figures.fenced_when_continued}"
            f" workers fenced when continued), {figures.judgements}"
            f" judgements: {figures.double_grants} double grants, {figures.hangs} hangs, {figures.leaks} leaks,"
            f" {figures.wrong_error_types} wrong error types ({figures.failed_calls} calls failed, as faults"
            " make them)"),
        lambda r: bool(r.double_grants or r.hangs or r.leaks or r.wrong_error_types),
    )


if __name__ == "__main__":
    sys.exit(main())
