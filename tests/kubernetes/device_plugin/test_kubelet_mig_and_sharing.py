"""R-K8-6 (MIG ``mixed``: one socket and registration per profile; ``single``:
``nvidia.com/gpu`` lists MIG devices) and
R-K8-7 (time-slicing replicas ``<UUID>::<i>``) through the real command
and the fake kubelet.

The MIG node is ``tests/inventory/data/h200-mig.toml``: GPU 0 in MIG mode
(two 1g.18gb, one 2g.35gb, one 3g.71gb), GPU 1 whole, GPU 2 with two
1c.3g.71gb compute instances, GPU 3 in MIG mode without MIG devices; its
capability facts are written under the node's proc dir. The sharing node
is the 8-GPU node of two NVLink islands.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.nvml import load_host_file
from isolators.simulated_node import SimulatedNode

from tests.support.kubelet import FakeKubelet, PluginCommand, flag_args, plugin_directory

DATA = Path(__file__).resolve().parents[2] / "inventory" / "data"
H200 = DATA / "h200-mig.toml"
DGX8 = DATA / "dgx8-nvlink.toml"
HOST = load_host_file(H200)
MIG = {(gpu.index, m.gi, m.ci): m.uuid for gpu in HOST.gpus for m in gpu.mig_devices}
GPU_UUIDS = [gpu.uuid for gpu in load_host_file(DGX8).gpus]


def run_plugin(base: Path, host: Path, *options: str) -> Iterator[tuple[PluginCommand, FakeKubelet, SimulatedNode, Path]]:
    node = SimulatedNode(base / "node", host=host).create_files()
    cdi = base / "cdi"
    cdi.mkdir()
    with plugin_directory() as directory:
        kubelet = FakeKubelet(directory).start()
        plugin = PluginCommand(flag_args(node.flag_values(cdi_spec_dir=str(cdi)))
                               + [f"--device_plugin_dir={directory}", *options], base)
        try:
            plugin.start()
            yield plugin, kubelet, node, cdi
        finally:
            kubelet.close()
            plugin.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PluginCommand, FakeKubelet, SimulatedNode, Path]]:
    yield from run_plugin(tmp_path_factory.mktemp("mig-mixed"), H200, "--nvidia_mig_strategy=mixed",
                          "--pass_device_specs")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PluginCommand, FakeKubelet, SimulatedNode, Path]]:
    # GPU 0 alone (its 4 MIG devices): under 'single' every GPU considered must be in MIG mode.
    yield from run_plugin(tmp_path_factory.mktemp("mig-single"), H200, "--nvidia_mig_strategy=single",
                          "--nvidia_gpu_devices=0", "--resources=gpus:4")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PluginCommand, FakeKubelet, SimulatedNode, Path]]:
    yield from run_plugin(tmp_path_factory.mktemp("time-slicing"), DGX8, "--time_slicing_replicas=2")


RESOURCES = {
    "nvidia.com/gpu": [HOST.gpus[1].uuid],
    "nvidia.com/mig-1c.3g.71gb": [MIG[(2, 1, 0)], MIG[(2, 1, 1)]],
    "nvidia.com/mig-1g.18gb": [MIG[(0, 3, 0)], MIG[(0, 4, 0)]],
    "nvidia.com/mig-2g.35gb": [MIG[(0, 2, 0)]],
    "nvidia.com/mig-3g.71gb": [MIG[(0, 1, 0)]],
}


def test_mixed_registers_one_socket_per_mig_profile_beside_whole_gpus(mixed) -> None:
    plugin, kubelet, _, _ = mixed
    registrations = kubelet.wait_registrations(len(RESOURCES))
    assert {r["resource"]: r["endpoint"] for r in registrations} == {
        name: f"gpu-isolator-{name.split('/')[1]}.sock" for name in RESOURCES}
    assert sorted(name for name in os.listdir(kubelet.directory) if name != "kubelet.sock") == sorted(
        f"gpu-isolator-{name.split('/')[1]}.sock" for name in RESOURCES)
    numa = {gpu.index: gpu.numa_node for gpu in HOST.gpus}
    for name, uuids in RESOURCES.items():
        _, devices = kubelet.wait_list(name)
        parent = 1 if name == "nvidia.com/gpu" else (2 if "1c." in name else 0)
        assert devices == [(uuid, "Healthy", [numa[parent]]) for uuid in uuids], name
    assert all(uuid.startswith("MIG-") for name, ids in RESOURCES.items() if "mig-" in name for uuid in ids)


def test_mixed_allocates_a_mig_device_by_its_cdi_name_with_its_capability_nodes(mixed) -> None:
    _, kubelet, node, cdi = mixed
    kubelet.wait_registrations(len(RESOURCES))
    uuid = MIG[(0, 4, 0)]
    answer = kubelet.allocate("nvidia.com/mig-1g.18gb", [uuid])
    assert [d.name for d in answer.cdi_devices] == [f"nvidia.com/gpu={uuid}"]
    spec = json.loads((cdi / "gpu-isolator-node.json").read_text())
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert nodes[uuid][0] == "/dev/nvidia0" and len(nodes[uuid]) == 3  # its parent and its two caps
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": uuid}
    specs = [(d.container_path, d.permissions) for d in answer.devices]
    assert specs[0] == ("/dev/nvidia0", "rw")
    assert [path for path, mode in specs if mode == "r"] == nodes[uuid][1:]  # capability nodes: read-only
    assert all(path.startswith("/dev/nvidia-caps/nvidia-cap") for path in nodes[uuid][1:])
    assert ("/dev/nvidiactl", "rw") in specs
    with pytest.raises(grpc.RpcError) as other:
        kubelet.allocate("nvidia.com/mig-1g.18gb", [MIG[(0, 2, 0)]])  # a 2g.35gb device: not this resource's
    assert other.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"Unknown device IDs for nvidia.com/mig-1g.18gb: '{MIG[(0, 2, 0)]}'" in other.value.details()
    assert kubelet.preferred("nvidia.com/mig-1g.18gb", RESOURCES["nvidia.com/mig-1g.18gb"], [], 1) == [
        MIG[(0, 3, 0)]]


def test_mixed_pod_repair_links_the_capability_nodes_too(mixed) -> None:
    """R-PR-2 on a MIG node: every capability node the spec names gets its /dev/char link tried (this
    simulated node has no nodes, so each is reported once, never linked to nothing)."""
    plugin, _, node, cdi = mixed
    spec = json.loads((cdi / "gpu-isolator-node.json").read_text())
    caps = {n["hostPath"]: (n["major"], n["minor"]) for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]
            if n["path"].startswith("/dev/nvidia-caps/")}
    assert caps
    for host_path, (major, minor) in caps.items():
        log = plugin.wait_log(f"Left {node.dev_dir}/char/{major}:{minor} alone: there is no {host_path} to link to")
        assert log.count(f"Left {node.dev_dir}/char/{major}:{minor} alone") == 1
    assert not os.path.exists(os.path.join(node.dev_dir, "char"))


def test_single_offers_the_mig_devices_as_nvidia_com_gpu(single) -> None:
    _, kubelet, _, _ = single
    [registration] = kubelet.wait_registrations(1)
    assert registration["resource"] == "nvidia.com/gpu" and registration["endpoint"] == "gpu-isolator-gpu.sock"
    _, devices = kubelet.wait_list("nvidia.com/gpu")
    on_gpu0 = sorted(((gi, ci), uuid) for (index, gi, ci), uuid in MIG.items() if index == 0)
    assert [d[0] for d in devices] == [uuid for _, uuid in on_gpu0]  # unit order: GPU instance, compute instance
    answer = kubelet.allocate("nvidia.com/gpu", [MIG[(0, 2, 0)]])
    assert [d.name for d in answer.cdi_devices] == [f"nvidia.com/gpu={MIG[(0, 2, 0)]}"]


def test_time_slicing_offers_replicas_and_spreads_over_distinct_gpus_first(shared) -> None:
    _, kubelet, _, _ = shared
    kubelet.wait_registrations(1)
    _, devices = kubelet.wait_list("nvidia.com/gpu")
    replicas = [f"{uuid}::{i}" for uuid in GPU_UUIDS for i in range(2)]
    assert [d[0] for d in devices] == replicas
    r = {(gpu, i): f"{GPU_UUIDS[gpu]}::{i}" for gpu in range(8) for i in range(2)}
    # Two IDs: two GPUs (the best-linked pair), not two replicas of one GPU.
    assert kubelet.preferred("nvidia.com/gpu", replicas, [], 2) == [r[0, 0], r[1, 0]]
    # Both replicas of GPU 6 must be in: the third ID is a replica of its neighbour, GPU 7.
    assert kubelet.preferred("nvidia.com/gpu", replicas, [r[6, 0], r[6, 1]], 3) == [r[6, 0], r[6, 1], r[7, 0]]
    # Nine of sixteen: every GPU once, then a second replica.
    nine = kubelet.preferred("nvidia.com/gpu", replicas, [], 9)
    assert sorted(nine, key=replicas.index) == [r[0, 0], r[0, 1]] + [r[g, 0] for g in range(1, 8)]


def test_time_slicing_allocate_maps_replicas_back_to_their_gpu_once_each(shared) -> None:
    _, kubelet, _, _ = shared
    kubelet.wait_registrations(1)
    answer = kubelet.allocate("nvidia.com/gpu", [f"{GPU_UUIDS[3]}::1", f"{GPU_UUIDS[0]}::0", f"{GPU_UUIDS[0]}::1"])
    assert [d.name for d in answer.cdi_devices] == [f"nvidia.com/gpu={GPU_UUIDS[0]}", f"nvidia.com/gpu={GPU_UUIDS[3]}"]
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{GPU_UUIDS[0]},{GPU_UUIDS[3]}"}
    assert list(answer.devices) == []  # no --pass_device_specs here
    with pytest.raises(grpc.RpcError) as bare:
        kubelet.allocate("nvidia.com/gpu", [GPU_UUIDS[0]])  # the UUID itself is not an ID when replicated
    assert bare.value.code() == grpc.StatusCode.INVALID_ARGUMENT
