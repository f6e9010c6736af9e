"""SPEC R-MP-5 and R-MP-6 through the real ``gpu-isolator dra-plugin --sharing=mps`` beside the real device
plugin, over one node ledger (``tests.support.kube_node``): the scheduler's part is played by the fake API
server as Kubernetes allocates consumable capacity. Two claims asking ``capacity.requests.memory`` share one
GPU, each prepared with its own limits, exactly its ``consumedCapacity``; the unit is the driver's in the
node ledger and each share a holder; no other front door takes it while a share lives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.ledger import dra_plugin_owner

from tests.support.kube_node import DRIVER, KubeNode
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases, until

DRA_OWNER = dra_plugin_owner(DRIVER)
GI = 1 << 30


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeNode]:
    with plugin_directory() as sockets:
        node = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"),
                        dra_plugin_options=("--sharing=mps",))
        try:
            node.start()
            yield node
        finally:
            node.close()


def checkpointed(kube: KubeNode) -> dict[str, list[dict]]:
    path = Path(kube.node.work_dir) / "dra" / DRIVER / "prepared-claims.json"
    return {claim["ref"]["uid"]: claim["devices"] for claim in json.loads(path.read_text())["claims"]}


@pytest.mark.asyncio
async def test_two_claims_share_one_gpu_each_with_its_own_limits_held_by_the_driver(kube: KubeNode) -> None:
    kube.wait_slice(lambda devices: len(devices) == 8, "the sharing slice published")
    [published] = kube.api.slices("node-a")
    assert all(d["allowMultipleAllocations"] for d in published["spec"]["devices"])
    assert not [r for r in kube.api.requests if "422" in r[4]]  # the API server took its request policies

    first = kube.share({"memory": "10Gi", "compute": "30"})
    second = kube.share({"memory": "1000Mi"})  # rounded up by the scheduler to 4 steps of 256Mi
    results = [kube.api.claims[(c[0], c[1])]["status"]["allocation"]["devices"]["results"][0] for c in (first, second)]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-0"]
    answers = [kube.prepare(claim) for claim in (first, second)]
    for claim, answer, result in zip((first, second), answers, results):
        [device] = answer["devices"]
        assert (device["device_name"], device["share_id"]) == ("gpu-0", result["shareID"])
        assert device["cdi_device_ids"] == [f"{DRIVER}/claim={claim[2]}-gpu-0"]
    prepared = checkpointed(kube)
    assert prepared[first[2]][0]["share"] == {"memory_bytes": 10 * GI, "thread_percent": 30}
    assert prepared[second[2]][0]["share"] == {"memory_bytes": 1024 << 20, "thread_percent": None}

    # the node ledger: the unit is the driver's, each share a holder; the device plugin may not take it
    await until(lambda: leases(kube.ledger).get("195:0") == (DRA_OWNER, tuple(sorted((first[2], second[2])))),
                "gpu-0 held by the DRA driver for both shares")
    with pytest.raises(grpc.RpcError) as refused:
        kube.allocate("pod", [kube.uuids["gpu-0"]])
    assert refused.value.details() == (
        f"Held by another front door of this node: {kube.uuids['gpu-0']} (195:0) is held by {DRA_OWNER} (running)"
        f" for {', '.join(sorted((first[2], second[2])))}; nothing was allocated")

    # a claim the cluster allocated whole (the DRAConsumableCapacity gate off) is refused, naming the gate
    whole = kube.claim(["gpu-1"])
    assert kube.prepare(whole)["error"] == (
        f"claim ns/{whole[1]} (uid {whole[2]}): device gpu-1 is shared through MPS (--sharing=mps) but its allocation"
        " has no shareID and consumedCapacity memory: the cluster allocated it whole. Enable the"
        " DRAConsumableCapacity feature gate on the API server and the scheduler, or run the driver with"
        " --sharing=none; nothing was prepared")

    # the unit stays held while a share lives, and goes back with the last
    assert kube.unprepare(first) == {}
    await until(lambda: leases(kube.ledger).get("195:0") == (DRA_OWNER, (second[2],)), "gpu-0 held for one share")
    assert kube.unprepare(second) == {}
    await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back in the node ledger")
