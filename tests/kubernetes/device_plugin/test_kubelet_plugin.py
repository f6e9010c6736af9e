"""R-K8-1..5, R-K8-8, R-K8-9 through the real ``gpu-isolator kubelet-plugin``
command and the fake kubelet (``tests.support.kubelet``).

One plugin process serves the whole module (the 8-GPU node of two NVLink
islands, ``tests/inventory/data/dgx8-nvlink.toml``, with
``--pass_device_specs``, ``--listen`` and ``--credential``): it starts
before any kubelet exists, and each test drives it as a kubelet would.
The checks do not change what the others see (nothing here makes a GPU
unhealthy: that is ``test_kubelet_health.py``), except the last one,
which stops it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from actors.nvml import load_host_file

from tests.support.kubelet import DGX8, FakeKubelet, PluginCommand, flag_args, plugin_directory, plugin_node, write_credential

UUIDS = [gpu.uuid for gpu in load_host_file(DGX8).gpus]
GPU = "nvidia.com/gpu"
SPEC_FILE = "gpu-isolator-node.json"


class Deployment:
    """The plugin, its fake kubelet and their directories."""

    def __init__(self, plugin: PluginCommand, kubelet: FakeKubelet, directory: Path, cdi: Path, node: Any,
                 token: str | None) -> None:
        self.plugin = plugin
        self.kubelet = kubelet
        self.directory = directory
        self.cdi = cdi
        self.node = node
        self.token = token
        self.started = False

    def registered(self) -> FakeKubelet:
        """The kubelet, started (once) and holding the plugin's registration."""
        if not self.started:
            self.kubelet.start()
            self.started = True
        self.kubelet.wait_registrations(1)
        return self.kubelet


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("kubelet-plugin")
    node, cdi = plugin_node(base)
    token = None
    extra = []
    if os.geteuid() == 0:  # the credential must be root's (R-SC-6)
        token = write_credential(base / "credential")
        extra.append(f"--credential={base / 'credential'}")
    with plugin_directory() as directory:
        args = flag_args(node.flag_values(cdi_spec_dir=str(cdi))) + [
            f"--device_plugin_dir={directory}", "--pass_device_specs", "--listen=127.0.0.1:0", *extra]
        plugin = PluginCommand(args, base)
        kubelet = FakeKubelet(directory)
        try:
            plugin.start()
            yield Deployment(plugin, kubelet, directory, cdi, node, token)
        finally:
            kubelet.close()
            plugin.close()


def ids(devices: list[tuple[str, str, list[int]]]) -> list[str]:
    return [device[0] for device in devices]


def test_it_waits_for_a_late_kubelet_then_retries_a_refused_registration(k8s: Deployment) -> None:
    log = k8s.plugin.wait_log("waiting for the kubelet")
    assert f"no {k8s.directory}/kubelet.sock yet" in log
    assert k8s.plugin.process.poll() is None  # it waits; it does not exit
    assert not k8s.started, "the kubelet must come late for this check: run this test first"
    k8s.kubelet.refuse(1, "the kubelet is not ready for nvidia.com/gpu yet")
    k8s.registered()
    log = k8s.plugin.wait_log("registered with the kubelet")
    assert ("registration with" in log and "failed: FAILED_PRECONDITION: the kubelet is not ready for"
            " nvidia.com/gpu yet; trying again in 1s" in log)
    assert [m[2] for m in k8s.kubelet.messages[:2]] == ["Register", "Register (refused)"]


def test_it_serves_before_it_registers_and_registers_what_the_spec_says(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    [registration] = kubelet.registrations[:1]
    assert registration["resource"] == GPU
    assert registration["endpoint"] == "gpu-isolator-gpu.sock"  # the socket's file name, in the dir
    assert registration["version"] == "v1beta1"
    assert registration["options"] == {"get_preferred_allocation_available": True, "pre_start_required": False}
    assert registration["dialled_options"] == registration["options"]
    accepted = next(m[0] for m in kubelet.messages if m[2] == "Register (accepted)")
    # The kubelet dialled the plugin back and asked its options before it answered Register.
    assert [(m[1], m[2]) for m in kubelet.messages[accepted - 3:accepted + 1]] == [
        ("plugin->kubelet", "Register"), ("kubelet->plugin", "GetDevicePluginOptions"),
        ("plugin->kubelet", "GetDevicePluginOptions"), ("kubelet->plugin", "Register (accepted)")]
    assert (k8s.directory / "gpu-isolator-gpu.sock").exists()


def test_the_list_has_every_gpu_by_uuid_healthy_with_its_numa_node(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    _, devices = kubelet.wait_list(GPU)
    assert devices == [(UUIDS[i], "Healthy", [0 if i < 4 else 1]) for i in range(8)]


def test_preferred_allocation_keeps_to_one_island(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    assert kubelet.preferred(GPU, UUIDS, [], 4) == UUIDS[0:4]
    # 4 of 7 (GPU 0 taken): the other whole island, not the lowest four.
    assert kubelet.preferred(GPU, UUIDS[1:], [], 4) == UUIDS[4:8]
    # 2 with one must-include: its best-linked neighbour (same NVLink island and PCIe switch).
    assert kubelet.preferred(GPU, UUIDS, [UUIDS[6]], 2) == [UUIDS[6], UUIDS[7]]
    assert kubelet.preferred(GPU, UUIDS, [UUIDS[5]], 2) == [UUIDS[4], UUIDS[5]]
    # 3 with one must-include: two more of its island (sets that score alike: the lowest).
    assert kubelet.preferred(GPU, UUIDS, [UUIDS[2]], 3) == UUIDS[0:3]


def test_preferred_allocation_refuses_ids_and_sizes_it_cannot_meet(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    with pytest.raises(grpc.RpcError) as unknown:
        kubelet.preferred(GPU, UUIDS[:2] + ["GPU-nope"], [], 1)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unknown available device IDs for nvidia.com/gpu: 'GPU-nope'" in unknown.value.details()
    with pytest.raises(grpc.RpcError) as too_many:
        kubelet.preferred(GPU, UUIDS[:2], [], 3)
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "allocation_size 3 for nvidia.com/gpu cannot be met" in too_many.value.details()
    with pytest.raises(grpc.RpcError) as outside:
        kubelet.preferred(GPU, UUIDS[:2], [UUIDS[5]], 2)
    assert "Must-include device IDs for nvidia.com/gpu that are not available" in outside.value.details()


def test_allocate_answers_cdi_names_of_the_written_spec_env_and_device_specs(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    answer = kubelet.allocate(GPU, [UUIDS[5], UUIDS[4]])
    names = [device.name for device in answer.cdi_devices]
    assert names == [f"nvidia.com/gpu={UUIDS[4]}", f"nvidia.com/gpu={UUIDS[5]}"]
    spec = json.loads((k8s.cdi / SPEC_FILE).read_text())
    assert spec["kind"] == "nvidia.com/gpu"
    in_spec = {f"{spec['kind']}={device['name']}": device for device in spec["devices"]}
    for name in names:
        assert name in in_spec  # the runtime resolves every name it is given
    assert [n["path"] for n in in_spec[names[0]]["containerEdits"]["deviceNodes"]] == ["/dev/nvidia4"]
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[4]},{UUIDS[5]}"}
    dev = k8s.node.dev_dir
    assert [(d.container_path, d.host_path, d.permissions) for d in answer.devices] == [
        ("/dev/nvidia4", f"{dev}/nvidia4", "rw"), ("/dev/nvidia5", f"{dev}/nvidia5", "rw"),
        ("/dev/nvidiactl", f"{dev}/nvidiactl", "rw"), ("/dev/nvidia-uvm", f"{dev}/nvidia-uvm", "rw"),
        ("/dev/nvidia-uvm-tools", f"{dev}/nvidia-uvm-tools", "rw"),
        ("/dev/nvidia-modeset", f"{dev}/nvidia-modeset", "rw")]
    assert list(answer.mounts) == []  # the driver volume comes with the CDI spec's shared edits
    # The spec is kept current: gone, it is back before the next names go out.
    (k8s.cdi / SPEC_FILE).unlink()
    kubelet.allocate(GPU, [UUIDS[0]])
    assert json.loads((k8s.cdi / SPEC_FILE).read_text()) == spec


def test_allocate_refuses_unknown_ids_naming_them(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(GPU, [UUIDS[0], "GPU-unknown-1", "GPU-unknown-2"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unknown device IDs for nvidia.com/gpu: 'GPU-unknown-1', 'GPU-unknown-2'" in refused.value.details()
    with pytest.raises(grpc.RpcError) as empty:
        kubelet.allocate(GPU, [])
    assert "names no device ID" in empty.value.details()


def test_a_cancelled_stream_is_followed_by_a_new_one_with_the_whole_list(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    kubelet.wait_list(GPU)
    old = kubelet.cancel_stream(GPU)
    assert old.ended == "CANCELLED"
    new = kubelet.open_stream(GPU)
    _, devices = kubelet.wait_list(GPU)
    assert kubelet.stream(GPU) is new and ids(devices) == UUIDS
    k8s.plugin.wait_log("ListAndWatch for nvidia.com/gpu: the stream ended")
    assert k8s.plugin.process.poll() is None


def test_mark_healthy_needs_the_bearer_credential(k8s: Deployment) -> None:
    if k8s.token is None:
        pytest.skip("the credential file must be owned by root (R-SC-6): run as root")
    k8s.registered()
    route = "/kubelet-plugin/mark_healthy"
    status, text = k8s.plugin.post(route, {"uuid": UUIDS[3]})
    assert status == 401 and "Authorization: Bearer <secret>" in text
    assert k8s.plugin.post(route, {"uuid": UUIDS[3]}, token="wrong")[0] == 401
    status, text = k8s.plugin.post(route, {"uuid": "GPU-not-here"}, token=k8s.token)
    assert status == 404 and "no GPU or MIG device with UUID 'GPU-not-here'" in text
    assert k8s.plugin.post(route, b"{not json", token=k8s.token)[0] == 400
    status, text = k8s.plugin.post(route, {"uuid": UUIDS[3]}, token=k8s.token)
    assert status == 200
    assert json.loads(text) == {"uuid": UUIDS[3], "unit": "195:3", "healthy": True, "was_unhealthy": None}


def test_a_kubelet_restart_is_followed_by_a_new_registration_within_10s_same_process(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    pid = k8s.plugin.pid
    before = len(kubelet.registrations)
    old = kubelet.stream(GPU)
    restarted = time.monotonic()
    kubelet.restart()
    registration = kubelet.wait_registrations(before + 1, timeout=10)[before]
    assert registration["at"] - restarted < 10
    assert registration["endpoint"] == "gpu-isolator-gpu.sock"
    assert k8s.plugin.pid == pid and k8s.plugin.process.poll() is None  # the same process
    assert kubelet.wait_stream_end(old)  # the old stream ended with the old kubelet
    _, devices = kubelet.wait_list(GPU)  # the new stream carries the current list
    assert devices == [(UUIDS[i], "Healthy", [0 if i < 4 else 1]) for i in range(8)]
    assert "the kubelet restarted (its socket was removed): serving and registering again" in k8s.plugin.log()


def test_metrics_count_registrations_and_allocations(k8s: Deployment) -> None:
    kubelet = k8s.registered()
    before = k8s.plugin.metrics()
    kubelet.allocate(GPU, [UUIDS[1]])
    with pytest.raises(grpc.RpcError):
        kubelet.allocate(GPU, ["GPU-unknown"])
    after = k8s.plugin.metrics()
    assert after["kubelet_allocations_total"] == before["kubelet_allocations_total"] + 1
    assert after["kubelet_allocation_failures_total"] == before["kubelet_allocation_failures_total"] + 1
    assert after["kubelet_registrations_total"] == len(kubelet.registrations) >= 1
    assert after["allocator_gpus_total"] == 8


def test_sigterm_removes_only_its_own_socket_and_exits_0(k8s: Deployment) -> None:
    """Last: it stops the module's plugin."""
    kubelet = k8s.registered()
    neighbour = socket.socket(socket.AF_UNIX)  # another plugin's socket: never touched
    neighbour.bind(str(k8s.directory / "other-vendor.sock"))
    (k8s.directory / "notes.txt").write_text("kept")
    try:
        assert k8s.plugin.stop(signal.SIGTERM) == 0
        assert sorted(os.listdir(k8s.directory)) == ["kubelet.sock", "notes.txt", "other-vendor.sock"]
        assert kubelet.wait_stream_end(kubelet.stream(GPU)) in ("OK", "CANCELLED", "UNAVAILABLE")
        assert "Stopping on SIGTERM" in k8s.plugin.log()
    finally:
        neighbour.close()
