"""SPEC R-SH-3 and R-SH-4, end to end: a rolling update of both Kubernetes front doors on one node.

Release 0.1.0's own code (``git archive 2603e17``, unpacked at test time) runs the device plugin and the
DRA driver as processes on one simulated node with a node ledger, beside the fake kubelet (device plugin
API and PodResources), the fake DRA kubelet and the fake API server (``tests.support.kube_node``). Pods get
GPUs from the device plugin, claims from the DRA driver; each one's container is a cgroup of the test's own
(cgroup v1: ``devices.deny a`` then the CDI spec's nodes allowed, as a runtime applies a spec; v2: a device
program of those rules) holding a probe child, and the kernel judges which GPU nodes it opens. Then both
get SIGTERM (exit 0), the kubelet deletes the node's slices as it does for a plugin gone, and this release's
two start on the same directories, as the DaemonSets' new pods do. Then:

- no grant lost: the ledger holds the same units for the same owners and holders, the DRA checkpoint
  the same claims, the claims' CDI specs are there;
- no unit handed out twice: an ``Allocate`` for more GPUs than are free (one held by a claim) and a claim
  of a pod's GPU are refused naming the holder; the device plugin lists the claims' GPUs ``Unhealthy``
  and the slice leaves the pods' GPUs out;
- the slice is back within a pass (``--poll_interval``);
- every pod's device access is unchanged (the same verdicts from the same cgroups), and a container
  started now from the CDI specs this release wrote gets the same access;
- everything unprepares and goes back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.devices import Policy, build_device_program
from actors.ledger import dra_plugin_owner
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.support.bytecode import compile_project
from tests.support.kernel import V1_HIERARCHY, V2_HIERARCHY, attach_program, bpf_unusable, remove_test_cgroups
from tests.support.kube_node import DRIVER, NODE, KubeNode
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases
from tests.support.probes import DENIED, GRANTED, DeviceProbe, mknod_nodes
from tests.upgrades.kube_fixtures import wait_leases
from tests.upgrades.write_fixtures import DEFAULT_COMMIT, REPOSITORY

DRA_OWNER = dra_plugin_owner(DRIVER)
ALL = [f"gpu-{minor}" for minor in range(8)]
PASS_S = 0.2


def _kernel() -> tuple[str, int] | str:
    """(hierarchy, version) for the pods' cgroups, or why there is none."""
    if os.geteuid() != 0:
        return "needs root: pods' cgroups and device nodes"
    if V1_HIERARCHY and os.path.isfile(os.path.join(V1_HIERARCHY, "devices.list")):
        return V1_HIERARCHY, 1
    if V2_HIERARCHY:
        reason = bpf_unusable()
        return reason if reason else (V2_HIERARCHY, 2)
    return "no cgroup v1 devices hierarchy and no cgroup2 here"


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.1.0's tree (``git archive``), its code checked to be what its plugins import."""
    found = subprocess.run(["git", "-C", REPOSITORY, "cat-file", "-e", f"{DEFAULT_COMMIT}^{{commit}}"],
                           capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"commit {DEFAULT_COMMIT} (release 0.1.0) is not in this clone (a shallow clone?): the rolling"
                    " update needs that release's code")
    tree = tmp_path_factory.mktemp("release-0.1.0")
    archive = subprocess.Popen(["git", "-C", REPOSITORY, "archive", DEFAULT_COMMIT], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True, timeout=60)
    assert archive.wait(60) == 0
    imported = subprocess.run([sys.executable, "-c", "import isolators; print(isolators.__file__)"], cwd=tree,
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert imported == str(tree / "isolators" / "__init__.py")  # the old code, not this checkout's
    compile_project(tree)  # its plugins start several times: they read its bytecode, not compile it each time
    return tree


class Pods:
    """Containers as a runtime makes them from CDI names: a cgroup each, with a probe child inside."""

    def __init__(self, kube: KubeNode, hierarchy: str, version: int, nodes_dir: Path) -> None:
        self.kube, self.hierarchy, self.version = kube, hierarchy, version
        self.root = os.path.join(hierarchy, f"gpu-isolator-test-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.root)
        self.probes: dict[str, DeviceProbe] = {}
        gpu_nodes = [("c", 195, minor) for minor in range(8)]
        self.nodes = mknod_nodes(str(nodes_dir), gpu_nodes)
        self.gpus = {f"gpu-{minor}": self.nodes[("c", 195, minor)] for minor in range(8)}

    def rules(self, cdi_names: list[str]) -> list[str]:
        """The device rules of ``cdi_names`` in the spec files as they are now (the spec's shared nodes too)."""
        specs = [json.loads(path.read_text()) for path in self.kube.cdi.glob("*.json")]
        rules = []
        for name in cdi_names:
            kind, _, device = name.partition("=")
            [spec] = [spec for spec in specs if spec["kind"] == kind and device in {d["name"] for d in spec["devices"]}]
            [entry] = [d for d in spec["devices"] if d["name"] == device]
            for node in entry["containerEdits"]["deviceNodes"] + spec.get("containerEdits", {}).get("deviceNodes", []):
                rules.append(f"{node['type']} {node['major']}:{node['minor']} {node.get('permissions') or 'rwm'}")
        return sorted(set(rules))

    def start(self, name: str, cdi_names: list[str]) -> None:
        cgroup = os.path.join(self.root, name)
        os.mkdir(cgroup)
        rules = self.rules(cdi_names)
        if self.version == 1:
            with open(os.path.join(cgroup, "devices.deny"), "w") as deny:
                deny.write("a")
            for rule in rules:
                with open(os.path.join(cgroup, "devices.allow"), "w") as allow:
                    allow.write(rule)
        else:
            attach_program(cgroup, build_device_program(Policy.create(allow=rules)), "runtime")
        probe = DeviceProbe()
        self.probes[name] = probe
        probe.move_to(cgroup)

    def verdicts(self) -> dict[str, dict[str, str]]:
        """Each container's verdict on each GPU node: the kernel's."""
        return {name: {gpu: probe.access(path) for gpu, path in self.gpus.items()}
                for name, probe in sorted(self.probes.items())}

    def close(self) -> None:
        for probe in self.probes.values():
            probe.close()
        remove_test_cgroups(self.root, self.version == 2)


@pytest.fixture
def node(tmp_path: Path, previous_release: Path) -> Iterator[tuple[KubeNode, Pods]]:
    kernel = _kernel()
    if isinstance(kernel, str):
        pytest.skip(kernel)
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "node", sockets, DGX8, str(tmp_path / "ledger"), pass_s=PASS_S)
        kube.code = previous_release
        (tmp_path / "nodes").mkdir()
        pods = Pods(kube, *kernel, tmp_path / "nodes")
        try:
            yield kube, pods
        finally:
            try:
                kube.close()
            finally:
                pods.close()


def expected(pod_gpus: list[str]) -> dict[str, str]:
    return {gpu: GRANTED if gpu in pod_gpus else DENIED for gpu in ALL}


def test_a_rolling_update_of_both_plugins_loses_no_grant_hands_out_nothing_twice_and_keeps_every_pods_access(
        node: tuple[KubeNode, Pods]) -> None:
    kube, pods = node
    uuid_of = kube.uuids
    kube.start()  # release 0.1.0's device plugin and DRA driver
    # pods p1 (gpu-0) and p2 (gpu-1, gpu-2) from the device plugin; claims c1 (gpu-4) and c2 (gpu-5, gpu-6)
    names = {}
    for pod, gpus in {"p1": ["gpu-0"], "p2": ["gpu-1", "gpu-2"]}.items():
        answer = kube.allocate(pod, [uuid_of[gpu] for gpu in gpus])
        names[pod] = [device.name for device in answer.cdi_devices]
        pods.start(pod, names[pod])
    claims = {}
    for name, gpus in {"c1": ["gpu-4"], "c2": ["gpu-5", "gpu-6"]}.items():
        claims[name] = kube.claim(gpus)
        answer = kube.prepare(claims[name])
        assert [d["device_name"] for d in answer["devices"]] == gpus, answer
        pods.start(name, [i for d in answer["devices"] for i in d["cdi_device_ids"]])
    held = {"195:0": (PLUGIN_OWNER, ("ns/p1/gpu",)), "195:1": (PLUGIN_OWNER, ("ns/p2/gpu",)),
            "195:2": (PLUGIN_OWNER, ("ns/p2/gpu",)), "195:4": (DRA_OWNER, (claims["c1"][2],)),
            "195:5": (DRA_OWNER, (claims["c2"][2],)), "195:6": (DRA_OWNER, (claims["c2"][2],))}
    wait_leases(kube, held, "the pods' and the claims' units held")
    access = {"p1": expected(["gpu-0"]), "p2": expected(["gpu-1", "gpu-2"]), "c1": expected(["gpu-4"]),
              "c2": expected(["gpu-5", "gpu-6"])}
    assert pods.verdicts() == access
    prepared = kube.prepared()
    specs = sorted(p.name for p in kube.cdi.glob("*.json"))

    # the rolling update: SIGTERM to both; the kubelet deletes the slices of a driver gone; the new pods start
    assert kube.device_plugin.stop(timeout=10) == 0 and kube.dra_plugin.stop(timeout=10) == 0  # R-SH-4
    kube.api.delete_slices(NODE)
    kube.code = None  # this release
    kube.restart_device_plugin()
    kube.restart_dra_plugin()

    # the slice is back within a pass, without the pods' GPUs (the driver's own claims stay in it)
    kube.wait_slice(lambda devices: devices == ALL[3:], "the slice back", timeout=PASS_S * 10 + 5)
    # no grant lost
    wait_leases(kube, held, "every grant held as before")
    assert kube.prepared() == prepared and sorted(p.name for p in kube.cdi.glob("*.json")) == specs
    assert [d["device_name"] for d in kube.prepare(claims["c2"])["devices"]] == ["gpu-5", "gpu-6"]
    # nothing held is handed out: the claims' GPUs withheld by the device plugin, the pods' out of the slice
    kube.wait_listed(lambda listed: [listed[uuid_of[gpu]] for gpu in ALL] == ["Healthy"] * 4 + ["Unhealthy"] * 3
                     + ["Healthy"], "the claims' GPUs Unhealthy in ListAndWatch")
    with pytest.raises(grpc.RpcError) as refused:  # 3 GPUs asked, 2 free (gpu-3, gpu-7)
        kube.allocate("p3", [uuid_of["gpu-3"], uuid_of["gpu-7"], uuid_of["gpu-4"]])
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (f"Held by another front door of this node: {uuid_of['gpu-4']} (195:4) is held"
                                       f" by {DRA_OWNER} (running) for {claims['c1'][2]}; nothing was allocated")
    late = kube.claim(["gpu-1"])
    assert kube.prepare(late)["error"].endswith(f"{uuid_of['gpu-1']} (195:1) is held by {PLUGIN_OWNER} (running)"
                                                " for ns/p2/gpu; nothing was prepared")
    assert leases(kube.ledger) == held
    # every pod's access unchanged, and a container started now from this release's specs gets the same
    assert pods.verdicts() == access
    answer = kube.allocate("p3", [uuid_of["gpu-3"]])
    pods.start("p1-restarted", names["p1"])  # the kubelet keeps a pod's Allocate answer for its restarts
    pods.start("c2-restarted", [i for d in kube.prepare(claims["c2"])["devices"] for i in d["cdi_device_ids"]])
    pods.start("p3", [device.name for device in answer.cdi_devices])
    assert pods.verdicts() == {**access, "p1-restarted": access["p1"], "c2-restarted": access["c2"],
                               "p3": expected(["gpu-3"])}
    wait_leases(kube, {**held, "195:3": (PLUGIN_OWNER, ("ns/p3/gpu",))}, "p3's GPU held for its pod")

    # and everything goes back
    for pod in ("p1", "p2", "p3"):
        kube.remove_pod(pod)
    assert kube.unprepare(claims["c1"]) == {} and kube.unprepare(claims["c2"]) == {}
    wait_leases(kube, {}, "every unit back")
    kube.wait_slice(lambda devices: devices == ALL, "every GPU in the slice")
    assert kube.device_plugin.stop(timeout=10) == 0 and kube.dra_plugin.stop(timeout=10) == 0  # R-SH-4
