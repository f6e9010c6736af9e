"""Issue 37 through the real ``gpu-isolator dra-plugin`` command, a fake kubelet
(``tests.support.dra_kubelet``) and a fake API server (``tests.support.kube_api``)
reached by the real client through a kubeconfig.

One driver process serves the module (the 8-GPU node of two NVLink islands,
``tests/inventory/data/dgx8-nvlink.toml``, node ``node-a``, ``--listen``);
the API server holds a stale slice of this node and driver, and one of
another node, before it starts. Each test prepares claims of its own uids;
the last ones restart the driver and take the API server down.
"""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from actors.nvml import load_host_file

from tests.support.dra_kubelet import DraPluginCommand, FakeDraKubelet
from tests.support.kube_api import FakeApiServer, allocation_result
from tests.support.kubelet import DGX8, flag_args, plugin_directory, plugin_node

UUIDS = [gpu.uuid for gpu in load_host_file(DGX8).gpus]
DRIVER = "gpu.isolator.dev"
NODE = "node-a"
SLICE = f"{NODE}-{DRIVER}"


class Deployment:
    def __init__(self, base: Path, sockets: Path, node: Any, cdi: Path, api: FakeApiServer, args: list[str]) -> None:
        self.base, self.sockets, self.node, self.cdi, self.api, self.args = base, sockets, node, cdi, api, args
        self.plugin = DraPluginCommand(args, base)
        self.kubelet = FakeDraKubelet(sockets / "registry")
        self.registered = False

    def ready(self) -> FakeDraKubelet:
        if not self.registered:
            self.kubelet.register()
            self.registered = True
        return self.kubelet

    @property
    def checkpoint(self) -> Path:
        return Path(self.node.work_dir) / "dra" / DRIVER / "prepared-claims.json"

    def prepared_uids(self) -> list[str]:
        if not self.checkpoint.exists():
            return []
        return [claim["ref"]["uid"] for claim in json.loads(self.checkpoint.read_text())["claims"]]

    def specs(self) -> list[str]:
        return sorted(name for name in os.listdir(self.cdi) if name.startswith(f"{DRIVER}-claim_"))


@pytest.fixture(scope="module")
def dra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("dra-plugin")
    node, cdi = plugin_node(base)
    api = FakeApiServer().start()
    stale = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-old"},
             "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 4,
                                                                   "resourceSliceCount": 1}, "devices": []}}
    other = json.loads(json.dumps(stale).replace(NODE, "node-b"))
    for document in (stale, other):
        api.handle("POST", "/apis/resource.k8s.io/v1/resourceslices", {}, document)
    with plugin_directory() as sockets:
        args = flag_args(node.flag_values(cdi_spec_dir=str(cdi))) + [
            f"--plugins_registry_dir={sockets}/registry", f"--plugins_dir={sockets}/plugins", f"--node_name={NODE}",
            f"--kubeconfig={api.kubeconfig(base / 'kubeconfig')}", "--listen=127.0.0.1:0", "--api_timeout=1",
            "--poll_interval=0.2"]
        deployment = Deployment(base, sockets, node, cdi, api, args)
        try:
            deployment.plugin.start()
            yield deployment
        finally:
            deployment.kubelet.close()
            deployment.plugin.close()
            api.close()


def new_claim(dra: Deployment, devices: list[str], *, name: str | None = None, pool: str = NODE,
              **shared: Any) -> tuple[str, str, str]:
    uid = str(uuid.uuid4())
    name = name or f"claim-{uid[:8]}"
    dra.api.add_claim("team", name, [allocation_result("gpus", DRIVER, pool, device, **shared) for device in devices],
                      uid=uid)
    return ("team", name, uid)


def test_it_registers_with_the_plugin_watcher_serving_both_dra_versions(dra: Deployment) -> None:
    info = dra.ready().register()  # a second registration (a kubelet restart) is answered alike
    endpoint = f"{dra.sockets}/plugins/{DRIVER}/dra.sock"
    assert info == {"type": "DRAPlugin", "name": DRIVER, "endpoint": endpoint,
                    "supported_versions": ["v1.DRAPlugin", "v1beta1.DRAPlugin"]}
    assert (dra.sockets / "registry" / f"{DRIVER}-reg.sock").exists()
    assert [m[2] for m in dra.kubelet.messages[:6]] == ["GetInfo", "GetInfo", "NotifyRegistrationStatus"] * 2
    assert dra.kubelet.messages[2][3] == {"plugin_registered": True}
    dra.plugin.wait_log(f"The kubelet registered driver {DRIVER}", count=2)
    assert dra.plugin.metrics()["dra_registrations_total"] == 2
    dra.kubelet.register(refuse="plugin gpu.isolator.dev already registered by another process")
    dra.plugin.wait_log(f"The kubelet refused to register driver {DRIVER}: plugin gpu.isolator.dev already"
                        " registered by another process")
    assert dra.plugin.metrics()["dra_registrations_total"] == 2  # a refusal is logged, not counted


def test_a_registration_socket_that_disappears_is_served_again(dra: Deployment) -> None:
    kubelet = dra.ready()
    socket = dra.sockets / "registry" / f"{DRIVER}-reg.sock"
    socket.unlink()  # what a kubelet restart does to its plugins_registry
    dra.plugin.wait_log(f"registration of {DRIVER}: the socket {socket} vanished or was replaced: serving it again")
    dra.plugin.wait_log(f"registration of {DRIVER}: serving on {socket}", count=2)
    assert kubelet.register()["name"] == DRIVER  # the plugin watcher finds it anew
    dra.plugin.wait_log(f"The kubelet registered driver {DRIVER}", count=3)


def test_it_publishes_one_pool_of_this_node_and_deletes_the_stale_slice(dra: Deployment) -> None:
    dra.api.wait_for(lambda api: [s for s in api.slices(NODE) if s["metadata"]["name"] == SLICE]
                     and len(api.slices(NODE)) == 1, "the stale slice replaced by the driver's")
    [published] = dra.api.slices(NODE)
    spec = published["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRIVER, NODE)
    assert spec["pool"] == {"name": NODE, "generation": 5, "resourceSliceCount": 1}  # above the stale one's 4
    assert [d["name"] for d in spec["devices"]] == [f"gpu-{i}" for i in range(8)]
    gpu5 = spec["devices"][5]
    assert gpu5["attributes"] == {
        "type": {"string": "gpu"}, "uuid": {"string": UUIDS[5]}, "productName": {"string": "Tesla V100-SXM2-32GB"},
        "pciBusID": {"string": "0000:86:00.0"}, "minor": {"int": 5},
        "nvlinkIsland": {"int": 1}, "driverVersion": {"version": "535.161.8"}, "numaNode": {"int": 1},
        "architecture": {"string": "Volta"}, "cudaComputeCapability": {"version": "7.0.0"},
    }
    assert gpu5["capacity"] == {"memory": {"value": "32768Mi"}}
    assert [d["attributes"]["nvlinkIsland"]["int"] for d in spec["devices"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not any("taints" in d for d in spec["devices"])
    assert [s["metadata"]["name"] for s in dra.api.slices("node-b")] == ["node-b-old"]  # another node's: kept


def test_a_two_gpu_claim_is_prepared_with_a_cdi_spec_named_by_its_uid(dra: Deployment) -> None:
    kubelet = dra.ready()
    ref = new_claim(dra, ["gpu-0", "gpu-1"])
    uid = ref[2]
    answer = kubelet.prepare([ref])
    ids = [f"{DRIVER}/claim={uid}-gpu-0", f"{DRIVER}/claim={uid}-gpu-1"]
    assert answer == {uid: {"devices": [
        {"request_names": ["gpus"], "pool_name": NODE, "device_name": "gpu-0", "cdi_device_ids": ids[:1]},
        {"request_names": ["gpus"], "pool_name": NODE, "device_name": "gpu-1", "cdi_device_ids": ids[1:]}]}}
    spec = json.loads((dra.cdi / f"{DRIVER}-claim_{uid}.json").read_text())
    assert spec["kind"] == f"{DRIVER}/claim" and spec["cdiVersion"] == "0.5.0"
    assert [(d["name"], [n["path"] for n in d["containerEdits"]["deviceNodes"]]) for d in spec["devices"]] == [
        (f"{uid}-gpu-0", ["/dev/nvidia0"]), (f"{uid}-gpu-1", ["/dev/nvidia1"])]
    shared = spec["containerEdits"]
    assert f"NVIDIA_VISIBLE_DEVICES={UUIDS[0]},{UUIDS[1]}" in shared["env"]
    assert {n["path"] for n in shared["deviceNodes"]} >= {"/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert [m["containerPath"] for m in shared["mounts"]] == ["/usr/local/nvidia"]  # the driver volume
    assert uid in dra.prepared_uids()
    # Idempotent, in both wire versions, and without asking the API server again.
    asked = len(dra.api.requests)
    assert kubelet.prepare([ref], "v1beta1.DRAPlugin") == answer
    assert kubelet.prepare([ref]) == answer
    assert len(dra.api.requests) == asked


@pytest.mark.parametrize("case", ["unknown", "uid", "unallocated", "other-node", "unknown-device", "other-driver"])
def test_a_claim_that_cannot_be_prepared_is_refused_by_itself_naming_why(dra: Deployment, case: str) -> None:
    kubelet = dra.ready()
    good = new_claim(dra, ["gpu-7"])
    uid = str(uuid.uuid4())
    name = f"bad-{case}"
    if case == "uid":
        dra.api.add_claim("team", name, [allocation_result("gpus", DRIVER, NODE, "gpu-6")], uid="0-recreated")
    elif case == "unallocated":
        dra.api.add_claim("team", name, None, uid=uid)
    elif case == "other-node":
        dra.api.add_claim("team", name, [allocation_result("gpus", DRIVER, "node-b", "gpu-6")], uid=uid)
    elif case == "unknown-device":
        dra.api.add_claim("team", name, [allocation_result("gpus", DRIVER, NODE, "gpu-9")], uid=uid)
    elif case == "other-driver":
        dra.api.add_claim("team", name, [allocation_result("nic", "nic.example.com", NODE, "eth0")], uid=uid)
    before = dra.specs()
    answer = kubelet.prepare([("team", name, uid), good])
    claim = f"claim team/{name} (uid {uid}): "
    why = {
        "unknown": f'cannot be read: the API server answered 404 NotFound: resourceclaims.resource.k8s.io "{name}"'
                   " not found",
        "uid": f"the API server holds uid 0-recreated for team/{name}, not the kubelet's {uid} (the claim was"
               " deleted and created again)",
        "unallocated": "it is not allocated (no status.allocation): the scheduler has not given it devices",
        "other-node": f"it is allocated gpu-6 of pool node-b, another node's pool (this is node {NODE}, pool {NODE})",
        "unknown-device": f"device gpu-9 is not one driver {DRIVER} publishes on node {NODE} (gpu-0, gpu-1, gpu-2,"
                          " ...)",
        "other-driver": f"none of its devices is driver {DRIVER}'s (allocated from: nic.example.com)",
    }[case]
    assert answer[uid] == {"error": f"{claim}{why}; nothing was prepared"}
    assert answer[good[2]]["devices"][0]["device_name"] == "gpu-7"  # the other claim of the call is prepared
    assert dra.specs() == sorted(before + [f"{DRIVER}-claim_{good[2]}.json"])
    assert uid not in dra.prepared_uids()
    assert kubelet.unprepare([good]) == {good[2]: {}}


@pytest.mark.parametrize(("namespace", "name", "why"), [
    ("../kube-system", "x", "namespace '../kube-system' is not a Kubernetes namespace (a DNS label)"),
    ("team", "x/../../secrets/token", "name 'x/../../secrets/token' is not a Kubernetes object name (a DNS"
                                      " subdomain)"),
])
def test_a_reference_that_is_no_kubernetes_name_is_refused_before_any_request(
        dra: Deployment, namespace: str, name: str, why: str) -> None:
    kubelet = dra.ready()
    uid = str(uuid.uuid4())
    asked = len(dra.api.requests)
    answer = kubelet.prepare([(namespace, name, uid)])
    assert answer == {uid: {"error": f"claim uid {uid}: {why}; nothing was prepared"}}
    assert len(dra.api.requests) == asked  # no path was built from it


def test_a_device_prepared_for_one_claim_is_refused_for_another_unless_shared(dra: Deployment) -> None:
    kubelet = dra.ready()
    first = new_claim(dra, ["gpu-4"])
    second = new_claim(dra, ["gpu-4", "gpu-5"])
    watcher = new_claim(dra, ["gpu-4"], admin_access=True)
    assert "devices" in kubelet.prepare([first])[first[2]]
    before = (dra.specs(), dra.checkpoint.read_bytes())
    refused = kubelet.prepare([second])
    assert refused == {second[2]: {"error": f"claim team/{second[1]} (uid {second[2]}): device gpu-4 (prepared for"
                                            f" claim team/{first[1]}, uid {first[2]}) is not shared (no adminAccess"
                                            " or shareID), so it cannot be prepared twice; nothing was prepared"}}
    assert (dra.specs(), dra.checkpoint.read_bytes()) == before  # nothing prepared, nothing lost
    assert kubelet.prepare([watcher])[watcher[2]]["devices"][0]["cdi_device_ids"] == [
        f"{DRIVER}/claim={watcher[2]}-gpu-4"]  # admin access shares
    one, two = new_claim(dra, ["gpu-5"], share_id="a1"), new_claim(dra, ["gpu-5"], share_id="b2")
    answers = kubelet.prepare([one, two])
    assert [answers[ref[2]]["devices"][0].get("share_id") for ref in (one, two)] == ["a1", "b2"]
    # Two claims of one call, or of two concurrent calls, never both take one exclusive device.
    x, y = new_claim(dra, ["gpu-6"]), new_claim(dra, ["gpu-6"])
    answers = kubelet.prepare([x, y])
    assert "devices" in answers[x[2]] and "is not shared" in answers[y[2]]["error"]
    assert kubelet.unprepare([first, watcher, one, two, x, y]) == {ref[2]: {} for ref in (first, watcher, one, two,
                                                                                            x, y)}
    assert "devices" in kubelet.prepare([second])[second[2]]  # free again
    kubelet.unprepare([second])


def test_concurrent_prepares_all_reach_the_checkpoint_and_never_share_an_exclusive_device(dra: Deployment) -> None:
    kubelet = dra.ready()
    shared = [new_claim(dra, [f"gpu-{4 + i % 3}"], share_id=f"s{i}") for i in range(12)]
    rivals = [new_claim(dra, ["gpu-7"]) for _ in range(4)]
    with ThreadPoolExecutor(len(shared) + len(rivals)) as pool:
        answers = list(pool.map(lambda ref: kubelet.prepare([ref])[ref[2]], shared + rivals))
    assert all("devices" in answer for answer in answers[:len(shared)])
    assert sorted("devices" in answer for answer in answers[len(shared):]) == [False, False, False, True]
    winner = next(ref for ref, answer in zip(rivals, answers[len(shared):]) if "devices" in answer)
    assert set(dra.prepared_uids()) >= {ref[2] for ref in shared + [winner]}  # every answered claim checkpointed
    assert not set(dra.prepared_uids()) & {ref[2] for ref in rivals if ref != winner}
    kubelet.unprepare(shared + rivals)
    assert not set(dra.prepared_uids()) & {ref[2] for ref in shared + rivals}


def test_unprepare_removes_what_the_claim_prepared_and_is_idempotent(dra: Deployment) -> None:
    kubelet = dra.ready()
    ref = new_claim(dra, ["gpu-2", "gpu-3"])
    kubelet.prepare([ref])
    assert f"{DRIVER}-claim_{ref[2]}.json" in dra.specs()
    dra.api.remove_claim("team", ref[1])  # a deleted claim is still unprepared: the checkpoint knows it
    assert kubelet.unprepare([ref]) == {ref[2]: {}}
    assert f"{DRIVER}-claim_{ref[2]}.json" not in dra.specs() and ref[2] not in dra.prepared_uids()
    assert kubelet.unprepare([ref]) == {ref[2]: {}}  # again: nothing to do
    assert kubelet.unprepare([("team", "never", str(uuid.uuid4()))]) != {}  # never prepared: done as well
    bad = kubelet.unprepare([("team", "x", "../../etc")])
    assert bad == {"../../etc": {"error": "claim team/x: uid '../../etc' is not a Kubernetes UID; nothing was"
                                          " unprepared"}}
    metrics = dra.plugin.metrics()
    assert min(metrics["dra_prepares_total"], metrics["dra_unprepares_total"],
               metrics["dra_prepare_failures_total"]) >= 1


def test_a_spec_that_cannot_be_written_fails_its_claim_and_prepares_nothing(dra: Deployment) -> None:
    kubelet = dra.ready()
    ref = new_claim(dra, ["gpu-5"])
    before = dra.checkpoint.read_bytes()
    aside = dra.cdi.with_name("cdi-aside")
    dra.cdi.rename(aside)  # the CDI dir is gone a moment
    try:
        answer = kubelet.prepare([ref])
    finally:
        aside.rename(dra.cdi)
    assert answer == {ref[2]: {"error": f"claim team/{ref[1]} (uid {ref[2]}): Failed to write CDI spec"
                                        f" '{dra.cdi}/{DRIVER}-claim_{ref[2]}.json': the CDI spec directory"
                                        f" '{dra.cdi}' does not exist (create it first; container engines read"
                                        " /etc/cdi and /var/run/cdi); nothing was prepared"}}
    assert dra.checkpoint.read_bytes() == before and ref[2] not in "".join(dra.specs())
    assert "devices" in kubelet.prepare([ref])[ref[2]]  # its device was not kept: prepared once the dir is back
    kubelet.unprepare([ref])


def test_a_slow_api_server_fails_that_claim_and_nothing_else(dra: Deployment) -> None:
    kubelet = dra.ready()
    ref = new_claim(dra, ["gpu-2"])
    dra.api.delay_s = 1.5  # over --api_timeout=1
    try:
        answer = kubelet.prepare([ref])
        # The server answers late, to a client gone; wait for that, so it touches no later test's request.
        dra.api.wait_for(lambda api: any(r[2].endswith(f"/resourceclaims/{ref[1]}") for r in api.requests),
                         "the slow answer")
    finally:
        dra.api.delay_s = 0.0
    assert answer == {ref[2]: {"error": f"claim team/{ref[1]} (uid {ref[2]}): cannot be read: the API server"
                                        f" ({dra.api.address}) could not be reached: ReadTimeout: timed out;"
                                        " nothing was prepared"}}
    assert "devices" in kubelet.prepare([ref])[ref[2]]  # answered once the server is quick again
    kubelet.unprepare([ref])


def test_a_restarted_driver_republishes_at_once_and_keeps_its_claims_even_with_the_api_server_down(
        dra: Deployment) -> None:
    kubelet = dra.ready()
    kept = new_claim(dra, ["gpu-3"], name="kept")
    prepared = kubelet.prepare([kept])[kept[2]]
    assert "devices" in prepared, prepared
    generation = dra.api.slices(NODE)[0]["spec"]["pool"]["generation"]
    assert dra.plugin.stop() == 0
    assert not (dra.sockets / "registry" / f"{DRIVER}-reg.sock").exists()  # its own sockets removed
    (dra.cdi / f"{DRIVER}-claim_{kept[2]}.json").unlink()  # lost meanwhile: restored at start
    (dra.cdi / f"{DRIVER}-claim_orphan.json").write_text("{}")  # a crash's leftover: removed at start
    dra.api.fail(1, 503)  # its first request: the API server is unavailable a moment
    dra.plugin = DraPluginCommand(dra.args, dra.base)
    dra.plugin.start()
    dra.api.wait_for(lambda api: api.slices(NODE)[0]["spec"]["pool"]["generation"] == generation + 1,
                     "the restarted driver's republish")
    assert (f"Cannot publish ResourceSlice {SLICE}: the API server answered 503 ServiceUnavailable: the fake API"
            " server was told to fail; trying again in 1s") in dra.plugin.log()
    assert f"{DRIVER}-claim_{kept[2]}.json" in dra.specs() and f"{DRIVER}-claim_orphan.json" not in dra.specs()
    kubelet.register()
    dra.api.close()  # the API server is down from here
    dra.api.remove_claim("team", "kept")
    assert kubelet.prepare([kept]) == {kept[2]: prepared}  # from the checkpoint
    fresh = ("team", "fresh", str(uuid.uuid4()))
    error = kubelet.prepare([fresh])[fresh[2]]["error"]
    assert error.startswith(f"claim team/fresh (uid {fresh[2]}): cannot be read: the API server (")
    assert " could not be reached: " in error and error.endswith("; nothing was prepared")
    two_gpus = [uid for uid in dra.prepared_uids() if uid != kept[2]]  # the 2-GPU claim of the test above
    assert kubelet.unprepare([kept] + [("team", "x", uid) for uid in two_gpus]) == {
        uid: {} for uid in [kept[2]] + two_gpus}
    assert dra.specs() == [] and dra.prepared_uids() == []
