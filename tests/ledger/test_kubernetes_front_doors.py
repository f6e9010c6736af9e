"""SPEC R-NL-4 on one simulated node: the device plugin, the DRA driver and ``serve``
running at once over one node ledger (the fake kubelet of the official protos,
its PodResources, the fake DRA kubelet and API server: ``tests.support.kube_node``).
Whichever front door grants a GPU first, the others refuse it (naming unit,
owner and holder) and stop offering it -- ``Unhealthy`` in ``ListAndWatch``,
left out of the ResourceSlice -- until it comes back."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.ledger import dra_plugin_owner, serve_owner
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.support.kube_node import DRIVER, KubeNode
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases, until
from tests.support.nodes import Node
from tests.support.services import ServeProcess, ask

DRA_OWNER = dra_plugin_owner(DRIVER)
ALL = [f"gpu-{minor}" for minor in range(8)]


@pytest.fixture
def shared_node(tmp_path: Path) -> Iterator[tuple[KubeNode, ServeProcess]]:
    ledger = str(tmp_path / "ledger")
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, ledger)
        node = Node(tmp_path / "serve-node", "memory", 8, host=str(DGX8))
        service = ServeProcess(node, tmp_path / "serve", node_ledger=ledger, listen="127.0.0.1:0")
        try:
            service.start()
            kube.start()
            yield kube, service
        finally:
            try:
                kube.close()
            finally:
                service.close()
                node.teardown()


@pytest.mark.asyncio
async def test_whichever_front_door_grants_first_the_others_refuse_and_stop_offering_it(shared_node) -> None:
    kube, service = shared_node
    uuid = kube.uuids
    serve = serve_owner(service.socket)
    assert kube.wait_listed(lambda listed: set(listed.values()) == {"Healthy"}, "all healthy") and len(
        kube.listed()) == 8
    kube.wait_slice(lambda devices: devices == ALL, "every GPU published")

    # serve grants first (as an agent asks it): GPU 0
    assert ask(service, "prepare", container_id="job", gpus=1)["error"] is None
    kube.wait_listed(lambda listed: listed[uuid["gpu-0"]] == "Unhealthy", "gpu-0 held by serve: Unhealthy")
    kube.wait_slice(lambda devices: devices == ALL[1:], "gpu-0 left out of the slice")
    with pytest.raises(grpc.RpcError) as refused:
        kube.allocate("late", [uuid["gpu-0"]])  # a kubelet that had not heard yet
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (f"Held by another front door of this node: {uuid['gpu-0']} (195:0) is held by"
                                       f" {serve} (running) for job; nothing was allocated")
    stale = kube.claim(["gpu-0"])  # a scheduler that had not heard yet
    assert kube.prepare(stale) == {"error": (
        f"claim ns/{stale[1]} (uid {stale[2]}): Held by another front door of this node: {uuid['gpu-0']} (195:0) is"
        f" held by {serve} (running) for job; nothing was prepared")}

    # the device plugin grants first: GPU 1 to pod p1
    kube.allocate("p1", [uuid["gpu-1"]])
    kube.wait_slice(lambda devices: devices == ALL[2:], "gpu-1 left out of the slice")
    await until(lambda: leases(kube.ledger).get("195:1") == (PLUGIN_OWNER, ("ns/p1/gpu",)),
                "PodResources' pod holds gpu-1")
    late = kube.claim(["gpu-1"])
    assert kube.prepare(late)["error"].endswith(
        f"{uuid['gpu-1']} (195:1) is held by {PLUGIN_OWNER} (running) for ns/p1/gpu; nothing was prepared")

    # the DRA driver grants first: GPU 2 to a claim (it stays in the driver's own slice: the scheduler knows)
    first = kube.claim(["gpu-2"])
    assert [d["device_name"] for d in kube.prepare(first)["devices"]] == ["gpu-2"]
    assert kube.slice_devices() == ALL[2:]
    kube.wait_listed(lambda listed: listed[uuid["gpu-2"]] == "Unhealthy", "gpu-2 held by the DRA driver: Unhealthy")
    with pytest.raises(grpc.RpcError) as refused:
        kube.allocate("p2", [uuid["gpu-2"]])
    assert refused.value.details() == (f"Held by another front door of this node: {uuid['gpu-2']} (195:2) is held by"
                                       f" {DRA_OWNER} (running) for {first[2]}; nothing was allocated")
    # serve, asked for more than is free, names both plugins' units; it takes none
    whole = ask(service, "prepare", container_id="all", gpus=6)["error"]
    assert whole.startswith("Requested 6 gpus but only 5 available (2 more held by other front doors of this node:")
    assert f"(195:1) is held by {PLUGIN_OWNER} (running) for ns/p1/gpu" in whole
    assert f"(195:2) is held by {DRA_OWNER} (running) for {first[2]}" in whole
    listed = kube.wait_listed(lambda listed: [listed[uuid[d]] for d in ALL[:3]] == ["Unhealthy", "Healthy",
                                                                                 "Unhealthy"], "0 and 2 withheld")
    assert [listed[uuid[device]] for device in ALL[3:]] == ["Healthy"] * 5
    assert kube.device_plugin.metrics()["ledger_conflicts_total"] == 2
    assert kube.dra_plugin.metrics()["ledger_conflicts_total"] == 2
    assert service.metrics()["ledger_conflicts_total"] == 1

    # each gives its GPU back; the others offer it again
    assert ask(service, "cleanup", container_id="job")["error"] is None
    kube.wait_listed(lambda listed: listed[uuid["gpu-0"]] == "Healthy", "gpu-0 back: Healthy")
    kube.wait_slice(lambda devices: devices == ["gpu-0", *ALL[2:]], "gpu-0 back in the slice (gpu-2 is the driver's own)")
    kube.remove_pod("p1")
    kube.wait_slice(lambda devices: devices == ALL, "gpu-1 back once no pod holds it")
    assert kube.unprepare(first) == {}
    kube.wait_listed(lambda listed: set(listed.values()) == {"Healthy"}, "gpu-2 back: all healthy")
    assert leases(kube.ledger) == {}
