"""SPEC R-MP-5, R-MP-6 (and the DRA side of R-MP-1..3) through the real ``gpu-isolator dra-plugin
--sharing=mps`` beside the real device plugin, over one node ledger (``tests.support.kube_node``), with the
stand-in ``nvidia-cuda-mps-control`` the tests build (``actors.mps.testing``; every command it receives is
recorded). The scheduler's part is played by the fake API server as Kubernetes allocates consumable capacity.

Claims asking ``capacity.requests`` share one GPU: the first starts the unit's daemon with its limits, exactly
its ``consumedCapacity``, set through the daemon; the next with the same limits joins it; one with other limits
is refused naming both (MPS holds one set of limits per unit, R-MP-2). The unit is the driver's in the node
ledger with each share a holder; no other front door takes it while a share lives; the last share stops the
daemon and returns the unit."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.ledger import dra_plugin_owner
from actors.mps.testing import read_record

from tests.support.kube_node import DRIVER, KubeNode, end_mps_daemons
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases, until

DRA_OWNER = dra_plugin_owner(DRIVER)
GI = 1 << 30


class Node(KubeNode):
    record: Path
    runtime_dir: str


@contextlib.contextmanager
def sharing_node(tmp_path: Path, control: Path, options: tuple[str, ...] = (),
                 prefixes: dict[str, list[str]] | None = None, **env: str) -> Iterator[Node]:
    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")  # short: the daemon's socket path is bounded
    record = tmp_path / "mps-record"
    with plugin_directory() as sockets:
        node = Node(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"),
                    env={"FAKE_MPS_RECORD": str(record), **env},
                    dra_plugin_options=("--sharing=mps", f"--mps_control={control}", f"--runtime_dir={runtime_dir}",
                                        *options), prefixes=prefixes)
        node.record, node.runtime_dir = record, runtime_dir
        try:
            node.start()
            yield node
        finally:
            node.close()
            end_mps_daemons(runtime_dir)  # they outlive the driver, as on a node
            shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.fixture
def kube(tmp_path: Path, mps_control: Path) -> Iterator[Node]:
    with sharing_node(tmp_path, mps_control) as node:
        yield node


def checkpointed(kube: KubeNode) -> dict[str, list[dict]]:
    path = Path(kube.node.work_dir) / "dra" / DRIVER / "prepared-claims.json"
    return {claim["ref"]["uid"]: claim["devices"] for claim in json.loads(path.read_text())["claims"]}


def daemon_commands(kube: Node, uuid: str) -> list[str]:
    return [detail for unit, event, detail in read_record(kube.record) if unit == uuid and event == "command"]


@pytest.mark.asyncio
async def test_claims_share_one_gpu_through_its_daemon_with_their_limits_held_by_the_driver(kube: Node) -> None:
    gpu0 = kube.uuids["gpu-0"]
    kube.wait_slice(lambda devices: len(devices) == 8, "the sharing slice published")
    [published] = kube.api.slices("node-a")
    assert all(d["allowMultipleAllocations"] for d in published["spec"]["devices"])
    assert not [r for r in kube.api.requests if "422" in r[4]]  # the API server took its request policies

    first = kube.share({"memory": "10Gi", "compute": "30"})
    second = kube.share({"memory": "10200Mi", "compute": "29.5"})  # rounded up by the scheduler: the same share
    results = [kube.api.claims[(c[0], c[1])]["status"]["allocation"]["devices"]["results"][0] for c in (first, second)]
    assert [(r["device"], r["consumedCapacity"]) for r in results] == [
        ("gpu-0", {"memory": "10Gi", "compute": "30"})] * 2
    answers = [kube.prepare(claim) for claim in (first, second)]
    for claim, answer, result in zip((first, second), answers, results):
        [device] = answer["devices"]
        assert (device["device_name"], device["share_id"]) == ("gpu-0", result["shareID"])
        assert device["cdi_device_ids"] == [f"{DRIVER}/claim={claim[2]}-gpu-0"]
    prepared = checkpointed(kube)
    assert [prepared[c[2]][0]["share"] for c in (first, second)] == [
        {"memory_bytes": 10 * GI, "thread_percent": 30}] * 2

    # one daemon for the unit, started by the first share, its limits set through it (R-MP-1, R-MP-2)
    assert [e for u, e, _ in read_record(kube.record) if e == "start"] == ["start"]
    assert daemon_commands(kube, gpu0)[:3] == ["get_server_list", "set_default_device_pinned_mem_limit 0 10240M",
                                               "set_default_active_thread_percentage 30"]
    # what the claim's containers get (R-MP-3): the daemon's pipes at /tmp/nvidia-mps, the unit's /dev/shm
    spec = json.loads((kube.cdi / f"{DRIVER}-claim_{first[2]}.json").read_text())
    [device] = spec["devices"]
    edits = device["containerEdits"]
    pipe = f"{kube.runtime_dir}/mps/{gpu0}/pipe"
    assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
        (pipe, "/tmp/nvidia-mps"), (f"{kube.runtime_dir}/mps/{gpu0}/shm", "/dev/shm")]
    assert Path(pipe, "nvidia-cuda-mps-control.pid").exists()

    # the node ledger: the unit is the driver's, each share a holder (in the order they came)
    await until(lambda: leases(kube.ledger).get("195:0") == (DRA_OWNER, (first[2], second[2])),
                "gpu-0 held by the DRA driver for both shares")
    # the slice follows the shares: gpu-0's policies narrow to its live limits, so the scheduler rounds a
    # smaller request up to them and the next share of gpu-0 is equal (MPS holds one set of limits per unit)
    def gpu0_policies(api: object) -> dict:
        [published] = kube.api.slices("node-a")
        capacity = next(d for d in published["spec"]["devices"] if d["name"] == "gpu-0")["capacity"]
        return {name: entry["requestPolicy"] for name, entry in capacity.items()}

    narrowed = {"memory": {"default": "10240Mi", "validValues": ["10240Mi"]},
                "compute": {"default": "30", "validValues": ["30"]}}
    kube.api.wait_for(lambda api: gpu0_policies(api) == narrowed, "gpu-0's policies narrowed to its live shares")
    third = kube.share({"memory": "1Gi"})
    assert kube.api.claims[(third[0], third[1])]["status"]["allocation"]["devices"]["results"][0][
        "consumedCapacity"] == {"memory": "10Gi", "compute": "30"}
    assert [d["device_name"] for d in kube.prepare(third)["devices"]] == ["gpu-0"]

    # a claim the scheduler allocated other limits on gpu-0 before the slice narrowed: refused naming both
    raced = ("ns", "raced", str(uuid.uuid4()))
    kube.api.add_claim("ns", "raced", [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
                                        "shareID": str(uuid.uuid4()),
                                        "consumedCapacity": {"memory": "1Gi", "compute": "0"}}], uid=raced[2])
    refusal = kube.prepare(raced)["error"]
    assert refusal.startswith(f"claim ns/raced (uid {raced[2]}): its MPS share cannot be granted: cannot share"
                              f" {gpu0} with ")
    assert "the shares of one unit are equal (R-MP-2)" in refusal and refusal.endswith(
        "nothing was prepared; the kubelet tries again, and it is prepared once the unit's other shares are"
        " unprepared (or delete its pod, for the scheduler to allocate the claim anew)")
    assert raced[2] not in checkpointed(kube)
    # one the scheduler should never have allocated (a fourth 10Gi share): the driver checks the sums itself
    crowded = ("ns", "crowded", str(uuid.uuid4()))
    kube.api.add_claim("ns", "crowded", [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
                                          "shareID": str(uuid.uuid4()),
                                          "consumedCapacity": {"memory": "10Gi", "compute": "30"}}], uid=crowded[2])
    assert kube.prepare(crowded)["error"] == (
        f"claim ns/crowded (uid {crowded[2]}): device gpu-0: this share's 10737418240 bytes of memory and the 3"
        " shares prepared there sum to 42949672960 bytes, past the device's 32768Mi; nothing was prepared")

    # the device plugin may not take it while a share lives
    await until(lambda: leases(kube.ledger).get("195:0") == (DRA_OWNER, (first[2], second[2], third[2])),
                "gpu-0 held by the DRA driver for its three shares, not the refused one")
    with pytest.raises(grpc.RpcError) as refused:
        kube.allocate("pod", [gpu0])
    assert refused.value.details() == (
        f"Held by another front door of this node: {gpu0} (195:0) is held by {DRA_OWNER} (running)"
        f" for {first[2]}, {second[2]}, {third[2]}; nothing was allocated")

    # a claim the cluster allocated whole (the DRAConsumableCapacity gate off) is refused, naming the gate
    whole = kube.claim(["gpu-1"])
    assert kube.prepare(whole)["error"] == (
        f"claim ns/{whole[1]} (uid {whole[2]}): device gpu-1 is shared through MPS (--sharing=mps) but its allocation"
        " has no shareID and consumedCapacity memory: the cluster allocated it whole. Enable the"
        " DRAConsumableCapacity feature gate on the API server and the scheduler, or run the driver with"
        " --sharing=none; nothing was prepared")

    # the unit and its daemon stay while a share lives, and go with the last
    assert kube.unprepare(first) == {} and kube.unprepare(third) == {}
    await until(lambda: leases(kube.ledger).get("195:0") == (DRA_OWNER, (second[2],)), "gpu-0 held for one share")
    assert "quit" not in daemon_commands(kube, gpu0)
    assert kube.unprepare(second) == {}
    await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back in the node ledger")
    assert daemon_commands(kube, gpu0)[-1] == "quit"
    assert kube.dra_plugin.metrics()["mps_shares"] == 0
    kube.api.wait_for(lambda api: "validRange" in gpu0_policies(api)["memory"], "gpu-0 offered for any share again")
    # the raced claim, tried again by the kubelet once gpu-0's other shares are gone, is prepared with its own
    assert [d["device_name"] for d in kube.prepare(raced)["devices"]] == ["gpu-0"]
    assert daemon_commands(kube, gpu0)[-2:] == ["set_default_device_pinned_mem_limit 0 1024M",
                                                "set_default_active_thread_percentage 100"]
    assert kube.unprepare(raced) == {}


def test_a_share_whose_daemon_cannot_start_is_refused_naming_its_exit_and_log(tmp_path: Path,
                                                                              mps_control: Path) -> None:
    """R-MP-1 through the driver: never a bare "error waiting for MPS daemon"; nothing stays held."""
    fail = "3:Failed to start: no CUDA-capable device is detected"
    with sharing_node(tmp_path, mps_control, FAKE_MPS_FAIL=fail) as kube:
        gpu0 = kube.uuids["gpu-0"]
        kube.wait_slice(lambda devices: len(devices) == 8, "the sharing slice published")
        claim = kube.share({"memory": "4Gi"})
        refusal = kube.prepare(claim)["error"]
        assert refusal.startswith(f"claim ns/{claim[1]} (uid {claim[2]}): its MPS share cannot be granted: the MPS"
                                  f" control daemon of {gpu0} did not start")
        assert "Failed to start: no CUDA-capable device is detected" in refusal
        assert refusal.endswith("; nothing was prepared")
        assert not (Path(kube.node.work_dir) / "dra" / DRIVER / "prepared-claims.json").exists() or \
            claim[2] not in checkpointed(kube)
        assert not list(kube.cdi.glob(f"{DRIVER}-claim_*"))


@pytest.mark.asyncio
async def test_a_restarted_driver_takes_its_running_daemon_over_and_keeps_the_share(tmp_path: Path,
                                                                                    mps_control: Path) -> None:
    """SIGKILL of the driver: the daemon keeps serving the claim's pods; the next start grants the prepared
    share again through the same daemon (taken over, not started twice), and unprepare still stops it."""
    with sharing_node(tmp_path, mps_control) as kube:
        gpu0 = kube.uuids["gpu-0"]
        kube.wait_slice(lambda devices: len(devices) == 8, "the sharing slice published")
        claim = kube.share({"memory": "8Gi", "compute": "50"})
        assert [d["device_name"] for d in kube.prepare(claim)["devices"]] == ["gpu-0"]
        pid_file = Path(kube.runtime_dir, "mps", gpu0, "pipe", "nvidia-cuda-mps-control.pid")
        pid = int(pid_file.read_text().split()[0])
        kube.kill_dra_plugin()
        os.kill(pid, 0)  # the daemon outlived its front door
        kube.restart_dra_plugin()
        kube.dra_plugin.wait_log(f"MPS control daemon of {gpu0} taken over (pid {pid},")
        assert [e for _, e, _ in read_record(kube.record) if e == "start"] == ["start"]
        assert [d["device_name"] for d in kube.prepare(claim)["devices"]] == ["gpu-0"]  # from the checkpoint
        await until(lambda: leases(kube.ledger).get("195:0") == (DRA_OWNER, (claim[2],)), "gpu-0 held again")
        assert kube.unprepare(claim) == {}
        await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back once the share is gone")
        assert daemon_commands(kube, gpu0)[-1] == "quit"


@pytest.mark.asyncio
async def test_a_restarted_driver_stops_a_daemon_left_with_no_share_and_leaves_another_front_doors_alone(
        tmp_path: Path, mps_control: Path) -> None:
    """R-MP-1, R-MP-6 across a SIGKILL (issue 49's fault run): both front doors share one runtime directory, as
    on a node. A daemon of gpu-5 left running with no share (a claim whose prepare was never answered) is
    stopped by the driver that comes back, gpu-5 held in the node ledger while it stops and let go after; the
    daemon of gpu-0, whose share the device plugin's pod holds, is the device plugin's and is left alone."""
    from isolators.kubernetes.device_plugin import PLUGIN_OWNER

    from tests.support.kernel import process_state, wait_gone

    control = mps_control
    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    record = tmp_path / "mps-record"
    common = (f"--mps_control={control}", f"--runtime_dir={runtime_dir}")
    with plugin_directory() as sockets:
        kube = Node(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), env={"FAKE_MPS_RECORD": str(record)},
                    device_plugin_options=("--mps_replicas=2", *common), dra_plugin_options=("--sharing=mps", *common))
        kube.record, kube.runtime_dir = record, runtime_dir
        try:
            kube.start()
            gpu0, gpu5 = kube.uuids["gpu-0"], kube.uuids["gpu-5"]
            kube.allocate("a", [f"{gpu0}::0"])
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/a/gpu",)), "gpu-0 held")
            kube.kill_dra_plugin()
            left = Path(runtime_dir, "mps", gpu5)
            for name in ("pipe", "log"):
                (left / name).mkdir(parents=True)
            env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(left / "pipe"), "CUDA_MPS_LOG_DIRECTORY":
                   str(left / "log"), "CUDA_VISIBLE_DEVICES": gpu5, "FAKE_MPS_RECORD": str(record)}
            subprocess.run([str(control), "-d"], env=env, check=True, timeout=10, stdin=subprocess.DEVNULL)
            pids = {gpu: int(Path(runtime_dir, "mps", gpu, "pipe", "nvidia-cuda-mps-control.pid").read_text())
                    for gpu in (gpu0, gpu5)}
            kube.restart_dra_plugin()
            assert wait_gone(pids[gpu5], 20.0), "the daemon of gpu-5, left with no share, still runs"
            kube.dra_plugin.wait_log(f"MPS control daemon of {gpu5} (pid {pids[gpu5]}) runs with no share")
            kube.dra_plugin.wait_log(f"MPS control daemons left running with no share stopped: {gpu5}")
            assert daemon_commands(kube, gpu5)[-1] == "quit"
            assert process_state(pids[gpu0]) not in (None, "Z")  # the device plugin's: left alone
            assert "quit" not in daemon_commands(kube, gpu0)
            assert f"MPS control daemon of {gpu0} runs with no share of this front door, and the unit is not its to" \
                   " stop" in kube.dra_plugin.log()
            assert leases(kube.ledger) == {"195:0": (PLUGIN_OWNER, ("ns/a/gpu",))}  # gpu-5 let go once stopped
        finally:
            kube.close()
            end_mps_daemons(runtime_dir)
            shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_with_mps_replicas_claims_allocated_at_once_share_a_gpu_in_equal_shares(tmp_path: Path,
                                                                                    mps_control: Path) -> None:
    """``--mps_replicas 4``: five claims asking different sizes are allocated before any is prepared (what
    collides without it); each gets a quarter of a GPU, four on gpu-0 and the fifth on gpu-1, and every one is
    prepared, gpu-0's daemon limiting each to 8Gi and 25 %."""
    with sharing_node(tmp_path, mps_control, ("--mps_replicas=4",)) as kube:
        gpu0 = kube.uuids["gpu-0"]
        kube.wait_slice(lambda devices: len(devices) == 8, "the sharing slice published")
        claims = [kube.share(requests) for requests in ({"memory": "5Gi"}, {"memory": "1Gi", "compute": "10"}, None,
                                                         {"memory": "8Gi"}, {"memory": "2Gi"})]
        results = [kube.api.claims[(c[0], c[1])]["status"]["allocation"]["devices"]["results"][0] for c in claims]
        assert [(r["device"], r["consumedCapacity"]) for r in results] == [
            ("gpu-0", {"memory": "8Gi", "compute": "25"})] * 4 + [("gpu-1", {"memory": "8Gi", "compute": "25"})]
        assert [[d["device_name"] for d in kube.prepare(claim)["devices"]] for claim in claims] == [
            ["gpu-0"]] * 4 + [["gpu-1"]]
        assert daemon_commands(kube, gpu0)[:3] == ["get_server_list", "set_default_device_pinned_mem_limit 0 8192M",
                                                   "set_default_active_thread_percentage 25"]
        four = {c[2] for c in claims[:4]}
        await until(lambda: (lambda lease: lease is not None and lease[0] == DRA_OWNER and set(lease[1]) == four)(
            leases(kube.ledger).get("195:0")), "gpu-0 held by the driver for its four shares")
        for claim in claims:
            assert kube.unprepare(claim) == {}
        await until(lambda: not {"195:0", "195:1"} & set(leases(kube.ledger)), "both GPUs back")


def test_mps_replicas_without_sharing_or_below_one_is_one_usage_error(capsys: pytest.CaptureFixture) -> None:
    from isolators.cli import main

    for args, error in [
        (["--mps_replicas=2"], "--mps_replicas 2 needs --sharing=mps (it cuts every GPU into MPS shares)"),
        (["--sharing=mps", "--mps_replicas=0"], "--mps_replicas must be a whole number >= 2 (1, the default, lets"
                                                 " each claim ask its own size), got 0"),
    ]:
        assert main(["dra-plugin", "--node_name=n", *args]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"gpu-isolator dra-plugin: error: {error}"
