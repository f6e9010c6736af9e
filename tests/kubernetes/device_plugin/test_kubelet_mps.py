"""SPEC R-MP-4 and R-MP-8: ``kubelet-plugin --mps_replicas N`` offers each GPU as N MPS shares, each with
1/N of its memory and 100/N % of its threads; an Allocate of two shares of one GPU is refused naming them;
MPS and time-slicing of one resource exclude each other with one clear error. Through the catalog and the
real command with the fake kubelet of the official protos."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import managed_units
from actors.flags import Flags
from actors.nvml import SimulatedNvml, load_host_file, read_inventory
from isolators.cli import main
from isolators.kubernetes import PluginSetupError
from isolators.kubernetes.device_plugin._catalog import DeviceCatalog, MpsShare, check_sharing

from actors.mps.testing import read_record

from tests.kubernetes.device_plugin.test_kubelet_mig_and_sharing import DGX8, H200, run_plugin
from tests.support.kube_node import end_mps_daemons
from isolators.kubernetes.device_plugin import PLUGIN_OWNER as PLUGIN_OWNER_NAME

GPU_UUIDS = [gpu.uuid for gpu in load_host_file(DGX8).gpus]
MIB = 1 << 20


def catalog(host: Path, mps_replicas: int, replicas: int = 1, **flags: object) -> DeviceCatalog:
    values = Flags(host_file=str(host), **flags)
    nvml = SimulatedNvml.from_file(str(host))
    nvml.init()
    inventory = read_inventory(nvml)
    return DeviceCatalog.build(managed_units(values, NvidiaGpuAllocator.resources(values), inventory), inventory,
                               replicas, mps_replicas)


def test_each_gpu_is_offered_as_n_shares_of_its_memory_and_threads() -> None:
    [offer] = catalog(DGX8, 4).offers
    assert [d.id for d in offer.devices[:5]] == [f"{GPU_UUIDS[0]}::{i}" for i in range(4)] + [f"{GPU_UUIDS[1]}::0"]
    assert [d.share for d in offer.devices[:4]] == [
        MpsShare(index=i, replicas=4, memory_bytes=8192 * MIB, thread_percent=25) for i in range(4)]
    odd = catalog(DGX8, 3).offers[0].devices[0].share
    assert (odd.memory_bytes, odd.thread_percent) == (10922 * MIB, 33)  # rounded down: the shares never sum past it
    assert all(d.share is None for d in catalog(DGX8, 1, 2).offers[0].devices)  # time-slicing: no limits


def test_mig_devices_are_shared_by_their_own_memory() -> None:
    offers = catalog(H200, 2, nvidia_mig_strategy="mixed").by_resource
    mig = offers["nvidia.com/mig-1g.18gb"].devices[0]
    assert mig.id.endswith("::0") and mig.share == MpsShare(index=0, replicas=2, memory_bytes=8448 * MIB,
                                                            thread_percent=50)


@pytest.mark.parametrize("time_slicing, mps, error", [
    (2, 2, "--mps_replicas 2 and --time_slicing_replicas 2 both share every GPU of nvidia.com/gpu; a resource is"
           " shared one way: keep --mps_replicas (each share limited to its memory and threads) or"
           " --time_slicing_replicas (no limits), not both"),
    (1, 0, "--mps_replicas must be a whole number >= 2 (1, the default, shares nothing), got 0"),
    (0, 1, "--time_slicing_replicas must be a whole number >= 1, got 0"),
])
def test_mps_with_time_slicing_or_too_few_replicas_is_one_clear_error(time_slicing: int, mps: int, error: str,
                                                                       capsys: pytest.CaptureFixture) -> None:
    assert check_sharing(time_slicing, mps) == error
    with pytest.raises(PluginSetupError, match="^" + error.replace("(", r"\(").replace(")", r"\)") + "$"):
        catalog(DGX8, mps, time_slicing)
    assert main(["kubelet-plugin", f"--time_slicing_replicas={time_slicing}", f"--mps_replicas={mps}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"gpu-isolator kubelet-plugin: error: {error}"


@pytest.fixture(scope="module")
def mps(tmp_path_factory: pytest.TempPathFactory, mps_control: Path) -> Iterator[tuple]:
    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")  # short: the daemon's socket path is bounded
    try:
        yield from run_plugin(tmp_path_factory.mktemp("mps"), DGX8, "--mps_replicas=2", f"--mps_control={mps_control}",
                              f"--runtime_dir={runtime_dir}")
    finally:
        end_mps_daemons(runtime_dir)  # the shares of this module's Allocates were never returned: no pod ended
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_preferred_allocation_spreads_shares_over_gpus_and_refuses_what_allocate_would(mps) -> None:
    _, kubelet, _, _ = mps
    kubelet.wait_registrations(1)
    shares = [f"{uuid}::{i}" for uuid in GPU_UUIDS for i in range(2)]
    two = kubelet.preferred("nvidia.com/gpu", shares, [], 2)
    assert len({i.split("::")[0] for i in two}) == 2  # two GPUs, one share each
    for must, size, details in [
        ([], 3, "allocation_size 3 for nvidia.com/gpu cannot be met with MPS shares: a container gets one share of"
                " a GPU (--mps_replicas) and the 4 available IDs are shares of 2 GPUs"),
        (shares[:2], 2, f"Must-include device IDs for nvidia.com/gpu name more than one MPS share of one GPU:"
                        f" '{shares[0]}', '{shares[1]}'; a container gets one share of a GPU (--mps_replicas)"),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.preferred("nvidia.com/gpu", shares[:4], must, size)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == details


def test_the_kubelet_lists_two_shares_per_gpu_and_a_container_gets_one_share_of_a_gpu(mps) -> None:
    _, kubelet, _, _ = mps
    kubelet.wait_registrations(1)
    _, devices = kubelet.wait_list("nvidia.com/gpu")
    assert [d[0] for d in devices] == [f"{uuid}::{i}" for uuid in GPU_UUIDS for i in range(2)]
    one = kubelet.allocate("nvidia.com/gpu", [f"{GPU_UUIDS[2]}::1"])
    # the unit, and its MPS edits (the daemon's pipes at /tmp/nvidia-mps, the unit's /dev/shm: R-MP-3)
    assert [d.name for d in one.cdi_devices] == [f"nvidia.com/gpu={GPU_UUIDS[2]}", f"nvidia.com/gpu-mps={GPU_UUIDS[2]}"]
    plugin, _, _, cdi = mps
    plugin.wait_log(f"Wrote the CDI spec of MPS shares {cdi}/gpu-isolator-mps.json (it was missing)")
    spec = json.loads((cdi / "gpu-isolator-mps.json").read_text())
    assert spec["kind"] == "nvidia.com/gpu-mps" and [d["name"] for d in spec["devices"]] == sorted(GPU_UUIDS)
    edits = next(d for d in spec["devices"] if d["name"] == GPU_UUIDS[2])["containerEdits"]
    assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert [m["containerPath"] for m in edits["mounts"]] == ["/tmp/nvidia-mps", "/dev/shm"]
    assert Path(edits["mounts"][0]["hostPath"], "nvidia-cuda-mps-control.pid").exists()  # its daemon runs
    two = kubelet.allocate("nvidia.com/gpu", [f"{GPU_UUIDS[0]}::0", f"{GPU_UUIDS[1]}::1"])  # shares of two GPUs
    assert dict(two.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{GPU_UUIDS[0]},{GPU_UUIDS[1]}"}
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate("nvidia.com/gpu", [f"{GPU_UUIDS[3]}::0", f"{GPU_UUIDS[4]}::0", f"{GPU_UUIDS[3]}::1"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        f"Device IDs for nvidia.com/gpu name more than one MPS share of one GPU: '{GPU_UUIDS[3]}::0',"
        f" '{GPU_UUIDS[3]}::1' (all of {GPU_UUIDS[3]}); a container gets one share of a GPU (--mps_replicas),"
        " nothing was allocated. Ask for fewer, or for shares of different GPUs")


@pytest.mark.asyncio
async def test_in_the_node_ledger_the_gpu_is_the_plugins_and_each_pods_share_a_holder(tmp_path: Path,
                                                                                      mps_control: Path) -> None:
    """SPEC R-MP-6 (and R-MP-1, R-MP-2 from the device plugin): shares of one GPU stay inside the device
    plugin, granted by the GPU's one daemon with 1/2 of its memory and 50 % of its threads; the GPU and its
    daemon go with the last pod."""
    from actors.ledger import dra_plugin_owner
    from isolators.kubernetes.device_plugin import PLUGIN_OWNER

    from tests.support.kube_node import DRIVER, KubeNode
    from tests.support.kubelet import plugin_directory
    from tests.support.ledger import leases, until

    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    record = tmp_path / "mps-record"
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), env={"FAKE_MPS_RECORD": str(record)},
                        device_plugin_options=("--mps_replicas=2", f"--mps_control={mps_control}",
                                               f"--runtime_dir={runtime_dir}"))
        try:
            kube.start()
            gpu0 = kube.uuids["gpu-0"]
            kube.allocate("a", [f"{gpu0}::0"])
            kube.allocate("b", [f"{gpu0}::1"])
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/a/gpu", "ns/b/gpu")),
                        "gpu-0 held by the device plugin for both pods' shares")

            def commands() -> list[str]:
                return [detail for unit, event, detail in read_record(record) if unit == gpu0 and event == "command"]

            assert [e for u, e, _ in read_record(record) if e == "start"] == ["start"]  # one daemon, two shares
            assert commands()[:3] == ["get_server_list", "set_default_device_pinned_mem_limit 0 16384M",
                                      "set_default_active_thread_percentage 50"]
            kube.wait_slice(lambda devices: "gpu-0" not in devices, "gpu-0 left out of the DRA driver's slice")
            claim = kube.claim(["gpu-0"])
            assert kube.prepare(claim)["error"].endswith(
                f"{gpu0} (195:0) is held by {PLUGIN_OWNER} (running) for ns/a/gpu, ns/b/gpu; nothing was prepared")
            kube.remove_pod("a")
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/b/gpu",)),
                        "gpu-0 held for the one share left")
            kube.remove_pod("b")
            await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back once no pod holds a share")
            await until(lambda: commands()[-1:] == ["quit"], "the daemon stopped with the last share")
            assert dra_plugin_owner(DRIVER) not in {owner for owner, _ in leases(kube.ledger).values()}
        finally:
            kube.close()
            end_mps_daemons(runtime_dir)
            shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_a_restarted_plugin_grants_the_shares_of_running_pods_again_through_the_same_daemon(
        tmp_path: Path, mps_control: Path) -> None:
    """SIGKILL of the device plugin: the daemon keeps serving the pod; the next start's pass finds the pod's
    share in PodResources and grants it again (the daemon taken over, not started twice); the pod gone, the
    daemon stops and the GPU goes back."""
    from isolators.kubernetes.device_plugin import PLUGIN_OWNER

    from tests.support.kube_node import KubeNode
    from tests.support.kubelet import plugin_directory
    from tests.support.ledger import leases, until

    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    record = tmp_path / "mps-record"
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), env={"FAKE_MPS_RECORD": str(record)},
                        device_plugin_options=("--mps_replicas=2", f"--mps_control={mps_control}",
                                               f"--runtime_dir={runtime_dir}"))
        try:
            kube.start(dra=False)
            gpu0 = kube.uuids["gpu-0"]
            kube.allocate("a", [f"{gpu0}::1"])
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/a/gpu",)), "gpu-0 held for a")
            pid = int(Path(runtime_dir, "mps", gpu0, "pipe", "nvidia-cuda-mps-control.pid").read_text().split()[0])
            kube.kill_device_plugin()
            os.kill(pid, 0)  # the daemon outlived its front door
            kube.restart_device_plugin()
            kube.device_plugin.wait_log(f"MPS share {gpu0}::1 of pod ns/a granted again")
            kube.device_plugin.wait_log(f"MPS control daemon of {gpu0} taken over (pid {pid},")
            assert [e for _, e, _ in read_record(record) if e == "start"] == ["start"]
            kube.remove_pod("a")
            await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back once the pod is gone")
            assert [d for u, e, d in read_record(record) if u == gpu0 and e == "command"][-1] == "quit"
        finally:
            kube.close()
            end_mps_daemons(runtime_dir)
            shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_a_daemon_whose_last_pod_went_while_the_plugin_was_down_is_stopped_when_it_comes_back(
        tmp_path: Path, mps_control: Path) -> None:
    """R-MP-1 across a SIGKILL (issue 49's fault run found it): the pod of the last share of gpu-0 goes while the
    device plugin is down; the plugin that comes back grants nothing there, and stops the daemon its earlier life
    left (``quit``) before the node ledger gets gpu-0 back; the daemon of gpu-1, whose pod still runs, stays."""
    from tests.support.kernel import process_state, wait_gone
    from tests.support.kube_node import KubeNode
    from tests.support.kubelet import plugin_directory
    from tests.support.ledger import leases, until

    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    record = tmp_path / "mps-record"
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), env={"FAKE_MPS_RECORD": str(record)},
                        device_plugin_options=("--mps_replicas=2", f"--mps_control={mps_control}",
                                               f"--runtime_dir={runtime_dir}"))
        try:
            kube.start(dra=False)
            gpu0, gpu1 = kube.uuids["gpu-0"], kube.uuids["gpu-1"]
            kube.allocate("a", [f"{gpu0}::0"])
            kube.allocate("b", [f"{gpu1}::1"])
            await until(lambda: {"195:0", "195:1"} <= set(leases(kube.ledger)), "gpu-0 and gpu-1 held")
            pids = {gpu: int(Path(runtime_dir, "mps", gpu, "pipe", "nvidia-cuda-mps-control.pid").read_text())
                    for gpu in (gpu0, gpu1)}
            kube.kill_device_plugin()
            kube.remove_pod("a")  # the kubelet does not wait for a device plugin
            kube.restart_device_plugin()
            assert wait_gone(pids[gpu0], 20.0), "the daemon of gpu-0, whose last pod went, still runs"
            await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back once its left daemon stopped")
            kube.device_plugin.wait_log(f"MPS control daemon of {gpu0} (pid {pids[gpu0]}) runs with no share")
            assert [d for u, e, d in read_record(record) if u == gpu0 and e == "command"][-1] == "quit"
            assert process_state(pids[gpu1]) not in (None, "Z")  # pod b's share: granted again through its daemon
            kube.device_plugin.wait_log(f"MPS share {gpu1}::1 of pod ns/b granted again")
            assert leases(kube.ledger)["195:1"] == (PLUGIN_OWNER_NAME, ("ns/b/gpu",))
        finally:
            kube.close()
            end_mps_daemons(runtime_dir)
            shutil.rmtree(runtime_dir, ignore_errors=True)
