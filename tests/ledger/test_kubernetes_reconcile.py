"""SPEC R-NL-3/4 for the Kubernetes plugins: what each one's own truth says when it
comes back. The device plugin holds what PodResources assigns (pods sharing a
time-sliced GPU share its lease), returns what no pod holds -- also an
Allocate the kubelet never recorded -- and reconciles at start; the DRA
driver reconciles from its checkpoint. A killed plugin's units wait for it,
and the refusal says so. One PodResources List a pass serves the ledger and
pod repair alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.ledger import dra_plugin_owner
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from isolators.kubernetes.pod_repair import AssignedDevices
from tests.support.kube_node import DRIVER, GPU, KubeNode
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases, until

DRA_OWNER = dra_plugin_owner(DRIVER)
WAITS = (f" (not running: its units wait for it to restart and reconcile, or for 'gpu-isolator ledger release"
         " --owner {owner}')")


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeNode]:
    with plugin_directory() as sockets:
        node = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), allocate_grace_s=1.0,
                        device_plugin_options=("--time_slicing_replicas=2",))
        try:
            yield node.start()
        finally:
            node.close()


def held(kube: KubeNode, device: str) -> tuple[str, frozenset[str]] | None:
    lease = leases(kube.ledger).get(device)
    return (lease[0], frozenset(lease[1])) if lease is not None else None


@pytest.mark.asyncio
async def test_the_device_plugin_holds_what_pod_resources_assigns_and_reconciles_when_it_comes_back(kube) -> None:
    u = kube.uuids
    kube.allocate("p1", [f"{u['gpu-0']}::0"])
    kube.allocate("p2", [f"{u['gpu-0']}::1"])  # the other replica of the same GPU: shared inside the owner
    kube.allocate("p3", [f"{u['gpu-1']}::0"])
    await until(lambda: held(kube, "195:0") == (PLUGIN_OWNER, {"ns/p1/gpu", "ns/p2/gpu"}), "p1, p2 hold gpu-0")
    await until(lambda: held(kube, "195:1") == (PLUGIN_OWNER, {"ns/p3/gpu"}), "p3 holds gpu-1")

    # An Allocate the kubelet never records (a pod admission that failed): its units go back after the grace.
    kube.kubelet.allocate(GPU, [f"{u['gpu-2']}::0"])
    assert held(kube, "195:2") == (PLUGIN_OWNER, {f"allocate {GPU} {u['gpu-2']}::0"})
    await until(lambda: "195:2" not in leases(kube.ledger), "the unrecorded Allocate's gpu-2 went back")
    kube.device_plugin.wait_log(f"Allocate of {u['gpu-2']}::0 for {GPU} was never recorded by the kubelet")

    kube.remove_pod("p1")
    await until(lambda: held(kube, "195:0") == (PLUGIN_OWNER, {"ns/p2/gpu"}), "p2 alone holds gpu-0")
    kube.wait_slice(lambda devices: "gpu-0" not in devices and "gpu-1" not in devices and "gpu-2" in devices,
                    "the DRA driver offers neither gpu-0 nor gpu-1")

    # The plugin dies; p3 ends meanwhile. Its units wait for it: nobody else takes them.
    kube.kill_device_plugin()
    kube.remove_pod("p3")
    early = kube.claim(["gpu-1"])
    assert kube.prepare(early)["error"] == (
        f"claim ns/{early[1]} (uid {early[2]}): Held by another front door of this node: {u['gpu-1']} (195:1) is held"
        f" by {PLUGIN_OWNER}{WAITS.format(owner=PLUGIN_OWNER)} for ns/p3/gpu; nothing was prepared")
    # Back: it holds what PodResources assigns (p2's replica) and returns the rest (gpu-1).
    kube.restart_device_plugin()
    kube.wait_slice(lambda devices: "gpu-1" in devices and "gpu-0" not in devices, "gpu-1 back in the slice")
    assert held(kube, "195:0") == (PLUGIN_OWNER, {"ns/p2/gpu"}) and "195:1" not in leases(kube.ledger)
    kube.device_plugin.wait_log("Reconciled with PodResources: units leased by the last run that no pod holds went"
                                " back to the node ledger: 195:1")
    claim = kube.claim(["gpu-1"])
    assert [d["device_name"] for d in kube.prepare(claim)["devices"]] == ["gpu-1"]
    kube.wait_listed(lambda listed: listed[f"{u['gpu-1']}::0"] == listed[f"{u['gpu-1']}::1"] == "Unhealthy",
                     "gpu-1's replicas held by the DRA driver: Unhealthy")


@pytest.mark.asyncio
async def test_the_dra_driver_reconciles_from_its_checkpoint_and_its_units_wait_for_it(kube) -> None:
    u = kube.uuids
    kept, lost = kube.claim(["gpu-3"]), kube.claim(["gpu-4"])
    for claim in (kept, lost):
        assert "devices" in kube.prepare(claim)
    assert held(kube, "195:3") == (DRA_OWNER, {kept[2]}) and held(kube, "195:4") == (DRA_OWNER, {lost[2]})
    kube.wait_listed(lambda listed: listed[f"{u['gpu-4']}::0"] == "Unhealthy", "gpu-4 Unhealthy")
    kube.kill_dra_plugin()
    with pytest.raises(grpc.RpcError) as refused:
        kube.allocate("p1", [f"{u['gpu-3']}::0"])
    assert refused.value.details() == (
        f"Held by another front door of this node: {u['gpu-3']} (195:3) is held by"
        f" {DRA_OWNER}{WAITS.format(owner=DRA_OWNER)} for {kept[2]}; nothing was allocated")
    # A crash after the lease was taken and before the checkpoint was written: the checkpoint is the truth.
    checkpoint = Path(kube.node.work_dir) / "dra" / DRIVER / "prepared-claims.json"
    document = json.loads(checkpoint.read_text())
    document["claims"] = [c for c in document["claims"] if c["ref"]["uid"] != lost[2]]
    checkpoint.write_text(json.dumps(document))
    kube.restart_dra_plugin()
    kube.wait_listed(lambda listed: listed[f"{u['gpu-4']}::0"] == "Healthy" and
                     listed[f"{u['gpu-3']}::0"] == "Unhealthy", "gpu-4 back, gpu-3 kept for its claim")
    assert held(kube, "195:3") == (DRA_OWNER, {kept[2]}) and "195:4" not in leases(kube.ledger)
    kube.dra_plugin.wait_log("Reconciled with the checkpoint: units leased by the last run that no prepared claim"
                             " holds went back to the node ledger: 195:4")
    kube.allocate("p2", [f"{u['gpu-4']}::0"])
    assert kube.unprepare(kept) == {}
    await until(lambda: "195:3" not in leases(kube.ledger), "the unprepared claim's gpu-3 went back")


@pytest.mark.asyncio
@pytest.mark.parametrize("repair", [True, False], ids=["with-pod-repair", "without"])
async def test_one_pod_resources_list_a_pass_serves_the_ledger_and_pod_repair(tmp_path: Path, repair: bool) -> None:
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), repair_pods=repair,
                        device_plugin_options=("--repair_interval=3600",))  # the pass at start, and no other
        uuid5 = kube.uuids["gpu-5"]
        kube.pod_resources.assignments = [AssignedDevices(namespace="ml", pod="train", container="cuda",
                                                          resource=GPU, ids=(uuid5,))]
        try:
            kube.start(dra=False)
            await until(lambda: held(kube, "195:5") == (PLUGIN_OWNER, {"ml/train/cuda"}), "the pod's unit held")
            if repair:
                await until(lambda: kube.device_plugin.metrics().get("kubelet_repair_passes_total") == 1,
                            "pod repair's pass done")
            else:
                assert "kubelet_repair_passes_total" not in kube.device_plugin.metrics()
            assert kube.pod_resources.calls == 1
        finally:
            kube.close()
