"""The node ledger's fault run with MPS shares (SPEC R-MP-6, R-MP-1, R-NL-3; issue 49).

One simulated 8-GPU node (``tests.support.kube_node``), one node ledger, one
runtime directory, both Kubernetes front doors sharing through MPS with the
stand-in ``nvidia-cuda-mps-control`` (``actors.mps.testing``): the device
plugin with ``--mps_replicas=2`` and the DRA driver with ``--sharing=mps``.
One thread (so that a seed replays the same sequence) plays the kubelet and
the scheduler, one random step at a time:
- a pod given one MPS share ID (``<uuid>::<i>``) of one of the first
  ``CONTENDED`` GPUs by ``Allocate`` (recorded in PodResources once
  answered; refused when the DRA driver holds the unit), or a pod gone;
- a claim asking ``capacity.requests.memory`` allocated by the fake API
  server as the scheduler does (``KubeNode.share``) and prepared, or a
  prepared claim unprepared (and removed);
- a front door SIGKILLed, now or while an Allocate or a prepare is in
  flight (a thread makes the call; its answer, when one came, counts, and
  a prepare not answered is unprepared once the driver is back);
  sometimes, while it is down, its pods go (the kubelet does not wait for
  a device plugin), or one of its daemons is SIGKILLed too; then it is
  started again on the same directories, as its DaemonSet would (a kill
  mid-call lands after a seeded delay, but where the call had got to is
  the machine's timing: such a run replays its decisions, not always its
  interleaving);
- an MPS daemon SIGKILLed (found by the PID its pid file names,
  ``<runtime_dir>/mps/<uuid>/pipe/nvidia-cuda-mps-control.pid``).

With ``containers`` (the default as root, where cgroups are mounted) each
front door runs as in a pod: born in a "container" of its own, cgroups
``<root>/<command>`` of every hierarchy under a test root
(``tests.support.kernel.in_cgroups``), with ``--mps_cgroup=<root>/mps``;
a kill is the container's stop, every process of its cgroups SIGKILLed
(``stop_cgroups``), a launcher or daemon still in there included, as a
runtime and the kubelet stop a pod. Without, a kill is the front door's
process alone.

After every step the node is judged by the processes and files, never by
the front doors' own view. A *live share* is a share ID PodResources
assigns to a pod (its Allocate answered) or a device of a claim the DRA
checkpoint holds. Counted:
- double grants: a unit with live shares of both front doors;
- unleased grants: a unit with a live share whose lease file does not name
  that share's front door;
- shares without a daemon: a unit with a live share whose daemon's pid
  file does not name a live process that answers ``get_server_list``
  through the stand-in client within ``SETTLE_S`` (its restart is
  asynchronous, with a backoff);
- daemons without a share: a live daemon (its pid file names a live
  process) of a unit with no live share still running after ``SETTLE_S``
  (the device plugin's allocate grace, ``ALLOCATE_GRACE_S``, and a pass:
  a pod that went before any PodResources List named it is told from an
  admission still under way only by that grace);
- hangs: a front door that does not start and register within its bound,
  a call that does not answer within its own;
- leaks: once every pod and claim has gone and both front doors stopped, a
  lease left in the ledger or a daemon left running.

``python -m tests.reliability.mps_fault_run --steps 200 --seed 49`` prints
the figures; the test runs a short one. Teardown SIGKILLs every stand-in
daemon the run started (by its pid file, then by the stand-in's own path in
``/proc``), whatever happened.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.ledger import dra_plugin_owner
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.reliability.ledger_fault_run import _read_leases
from tests.support.kernel import process_state
from tests.support.kube_node import DRIVER, KubeNode, end_mps_daemons
from tests.support.kubelet import DGX8, plugin_directory

CONTENDED = 3
"""The pods ask shares of the first GPUs only, where the scheduler puts claims first: the front doors contend."""
ALLOCATE_GRACE_S = 1.0
"""The device plugin's ``--allocate_grace``: a share no List named yet is returned once a List this long after
its Allocate does not name it (a pod that goes before any List saw it is such a share)."""
SETTLE_S = 5.0
"""Seconds a front door has to start, take over or stop a unit's daemon (past the allocate grace and a pass)."""
START_BOUND = 30.0
CALL_BOUND = 20.0
LOG_TAIL = 3000
"""Characters of each front door's log (its last life's) kept with the problems of a failed run."""
PID_FILE = "nvidia-cuda-mps-control.pid"
OWNERS = {"kubelet-plugin": PLUGIN_OWNER, "dra-plugin": dra_plugin_owner(DRIVER)}
COMMANDS = {"device_plugin": "kubelet-plugin", "dra_plugin": "dra-plugin"}


@dataclass
class Figures:
    seed: int = 0
    containers: bool = False
    """Each front door ran in cgroups of its own, killed as a container is stopped (see module rules)."""
    steps: int = 0
    judgements: int = 0
    plugin_kills: int = 0
    driver_kills: int = 0
    daemon_kills: int = 0
    mid_call_kills: int = 0
    """Front doors SIGKILLed while an Allocate or a prepare was in flight."""
    pods_gone_while_down: int = 0
    pod_lifecycles: int = 0
    claim_lifecycles: int = 0
    refused: int = 0
    double_grants: int = 0
    unleased_grants: int = 0
    shares_without_daemon: int = 0
    daemons_without_share: int = 0
    hangs: int = 0
    leaks: int = 0
    problems: list[str] = field(default_factory=list)

    def bad(self) -> int:
        return (self.double_grants + self.unleased_grants + self.shares_without_daemon + self.daemons_without_share
                + self.hangs + self.leaks)

    def line(self) -> str:
        return (f"seed {self.seed}, {self.steps} steps{', front doors in containers' if self.containers else ''}, {self.judgements} judgements, {self.plugin_kills} device"
                f" plugin kills ({self.pods_gone_while_down} pods gone while it was down), {self.driver_kills} DRA"
                f" driver kills ({self.mid_call_kills} of all kills mid-call), {self.daemon_kills} daemon kills,"
                f" {self.pod_lifecycles} pods, {self.claim_lifecycles} claims, {self.refused} refused:"
                f" {self.double_grants} double grants, {self.unleased_grants} unleased grants,"
                f" {self.shares_without_daemon} shares without a daemon, {self.daemons_without_share} daemons without"
                f" a share, {self.hangs} hangs, {self.leaks} leaks")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has: init here may not reap a daemon)."""
    return process_state(pid) not in (None, "Z")


def live_daemons(runtime_dir: str) -> dict[str, int]:
    """Unit UUID -> the PID of its daemon, where its pid file names a live process."""
    found = {}
    for pid_file in Path(runtime_dir).glob(f"mps/*/pipe/{PID_FILE}"):
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if _alive(pid):
            found[pid_file.parent.parent.name] = pid
    return found


def answers(control: str, runtime_dir: str, unit: str) -> bool:
    """Whether ``unit``'s daemon answers ``get_server_list`` through the stand-in client (bounded)."""
    where = Path(runtime_dir, "mps", unit)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(where / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(where / "log")}
    env.pop("FAKE_MPS_RECORD", None)
    try:
        done = subprocess.run([control], input="get_server_list\n", env=env, capture_output=True, text=True,
                              timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and "Error" not in done.stdout


def end_stand_ins(runtime_dir: str, control: str) -> list[int]:
    """SIGKILL every stand-in daemon of this run: by pid file, then any process running ``control``; their PIDs."""
    end_mps_daemons(runtime_dir)
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            exe = os.readlink(f"/proc/{entry}/exe")
        except OSError:
            continue
        if exe == control:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    return killed


class Run:
    """One fault run (see module rules)."""

    def __init__(self, kube: KubeNode, runtime_dir: str, control: str, seed: int, log: Any,
                 containers: str | None = None) -> None:
        self.kube = kube
        self.containers = containers
        """The test root of the front doors' cgroups (None: they run in the run's own)."""
        self.runtime_dir = runtime_dir
        self.control = control
        self.rng = random.Random(seed)
        self.figures = Figures(seed=seed)
        self.log = log
        self.pods: dict[str, str] = {}
        """Pod -> its share ID (PodResources assigns it: its Allocate answered)."""
        self.claims: dict[str, tuple[str, str, str]] = {}
        """Claim uid -> the claim (its prepare answered with devices)."""
        self._n = 0

    def problem(self, kind: str, text: str) -> None:
        self.figures.problems.append(f"step {self.figures.steps}: {kind}: {text}")
        if self.log is not None:
            print(f"step {self.figures.steps}: {kind}: {text}", file=self.log, flush=True)

    # -- the kubelet and the scheduler ------------------------------------------------------
    def allocate(self) -> None:
        import grpc

        uuids = [self.kube.uuids[f"gpu-{minor}"] for minor in range(CONTENDED)]
        free = sorted({f"{unit}::{i}" for unit in uuids for i in range(2)} - set(self.pods.values()))
        if not free:
            return
        share = self.rng.choice(free)
        pod = f"p{self._n}"
        self._n += 1
        try:
            self.kube.allocate(pod, [share])
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.figures.hangs += 1
                self.problem("hang", f"Allocate {share} for {pod} did not answer")
            elif "held by" in (error.details() or ""):
                self.figures.refused += 1
            else:
                self.problem("refusal", f"Allocate {share} for {pod}: {error.details()}")
            return
        self.pods[pod] = share

    def remove_pod(self) -> None:
        pod = self.rng.choice(sorted(self.pods))
        self.kube.remove_pod(pod)
        del self.pods[pod]
        self.figures.pod_lifecycles += 1

    def prepare(self) -> None:
        from tests.support.dra_scheduler import Unschedulable

        try:
            claim = self.kube.share({"memory": "8Gi"})
        except Unschedulable:
            self.figures.refused += 1
            return
        try:
            answer = self.kube.prepare(claim, timeout=CALL_BOUND)
        except Exception as error:  # noqa: BLE001 - a prepare of a running driver must answer
            self.figures.hangs += 1
            self.problem("hang", f"NodePrepareResources {claim[1]}: {error}")
            self.unprepare(claim)
            return
        if "devices" in answer:
            self.claims[claim[2]] = claim
            return
        if "held by" in answer.get("error", ""):
            self.figures.refused += 1
        else:
            self.problem("refusal", f"prepare {claim[1]}: {answer}")
        self.unprepare(claim)

    def unprepare(self, claim: tuple[str, str, str]) -> bool:
        try:
            answer = self.kube.unprepare(claim)
        except Exception as error:  # noqa: BLE001 - an unprepare of a running driver must answer
            self.figures.hangs += 1
            self.problem("hang", f"NodeUnprepareResources {claim[1]}: {error}")
            return False
        if answer.get("error"):
            self.problem("unprepare", f"{claim[1]}: {answer['error']}")
            return False
        self.kube.api.remove_claim(claim[0], claim[1])
        if self.claims.pop(claim[2], None) is not None:
            self.figures.claim_lifecycles += 1
        return True

    # -- faults ---------------------------------------------------------------------------
    def kill_daemon(self) -> None:
        pick = self.rng.random()  # drawn whatever runs: the seed replays the same sequence
        daemons = live_daemons(self.runtime_dir)
        if daemons:
            os.kill(daemons[sorted(daemons)[int(pick * len(daemons))]], signal.SIGKILL)
            self.figures.daemon_kills += 1

    def kill_front_door(self, which: str) -> None:
        if self.containers is not None:  # the container stopped: everything in its cgroups
            from tests.support.kernel import stop_cgroups

            stop_cgroups(f"{self.containers}/{COMMANDS[which]}")
        getattr(self.kube, f"kill_{which}")()
        if which == "device_plugin":
            self.figures.plugin_kills += 1
            if self.pods and self.rng.random() < 0.6:  # the kubelet does not wait for a device plugin
                self.remove_pod()
                self.figures.pods_gone_while_down += 1
        else:
            self.figures.driver_kills += 1
        if self.rng.random() < 0.3:
            self.kill_daemon()
        try:
            getattr(self.kube, f"restart_{which}")(timeout=START_BOUND)
        except AssertionError as error:
            self.figures.hangs += 1
            self.problem("hang", f"the {which} did not start and register again: {str(error)[:1000]}")

    def kill_mid_call(self) -> None:
        """A front door SIGKILLed while an Allocate or a prepare is in flight (after a random delay), started
        again; an Allocate answered is the pod's, a prepare not answered is unprepared once the driver is back
        (the kubelet tries again until it is)."""
        which = "device_plugin" if self.rng.random() < 0.5 else "dra_plugin"
        delay = self.rng.uniform(0.0, 0.12)  # an Allocate or a prepare takes about that long here
        done: dict[str, Any] = {}
        if which == "device_plugin":
            uuids = [self.kube.uuids[f"gpu-{minor}"] for minor in range(CONTENDED)]
            free = sorted({f"{unit}::{i}" for unit in uuids for i in range(2)} - set(self.pods.values()))
            if not free:
                return
            share, pod = self.rng.choice(free), f"p{self._n}"
            self._n += 1
            call = lambda: self.kube.allocate(pod, [share])  # noqa: E731
        else:
            from tests.support.dra_scheduler import Unschedulable

            try:
                claim = self.kube.share({"memory": "8Gi"})
            except Unschedulable:
                return
            call = lambda: self.kube.prepare(claim, timeout=CALL_BOUND)  # noqa: E731

        def calling() -> None:
            try:
                done["answer"] = call()
            except Exception as error:  # noqa: BLE001 - killed under it, or refused: told apart below
                done["error"] = error

        thread = threading.Thread(target=calling, daemon=True)
        thread.start()
        time.sleep(delay)
        self.kill_front_door(which)
        thread.join(CALL_BOUND)
        if thread.is_alive():
            self.figures.hangs += 1
            self.problem("hang", f"a call to the {which} did not end once it was killed")
            return
        self.figures.mid_call_kills += 1
        if which == "device_plugin":
            if "answer" in done:  # answered before it died: the kubelet assigned it
                self.pods[pod] = share
            return
        answer = done.get("answer", {})
        if "devices" in answer:
            self.claims[claim[2]] = claim
        else:
            self.unprepare(claim)

    # -- the judge ------------------------------------------------------------------------
    def live_shares(self) -> dict[str, set[str]]:
        """Front door -> the units with a live share (PodResources' share IDs, the DRA checkpoint's devices)."""
        plugin = {device_id.split("::")[0] for entry in self.kube.pod_resources.assignments for device_id in entry.ids}
        driver = {self.kube.uuids[device] for devices in self.kube.prepared().values() for device in devices}
        return {"kubelet-plugin": plugin, "dra-plugin": driver}

    def judge(self) -> None:
        self.figures.judgements += 1
        shares = self.live_shares()
        leases = _read_leases(self.kube.ledger)
        for unit in sorted(shares["kubelet-plugin"] & shares["dra-plugin"]):
            self.figures.double_grants += 1
            self.problem("double grant", f"{unit} has live shares of both front doors")
        for name, units in shares.items():
            for unit in sorted(units):
                lease = leases.get(unit)
                if lease is None or lease.owner != OWNERS[name]:
                    self.figures.unleased_grants += 1
                    self.problem("unleased grant", f"{unit} has a live share of the {name} but its lease is"
                                 f" {lease.owner + ' for ' + ','.join(lease.holders) if lease else 'absent'}")
        shared = shares["kubelet-plugin"] | shares["dra-plugin"]
        deadline = time.monotonic() + SETTLE_S
        while True:
            daemons = live_daemons(self.runtime_dir)
            missing = sorted(unit for unit in shared
                             if unit not in daemons or not answers(self.control, self.runtime_dir, unit))
            idle = sorted(set(daemons) - shared)
            if not (missing or idle) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for unit in missing:
            self.figures.shares_without_daemon += 1
            self.problem("share without a daemon", f"{unit} has a live share but no daemon that answers"
                         f" within {SETTLE_S:g} s (pid file names {daemons.get(unit, 'no live process')})")
        for unit in idle:
            self.figures.daemons_without_share += 1
            self.problem("daemon without a share", f"{unit}'s daemon (pid {daemons[unit]}) still runs"
                         f" {SETTLE_S:g} s after its unit's last share went")

    # -- the run --------------------------------------------------------------------------
    def step(self) -> None:
        action = self.rng.random()
        if action < 0.22:
            self.allocate()
        elif action < 0.36 and self.pods:
            self.remove_pod()
        elif action < 0.58:
            self.prepare()
        elif action < 0.72 and self.claims:
            self.unprepare(self.claims[self.rng.choice(sorted(self.claims))])
        elif action < 0.82:
            self.kill_front_door("device_plugin")
        elif action < 0.86:
            self.kill_front_door("dra_plugin")
        elif action < 0.94:
            self.kill_mid_call()
        else:
            self.kill_daemon()

    def finish(self) -> None:
        """Every pod and claim gone; both front doors killed and started again, then stopped: nothing left."""
        for pod in sorted(self.pods):
            self.kube.remove_pod(pod)
            del self.pods[pod]
            self.figures.pod_lifecycles += 1
        for uid, devices in self.kube.prepared().items():  # the checkpoint's too (a prepare answered late)
            if uid not in self.claims:
                self.claims[uid] = ("ns", "unknown", uid)
        for claim in list(self.claims.values()):
            self.unprepare(claim)
        self.judge()
        for which in ("device_plugin", "dra_plugin"):
            self.kill_front_door(which)
        self.judge()
        for command in (self.kube.device_plugin, self.kube.dra_plugin):
            if command is not None and command.stop() != 0:
                self.problem("exit", f"{command.COMMAND} did not exit 0 on SIGTERM")
        left = _read_leases(self.kube.ledger)
        if left:
            self.figures.leaks += len(left)
            self.problem("leak", "leases left once every pod and claim went: "
                         + "; ".join(f"{lease.unit} by {lease.owner}" for lease in left.values()))
        daemons = live_daemons(self.runtime_dir)
        if daemons:
            self.figures.leaks += len(daemons)
            self.problem("leak", f"daemons left running once every share went: {daemons}")


def containers_here() -> bool:
    """Whether front doors can run in cgroups of their own here (root, cgroups mounted)."""
    from actors.mps._cgroup import cgroup_mounts

    return os.geteuid() == 0 and bool(cgroup_mounts())


def run(steps: int, seed: int, control: str | os.PathLike[str], log: Any = None,
        containers: bool | None = None) -> Figures:
    """The fault run (see module rules); its figures. ``containers`` None: where ``containers_here()``."""
    from tests.support.kernel import in_cgroups

    control = os.path.realpath(control)
    base = tempfile.mkdtemp(prefix="gpu-isolator-mps-faults-")
    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")  # short: the daemon's socket path is bounded
    root = f"gpu-isolator-test-mps-faults-{uuid.uuid4().hex[:8]}" \
        if (containers_here() if containers is None else containers) else None
    this: Run | None = None
    try:
        with plugin_directory() as sockets:
            common = (f"--mps_control={control}", f"--runtime_dir={runtime_dir}",
                      *([f"--mps_cgroup={root}/mps"] if root else []))
            kube = KubeNode(Path(base, "kube"), sockets, DGX8, os.path.join(base, "ledger"),
                            allocate_grace_s=ALLOCATE_GRACE_S,
                            device_plugin_options=("--mps_replicas=2", *common),
                            dra_plugin_options=("--sharing=mps", *common),
                            prefixes={command: in_cgroups(f"{root}/{command}") for command in COMMANDS.values()}
                            if root else None)
            this = Run(kube, runtime_dir, control, seed, log, root)
            this.figures.containers = root is not None
            try:
                kube.start()
                kube.wait_slice(lambda devices: len(devices) == len(kube.uuids), "the sharing slice published")
                for step in range(steps):
                    this.figures.steps = step + 1
                    this.step()
                    this.judge()
                this.finish()
            finally:
                logs = "".join(f"\n{command.COMMAND}'s log ends: {command.log()[-LOG_TAIL:]}"
                               for command in (kube.device_plugin, kube.dra_plugin) if command is not None)
                kube.close()
                if this.figures.bad():
                    this.figures.problems.append(logs)
        return this.figures
    finally:
        left = end_stand_ins(runtime_dir, control)
        if left and this is not None:
            this.figures.leaks += len(left)
            this.problem("leak", f"stand-in daemons still running at teardown, killed: {left}")
        if root is not None:
            from tests.support.engines import remove_cgroup_trees

            remove_cgroup_trees(root)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    from actors.mps.testing import build_mps_control

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=49)
    parser.add_argument("--containers", action=argparse.BooleanOptionalAction, default=None,
                        help="front doors in cgroups of their own, killed as containers (default: as root)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        control = build_mps_control(scratch)
        if control is None:
            print("gcc is not installed: cannot build the stand-in MPS control daemon", file=sys.stderr)
            return 2
        figures = run(args.steps, args.seed, control, log=sys.stderr, containers=args.containers)
    print(figures.line())
    return 1 if figures.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
