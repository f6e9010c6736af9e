"""Issue 37's proof with a real engine: podman, given the ``cdi_device_ids``
that ``gpu-isolator dra-plugin`` answered for a 2-GPU claim, shows the
container exactly those GPUs (and the control devices and the driver
volume), as the CDI tests check for the node spec; and (issue 42, R-DR-3)
two containers of the claim, each given one request's devices as the
kubelet does, each see only their own -- ``NVIDIA_VISIBLE_DEVICES``
included, which is ``void`` (no list a container was not given).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from actors.nvml import load_host_file
from tests.support.dra_kubelet import DraPluginCommand, FakeDraKubelet
from tests.support.host_facts import own_facts
from tests.support.kube_api import FakeApiServer, allocation_result
from tests.support.kubelet import plugin_directory

from .test_engines_static_spec import PCIE, assert_sees_exactly, probed_with

DRIVER = "gpu.isolator.dev"


def test_podman_shows_a_prepared_two_gpu_claim_exactly_its_gpus(podman, gpu_dev, tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    facts = own_facts(tmp_path)
    api = FakeApiServer().start()
    uid = str(uuid.uuid4())
    api.add_claim("team", "two-gpus", [allocation_result("first", DRIVER, "node-p", "gpu-1"),
                                       allocation_result("second", DRIVER, "node-p", "gpu-3")], uid=uid)
    with plugin_directory() as sockets:
        plugin = DraPluginCommand([
            f"--host_file={PCIE}", f"--dev_dir={gpu_dev}", f"--ld_cache={facts['ld_cache']}",
            f"--proc_dir={facts['proc_dir']}", f"--volume_dir={tmp_path / 'volume'}", f"--work_dir={tmp_path / 'work'}",
            f"--cdi_spec_dir={cdi}", f"--plugins_registry_dir={sockets}/registry", f"--plugins_dir={sockets}/plugins",
            "--node_name=node-p", f"--kubeconfig={api.kubeconfig(tmp_path / 'kubeconfig')}"], tmp_path)
        kubelet = FakeDraKubelet(sockets / "registry")
        try:
            plugin.start()
            kubelet.register()
            answer = kubelet.prepare([("team", "two-gpus", uid)])[uid]
            ids = [i for device in answer["devices"] for i in device["cdi_device_ids"]]
            assert ids == [f"{DRIVER}/claim={uid}-gpu-1", f"{DRIVER}/claim={uid}-gpu-3"]
            report = probed_with(podman, ids, gpu_dev, cdi, env={"PATH": "/opt/conda/bin:/bin"})  # the whole claim
            assert_sees_exactly(report, [1, 3])
            assert report.env["PATH"] == "/opt/conda/bin:/bin" and "LD_LIBRARY_PATH" not in report.env  # R-DR-2
            assert report.env["NVIDIA_VISIBLE_DEVICES"] == "void"
            assert "ro" in report.mounts["/usr/local/nvidia"]
            gpus = load_host_file(PCIE).gpus
            for request, minor, other in (("first", 1, 3), ("second", 3, 1)):  # a container per request
                own = [i for d in answer["devices"] if d["request_names"] == [request] for i in d["cdi_device_ids"]]
                report = probed_with(podman, own, gpu_dev, cdi)
                assert_sees_exactly(report, [minor])
                assert report.env["NVIDIA_VISIBLE_DEVICES"] == "void"
                assert gpus[other].uuid not in " ".join(report.env.values()), (request, report.env)
            assert kubelet.unprepare([("team", "two-gpus", uid)]) == {uid: {}}
            assert os.listdir(cdi) == []  # nothing left behind
        finally:
            kubelet.close()
            plugin.close()
            api.close()
