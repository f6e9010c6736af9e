"""The node ledger's random fault run (SPEC R-NL-3, issue 43): front doors of one node SIGKILLed at random.

One 8-GPU node (one host file), one node ledger, five front doors: two
isolator agents (``fault_agent``: 6 concurrent lifecycles of ``gpus:1``
each, in processes of their own, the seed's "multiple containerizers"),
``serve`` (a driver thread prepares and cleans up ``gpus:1`` containers on
its socket, as an agent would), each with a cgroups root and work
directory of its own, and both Kubernetes plugins (``kubelet-plugin`` and
``dra-plugin``, ``tests.support.kube_node``: the fake kubelet, its
PodResources, the fake DRA kubelet and API server). A thread plays the
kubelet and the scheduler for the plugins (``KubeDriver``): pods given one
GPU by ``Allocate`` (recorded in PodResources once answered) and removed,
claims of one GPU prepared and unprepared -- each naming a GPU no pod or
claim of its own holds, as the kubelet and the scheduler would: half the
time one the plugin offers now (its last ``ListAndWatch`` list, the
slice), else any (a kubelet or scheduler that had not heard yet). Every front door asks for more
GPUs than are free, so grants are refused all the time. At random moments
a front door is SIGKILLed (and started again, recovering what it held),
or the node is judged.

The judge: every front door and its device worker are frozen (SIGSTOP);
a probe moved into each cgroup under each root opens every GPU node (the
kernel, as in ``fault_run``), and the plugins' grants are read: the units
PodResources assigns (Allocate answers the kubelet recorded) and the
devices of prepared claims (the driver's answers and its checkpoint).
Counted:
- double grants: a GPU two cgroups can open at once, or that is granted
  by two front doors (cgroups whose prepare is in flight, or was in
  flight when their front door died and are not cleaned up yet, are left
  out: between mkdir and its rules a cgroup allows what its parent
  allows, with no process inside yet);
- unleased grants: a GPU a cgroup can open, or a plugin granted, whose
  lease in the ledger does not name that front door (take before any
  effect, return only after it is undone);
- hangs: a front door that did not start (recover, register) within its
  bound, an isolator call, a service request or a plugin call that did
  not answer within its own;
- leaks: once every front door has released, restarted and stopped, a
  lease left in the ledger or a cgroup left under a root.

``python -m tests.reliability.ledger_fault_run --backends cgroups_v1,cgroups_v2
--steps 200 --seed 43`` prints the figures; the test runs a short one.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.devices import default_hierarchy
from actors.ledger import Lease, dra_plugin_owner, isolator_owner, serve_owner
from actors.nvml import load_host_file
from isolators.simulated_node import SimulatedNode, backend_unavailable, remove_cgroup_tree
from tests.reliability.fault_run import START_BOUND, Agent, Judge, run_backends
from tests.reliability.fault_run import Ledger as AgentEvents
from tests.reliability.fault_run import _signal, _wait_stopped
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.support.kube_node import DRIVER, KubeNode
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
    plugin_kills: int = 0
    lifecycles: int = 0
    serve_lifecycles: int = 0
    pod_lifecycles: int = 0
    claim_lifecycles: int = 0
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


class KubeDriver(threading.Thread):
    """The kubelet and the scheduler of both plugins (see module rules): at most ``pods`` pods and ``claims``
    claims of one GPU each at a time, each naming a GPU none of its own pods or claims holds."""

    def __init__(self, kube: KubeNode, seed: int, pods: int = 2, claims: int = 2) -> None:
        super().__init__(daemon=True)
        self.kube = kube
        self.rng = random.Random(seed + 1)
        self.max_pods = pods
        self.max_claims = claims
        self.lock = threading.Lock()
        self.pods: dict[str, str] = {}
        """Pod -> the UUID PodResources assigns it (recorded once Allocate answered)."""
        self.claims: dict[str, tuple[tuple[str, str, str], str]] = {}
        """Claim uid -> (the claim, its device): prepared (the driver answered)."""
        self.unsure: dict[str, tuple[tuple[str, str, str], str]] = {}
        """Claims whose prepare was not answered (the driver died or restarted): unprepared once it answers."""
        self.pod_lifecycles = 0
        self.claim_lifecycles = 0
        self.refused = 0
        self.hangs: list[str] = []
        self.stopping = threading.Event()
        self._n = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            self.step()
            time.sleep(self.rng.uniform(0.0, 0.05))

    def step(self) -> None:
        for uid in list(self.unsure):
            self._unprepare(uid, self.unsure)
        action = self.rng.random()
        if action < 0.25 and len(self.pods) < self.max_pods:
            self._allocate()
        elif action < 0.5 and self.pods:
            pod = self.rng.choice(sorted(self.pods))
            self.kube.remove_pod(pod)
            with self.lock:
                del self.pods[pod]
            self.pod_lifecycles += 1
        elif action < 0.75 and len(self.claims) + len(self.unsure) < self.max_claims:
            self._prepare()
        elif self.claims:
            self._unprepare(self.rng.choice(sorted(self.claims)), self.claims)

    def _allocate(self) -> None:
        import grpc

        free = set(self.kube.uuids.values()) - set(self.pods.values())
        offered = {uuid_ for uuid_, health in self.kube.listed().items() if health == "Healthy"} & free
        uuid_ = self.rng.choice(sorted(offered if offered and self.rng.random() < 0.5 else free))
        pod = f"p{self._n}"
        self._n += 1
        try:
            self.kube.allocate(pod, [uuid_])
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.hangs.append(f"Allocate {uuid_} for {pod}")
            elif "held by" in (error.details() or "") or "Unhealthy" in (error.details() or ""):
                self.refused += 1
            return
        except Exception:  # noqa: BLE001 - the plugin is down or registering again: later
            time.sleep(0.05)
            return
        with self.lock:
            self.pods[pod] = uuid_

    def _prepare(self) -> None:
        import grpc

        free = set(self.kube.uuids) - {device for _, device in [*self.claims.values(), *self.unsure.values()]}
        offered = set(self.kube.slice_devices()) & free
        device = self.rng.choice(sorted(offered if offered and self.rng.random() < 0.5 else free))
        claim = self.kube.claim([device])
        with self.lock:
            self.unsure[claim[2]] = (claim, device)
        try:
            answer = self.kube.prepare(claim, timeout=REQUEST_BOUND)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.hangs.append(f"NodePrepareResources {claim[1]}")
            return
        except Exception:  # noqa: BLE001 - the driver is down or registering again: unprepared later
            time.sleep(0.05)
            return
        with self.lock:
            del self.unsure[claim[2]]
            if "devices" in answer:
                self.claims[claim[2]] = (claim, device)
                return
        if "held by" in answer.get("error", ""):
            self.refused += 1
        self.kube.api.remove_claim(claim[0], claim[1])

    def _unprepare(self, uid: str, table: dict[str, tuple[tuple[str, str, str], str]]) -> bool:
        import grpc

        claim, _device = table[uid]
        try:
            answer = self.kube.unprepare(claim)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.hangs.append(f"NodeUnprepareResources {claim[1]}")
            return False
        except Exception:  # noqa: BLE001 - the driver is down or registering again: later
            time.sleep(0.05)
            return False
        if answer.get("error"):
            return False
        with self.lock:
            del table[uid]
        if table is self.claims:
            self.claim_lifecycles += 1
        self.kube.api.remove_claim(claim[0], claim[1])
        return True

    def granted(self) -> dict[str, set[str]]:
        """Front door -> the device names (``gpu-<minor>``) it granted: PodResources' pods, prepared claims."""
        by_uuid = {uuid_: device for device, uuid_ in self.kube.uuids.items()}
        with self.lock:
            prepared = {device for _, device in self.claims.values()}
        prepared |= {device for devices in self.kube.prepared().values() for device in devices}
        return {"kubelet-plugin": {by_uuid[uuid_] for uuid_ in self.kube.assigned()}, "dra-plugin": prepared}

    def release_all(self, timeout: float) -> bool:
        """Every pod gone, every claim unprepared (those of the checkpoint too); whether all were."""
        deadline = time.monotonic() + timeout
        with self.lock:
            for pod in list(self.pods):
                self.kube.remove_pod(pod)
                del self.pods[pod]
                self.pod_lifecycles += 1
            for uid, devices in self.kube.prepared().items():
                if uid not in self.claims and uid not in self.unsure:
                    self.unsure[uid] = (("ns", "unknown", uid), devices[0])
        while (self.claims or self.unsure) and time.monotonic() < deadline:
            for table in (self.claims, self.unsure):
                for uid in list(table):
                    self._unprepare(uid, table)
            time.sleep(0.05)
        return not (self.claims or self.unsure)


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
    owners["kubelet-plugin"] = PLUGIN_OWNER
    owners["dra-plugin"] = dra_plugin_owner(DRIVER)
    sockets = tempfile.mkdtemp(prefix="k8s-", dir="/tmp")  # short: a unix socket path holds 107 bytes
    kube = KubeNode(os.path.join(base, "kube"), sockets, host_file, ledger)
    judges = {name: Judge(hierarchy, os.path.join(hierarchy, roots[name]), os.path.join(base, f"nodes-{name}"))
              for name in roots}
    events = {name: AgentEvents() for name in AGENTS}
    rounds = {name: 0 for name in AGENTS}
    agents: dict[str, Agent] = {}
    driver: ServeDriver | None = None
    kube_driver: KubeDriver | None = None

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
        for command in (kube.device_plugin, kube.dra_plugin):
            if command is not None and command.process is not None and command.process.poll() is None:
                frozen.append(command.process.pid)
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
            for name, devices in kube_driver.granted().items():  # type: ignore[union-attr]
                for device in devices:
                    minor = int(device.split("-")[1])
                    reach.setdefault(minor, []).append(name)
                    lease = leases.get(uuids[minor])
                    if lease is None or lease.owner != owners[name]:
                        figures.unleased_grants += 1
                        problem("unleased grant", f"GPU {minor} is granted by the {name} but its lease is"
                                f" {lease.owner + ' for ' + ','.join(lease.holders) if lease else 'absent'}")
            for minor, holders in sorted(reach.items()):
                if len(holders) > 1:
                    figures.double_grants += 1
                    problem("double grant", f"GPU {minor} can be opened from {holders}")
        finally:
            for pid in frozen:
                _signal(pid, signal.SIGCONT)

    def restart_plugin(which: str) -> None:
        try:
            getattr(kube, f"restart_{which}")(timeout=START_BOUND)
        except AssertionError as error:
            figures.hangs += 1
            problem("hang", f"the {which} did not start and register again: {str(error)[:2000]}")

    try:
        service.start(timeout=START_BOUND)
        kube.start()
        driver = ServeDriver(service, seed)
        driver.start()
        kube_driver = KubeDriver(kube, seed)
        kube_driver.start()
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
            elif action < 0.39:
                which = "device_plugin" if action < 0.32 else "dra_plugin"
                getattr(kube, f"kill_{which}")()
                figures.plugin_kills += 1
                restart_plugin(which)
            else:
                judge_now()
        judge_now()
        # The plugins' pods and claims end; both plugins restart (reconciling) and stop: their units are free.
        kube_driver.stopping.set()
        kube_driver.join(REQUEST_BOUND * 2)
        if kube_driver.is_alive() or not kube_driver.release_all(REQUEST_BOUND):
            figures.hangs += 1
            problem("hang", f"the plugins' claims {sorted(kube_driver.claims)} {sorted(kube_driver.unsure)} were not"
                    " unprepared")
        for which in ("device_plugin", "dra_plugin"):
            getattr(kube, f"kill_{which}")()
            restart_plugin(which)
        plugin_owners = {owners["kubelet-plugin"], owners["dra-plugin"]}
        deadline = time.monotonic() + REQUEST_BOUND
        while any(lease.owner in plugin_owners for lease in _read_leases(ledger).values()):
            if time.monotonic() > deadline:
                figures.hangs += 1
                problem("hang", "the plugins did not return their units once nothing held them")
                break
            time.sleep(0.05)
        for command in (kube.device_plugin, kube.dra_plugin):
            if command is not None and command.stop() != 0:
                problem("exit", f"{command.COMMAND} did not exit 0 on SIGTERM")
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
        figures.pod_lifecycles = kube_driver.pod_lifecycles
        figures.claim_lifecycles = kube_driver.claim_lifecycles
        figures.refused_grants = driver.refused + kube_driver.refused + sum(
            count for e in events.values() for reason, count in e.reasons.items() if "held by" in reason
            or "more held by other front doors" in reason)
        figures.hangs += len(driver.hangs) + len(kube_driver.hangs) + sum(len(e.hangs) for e in events.values())
        for text in kube_driver.hangs[:5]:
            problem("hang", f"a plugin call did not answer within {REQUEST_BOUND:g} s: {text}")
        figures.wrong_error_types = sum(len(e.wrong_types) for e in events.values())
        for e in events.values():
            for text in e.wrong_types[:5]:
                problem("error type", f"an isolator call failed with {text}")
        return figures
    finally:
        if driver is not None:
            driver.stopping.set()
        if kube_driver is not None:
            kube_driver.stopping.set()
            kube_driver.join(REQUEST_BOUND)
        plugin_logs = "".join(f"\n{command.COMMAND}'s log ends: {command.log()[-2000:]}"
                              for command in (kube.device_plugin, kube.dra_plugin) if command is not None)
        kube.close()
        shutil.rmtree(sockets, ignore_errors=True)
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
            figures.problems.append(f"the agents' log is kept in {kept}; serve's ends: {serve_log[-2000:]}"
                                    f"{plugin_logs}")
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="cgroups_v1,cgroups_v2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=43)
    args = parser.parse_args(argv)
    return run_backends(
        "ledger_fault_run", args.seed, args.backends,
        lambda backend: run(backend, args.steps, args.seed, log=sys.stderr),
        lambda figures: (
            f"seed {figures.seed}, {figures.steps} steps, {figures.judgements} judgements,"
            f" {figures.agent_kills} agent kills, {figures.serve_kills} serve kills, {figures.plugin_kills} plugin"
            f" kills, {figures.lifecycles} agent lifecycles, {figures.serve_lifecycles} serve lifecycles,"
            f" {figures.pod_lifecycles} pods, {figures.claim_lifecycles} claims, {figures.refused_grants} grants"
            f" refused (another front door held the units): {figures.double_grants} double grants,"
            f" {figures.unleased_grants} unleased grants, {figures.hangs} hangs, {figures.leaks} leaks,"
            f" {figures.wrong_error_types} wrong error types"),
        lambda r: bool(r.double_grants or r.unleased_grants or r.hangs or r.leaks or r.wrong_error_types),
    )


if __name__ == "__main__":
    sys.exit(main())
