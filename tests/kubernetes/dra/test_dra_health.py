"""Issue 37 items 4 and 5 with health from the real NVML path (the fake
``libnvidia-ml.so.1``, no host file): an Xid 79 taints that device on the
ResourceSlice and shows it ``UNHEALTHY`` in ``NodeWatchResources``; a claim
for it is refused; the operator's ``mark_healthy`` removes the taint (the
pool's generation bumped each time) and the next list shows it ``HEALTHY``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from actors.nvml import host_spec_from_dict

from tests.support.dra_kubelet import DraPluginCommand, FakeDraKubelet
from tests.support.fake_nvml import fake_nvml_node, raise_event
from tests.support.kube_api import FakeApiServer, allocation_result
from tests.support.kubelet import plugin_directory, write_credential

SPEC = host_spec_from_dict({"driver_version": "550.54.15",
                            "gpus": [{"numa_node": 0}, {"numa_node": 0}, {"numa_node": 1}, {"numa_node": 1}]})
DRIVER = "gpu.isolator.dev"
NODE = "node-h"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the real-NVML node needs mknod'ed control devices"
                                                            " and a root-owned credential: run as root")


def states(listing: list[tuple[str, str, str]]) -> dict[str, str]:
    return {name: state for name, state, _ in listing}


def taints(api: FakeApiServer) -> tuple[int, dict[str, list]]:
    [published] = api.slices(NODE)
    return (published["spec"]["pool"]["generation"],
            {d["name"]: d["taints"] for d in published["spec"]["devices"] if d.get("taints")})


def test_an_unhealthy_gpu_is_tainted_and_refused_then_recovers(fake_nvml_lib: Path, tmp_path: Path) -> None:
    options, env, events = fake_nvml_node(tmp_path, fake_nvml_lib, SPEC)
    secret = write_credential(tmp_path / "credential")
    api = FakeApiServer().start()
    with plugin_directory() as sockets:
        plugin = DraPluginCommand([
            *options, f"--work_dir={tmp_path / 'work'}", f"--plugins_registry_dir={sockets}/registry",
            f"--plugins_dir={sockets}/plugins", f"--node_name={NODE}",
            f"--kubeconfig={api.kubeconfig(tmp_path / 'kc')}", "--listen=127.0.0.1:0",
            f"--credential={tmp_path / 'credential'}", "--poll_interval=0.2"], tmp_path, env=env)
        kubelet = FakeDraKubelet(sockets / "registry")
        try:
            plugin.start()
            kubelet.register()
            kubelet.watch_health()
            kubelet.watch_health("v1alpha1")  # what kubelets 1.34-1.36 ask
            first, listing = kubelet.wait_health(lambda listing: True)
            assert listing == [(f"gpu-{i}", "HEALTHY", "") for i in range(4)]
            assert kubelet.wait_health(lambda listing: True, version="v1alpha1")[1] == listing
            api.wait_for(lambda api: api.slices(NODE), "the slice")
            assert taints(api) == (1, {})

            raise_event(events, "xid", 1, 79)  # fallen off the bus
            index, listing = kubelet.wait_health(lambda listing: states(listing)["gpu-1"] == "UNHEALTHY",
                                                 after=first + 1)
            assert listing == [("gpu-0", "HEALTHY", ""), ("gpu-1", "UNHEALTHY", "Xid 79"), ("gpu-2", "HEALTHY", ""),
                               ("gpu-3", "HEALTHY", "")]
            assert kubelet.wait_health(lambda got: got == listing, version="v1alpha1")[1] == listing
            api.wait_for(lambda api: taints(api)[1], "the taint")
            assert taints(api) == (2, {"gpu-1": [{"key": f"{DRIVER}/unhealthy", "value": "Xid-79",
                                                  "effect": "NoSchedule"}]})
            uid = str(uuid.uuid4())
            api.add_claim("team", "on-gpu-1", [allocation_result("gpus", DRIVER, NODE, "gpu-1")], uid=uid)
            assert kubelet.prepare([("team", "on-gpu-1", uid)]) == {uid: {"error": (
                f"claim team/on-gpu-1 (uid {uid}): device gpu-1 (Xid 79) is unhealthy; nothing was prepared. Once"
                " fixed an operator marks it healthy (POST /dra-plugin/mark_healthy)")}}

            route = "/dra-plugin/mark_healthy"
            gpu1 = SPEC.gpus[1].uuid
            assert plugin.post(route, {"uuid": gpu1})[0] == 401  # no credential: nothing changes
            assert plugin.post(route, {"uuid": "GPU-nope"}, token=secret)[0] == 404
            status, text = plugin.post(route, {"uuid": gpu1}, token=secret)
            assert (status, '"was_unhealthy":"Xid 79"' in text) == (200, True), text
            kubelet.wait_health(lambda listing: set(states(listing).values()) == {"HEALTHY"}, after=index + 1)
            api.wait_for(lambda api: taints(api) == (3, {}), "the taint removed")
            assert "devices" in kubelet.prepare([("team", "on-gpu-1", uid)])[uid]
            metrics = plugin.metrics()
            assert (metrics["dra_prepares_total"], metrics["dra_prepare_failures_total"]) == (1, 1)
            assert plugin.stop() == 0
        finally:
            kubelet.close()
            plugin.close()
            api.close()
