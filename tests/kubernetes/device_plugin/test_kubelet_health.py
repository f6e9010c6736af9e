"""R-K8-2, R-K8-4, R-K8-9 with health from the real NVML path: the plugin
process loads the real ``pynvml``, which finds the fake NVML
(``tests/native/fake_nvml.c``) as ``libnvidia-ml.so.1`` on its library
path, with no host file. Events are lines the test appends to the file
the fake's ``nvmlEventSetWait_v2`` reads, while the plugin's health
monitor waits on it.

Shown here: an Xid 79 makes that ID ``Unhealthy`` in a new list (an Xid
applications cause does not), ``Allocate`` of it is refused with
``FAILED_PRECONDITION`` naming it, the operator's ``mark_healthy`` makes
it ``Healthy`` again in the next list, and NVML's events failing for good
(the node's health unknown) makes every ID ``Unhealthy`` -- not a node
that keeps reporting healthy GPUs. After a kubelet restart the new
stream carries the current health (R-K8-5). Without a usable NVML and without a
host file the command exits 2 with NVML's error (R-K8-1, R-NV-1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from actors.nvml import host_spec_from_dict

from tests.support.fake_nvml import fake_nvml_node as fake_nvml_options
from tests.support.fake_nvml import raise_event
from tests.support.kubelet import FakeKubelet, PluginCommand, plugin_directory, write_credential
from tests.support.services import ROOT

GPU = "nvidia.com/gpu"
NODE = {
    "driver_version": "550.54.15",
    "gpus": [{"numa_node": 0}, {"numa_node": 0}, {"numa_node": 1}, {"numa_node": 1}],
}
SPEC = host_spec_from_dict(NODE)
UUIDS = [gpu.uuid for gpu in SPEC.gpus]
HEALTH_BACKOFF = "--nvidia_health_backoff=50ms"
"""Five failed waits back off 0.05 + 0.1 + 0.2 + 0.4 s before the node's health is unknown (1 + 2 + 4 + 8 s by
default: the doubling is ``test_gpu_health``'s, on a paused clock)."""
NVML_LOST_WAIT = 40  # seconds: a hang guard, never a timing assertion

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the real-NVML node needs mknod'ed control devices"
                                                            " and a root-owned credential: run as root")


def fake_nvml_node(base: Path, lib: Path) -> tuple[list[str], dict[str, str], Path]:
    """Options and environment for a plugin on the fake NVML of ``NODE``; the events file."""
    return fake_nvml_options(base, lib, SPEC)


def health(devices: list[tuple[str, str, list[int]]]) -> dict[str, str]:
    return {device_id: state for device_id, state, _ in devices}


def test_xid_unhealthy_then_healthy_again_then_every_gpu_unhealthy_when_nvml_is_lost(fake_nvml_lib, tmp_path) -> None:
    options, env, events = fake_nvml_node(tmp_path, fake_nvml_lib)
    secret = write_credential(tmp_path / "credential")
    with plugin_directory() as directory:
        kubelet = FakeKubelet(directory).start()
        plugin = PluginCommand([*options, f"--device_plugin_dir={directory}", "--listen=127.0.0.1:0",
                                f"--credential={tmp_path / 'credential'}", HEALTH_BACKOFF], tmp_path, env=env)
        try:
            plugin.start()
            kubelet.wait_registrations(1)
            first, devices = kubelet.wait_list(GPU)
            assert devices == [(UUIDS[i], "Healthy", [SPEC.gpus[i].numa_node]) for i in range(4)]
            assert "nvidia.com/gpu (4 devices)" in plugin.first_line

            raise_event(events, "xid", 0, 13)  # the application's fault: nothing changes
            raise_event(events, "xid", 1, 79)  # fallen off the bus
            index, devices = kubelet.wait_list(GPU, lambda d: health(d)[UUIDS[1]] == "Unhealthy", after=first + 1)
            assert health(devices) == {UUIDS[0]: "Healthy", UUIDS[1]: "Unhealthy", UUIDS[2]: "Healthy",
                                       UUIDS[3]: "Healthy"}

            kubelet.restart()  # R-K8-5: the stream served after re-registering carries the current health
            kubelet.wait_registrations(2)
            index, devices = kubelet.wait_list(GPU)
            assert health(devices)[UUIDS[1]] == "Unhealthy" and index == 0

            with pytest.raises(grpc.RpcError) as refused:
                kubelet.allocate(GPU, [UUIDS[0], UUIDS[1]])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"Unhealthy device IDs for nvidia.com/gpu: '{UUIDS[1]}' (Xid 79); nothing was allocated" in (
                refused.value.details())
            assert [d.name for d in kubelet.allocate(GPU, [UUIDS[0]]).cdi_devices] == [f"nvidia.com/gpu={UUIDS[0]}"]

            route = "/kubelet-plugin/mark_healthy"
            assert plugin.post(route, {"uuid": UUIDS[1]})[0] == 401  # no credential: nothing changes
            assert health(kubelet.stream(GPU).lists[-1])[UUIDS[1]] == "Unhealthy"
            status, text = plugin.post(route, {"uuid": UUIDS[1]}, token=secret)
            assert (status, '"was_unhealthy":"Xid 79"' in text) == (200, True), text
            index, devices = kubelet.wait_list(GPU, lambda d: health(d)[UUIDS[1]] == "Healthy", after=index + 1)
            assert set(health(devices).values()) == {"Healthy"}  # recovered, no restart of anything
            assert kubelet.allocate(GPU, [UUIDS[1]]).envs["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]

            raise_event(events, "error", 999, 5)  # the next five waits fail: NVML is lost
            index, devices = kubelet.wait_list(GPU, lambda d: set(health(d).values()) == {"Unhealthy"},
                                               after=index + 1, timeout=NVML_LOST_WAIT)
            with pytest.raises(grpc.RpcError) as unknown:
                kubelet.allocate(GPU, [UUIDS[2]])
            assert unknown.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "node health unknown: waiting for NVML health events failed 5 times" in unknown.value.details()
            metrics = plugin.metrics()
            assert metrics["kubelet_allocation_failures_total"] == 2
            assert metrics["kubelet_allocations_total"] == 2
            assert metrics["allocator_gpus_unhealthy"] == 4
            assert plugin.stop() == 0
        finally:
            kubelet.close()
            plugin.close()


def test_without_nvml_and_without_a_host_file_it_exits_2_with_nvmls_error(fake_nvml_lib, tmp_path) -> None:
    options, env, _ = fake_nvml_node(tmp_path, fake_nvml_lib)
    env["FAKE_NVML_FAIL"] = "nvmlInitWithFlags=9"  # NVML_ERROR_DRIVER_NOT_LOADED
    with plugin_directory() as directory:
        done = subprocess.run([sys.executable, "-m", "isolators", "kubelet-plugin", *options,
                               f"--device_plugin_dir={directory}"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=60)
        assert done.returncode == 2, done.stderr
        [line] = [line for line in done.stderr.splitlines() if line.startswith("gpu-isolator:")]
        assert line.startswith("gpu-isolator: error: Failed to initialize NVML (no host file given, so the real"
                               " NVML is required)")
        assert "NVML_ERROR_DRIVER_NOT_LOADED" in line and "--host_file" in line
        assert os.listdir(directory) == []
