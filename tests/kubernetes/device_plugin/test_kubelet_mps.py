"""SPEC R-MP-4 and R-MP-8: ``kubelet-plugin --mps_replicas N`` offers each GPU as N MPS shares, each with
1/N of its memory and 100/N % of its threads; an Allocate of two shares of one GPU is refused naming them;
MPS and time-slicing of one resource exclude each other with one clear error. Through the catalog and the
real command with the fake kubelet of the official protos."""

from __future__ import annotations

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

from tests.kubernetes.device_plugin.test_kubelet_mig_and_sharing import DGX8, H200, run_plugin

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
def mps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    yield from run_plugin(tmp_path_factory.mktemp("mps"), DGX8, "--mps_replicas=2",
                          "--mps_control=/usr/bin/nvidia-cuda-mps-control")


def test_the_kubelet_lists_two_shares_per_gpu_and_a_container_gets_one_share_of_a_gpu(mps) -> None:
    _, kubelet, _, _ = mps
    kubelet.wait_registrations(1)
    _, devices = kubelet.wait_list("nvidia.com/gpu")
    assert [d[0] for d in devices] == [f"{uuid}::{i}" for uuid in GPU_UUIDS for i in range(2)]
    one = kubelet.allocate("nvidia.com/gpu", [f"{GPU_UUIDS[2]}::1"])
    assert [d.name for d in one.cdi_devices] == [f"nvidia.com/gpu={GPU_UUIDS[2]}"]
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
async def test_in_the_node_ledger_the_gpu_is_the_plugins_and_each_pods_share_a_holder(tmp_path: Path) -> None:
    """SPEC R-MP-6: shares of one GPU stay inside the device plugin; the GPU goes back with the last pod."""
    from actors.ledger import dra_plugin_owner
    from isolators.kubernetes.device_plugin import PLUGIN_OWNER

    from tests.support.kube_node import DRIVER, KubeNode
    from tests.support.kubelet import plugin_directory
    from tests.support.ledger import leases, until

    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"),
                        device_plugin_options=("--mps_replicas=2",))
        try:
            kube.start()
            gpu0 = kube.uuids["gpu-0"]
            kube.allocate("a", [f"{gpu0}::0"])
            kube.allocate("b", [f"{gpu0}::1"])
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/a/gpu", "ns/b/gpu")),
                        "gpu-0 held by the device plugin for both pods' shares")
            kube.wait_slice(lambda devices: "gpu-0" not in devices, "gpu-0 left out of the DRA driver's slice")
            claim = kube.claim(["gpu-0"])
            assert kube.prepare(claim)["error"].endswith(
                f"{gpu0} (195:0) is held by {PLUGIN_OWNER} (running) for ns/a/gpu, ns/b/gpu; nothing was prepared")
            kube.remove_pod("a")
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/b/gpu",)),
                        "gpu-0 held for the one share left")
            kube.remove_pod("b")
            await until(lambda: "195:0" not in leases(kube.ledger), "gpu-0 back once no pod holds a share")
            assert dra_plugin_owner(DRIVER) not in {owner for owner, _ in leases(kube.ledger).values()}
        finally:
            kube.close()
