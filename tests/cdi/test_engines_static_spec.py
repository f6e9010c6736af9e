"""Real engines (R-CD-4, R-CD-5): podman consumes the spec ``gpu-isolator
cdi generate`` writes, runc a ``runc spec`` config merged with ``to_oci()``.

On mknod'd major-195 nodes, with the host's dev dir also bind-mounted at
``/host-dev`` (so the cgroup's answer for nodes the container was NOT given
shows): a granted node opens with ENXIO (allowed; no driver), a node not
granted is absent from ``/dev`` and gives EPERM through ``/host-dev``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
from actors import Gpu
from actors.devices import DeviceRule
from actors.nvml import load_host_file
from isolators import ContainerLaunchInfo, cli
from isolators import ContainerBindMount
from isolators.cdi import container_grant, container_spec, encode_spec
from tests.support.engines import parse_probe

from .conftest import CONTROL_NODES
from tests.support.host_facts import own_fact_args
from tests.support.probes import ABSENT, DENIED, GRANTED, verdicts

REPO = Path(__file__).resolve().parents[2]
PCIE = str(REPO / "examples" / "pcie-4gpu.toml")
CONTROL_PATHS = [f"/dev/{name}" for name in CONTROL_NODES]
GPU_PATHS = [f"/dev/nvidia{i}" for i in range(4)]
HOST_PATHS = [f"/host-dev/nvidia{i}" for i in range(4)]


def probe_args(*extra: str) -> list[str]:
    return ["/bin/sh", "/bin/probe", *GPU_PATHS, *CONTROL_PATHS, *HOST_PATHS, *extra]


def probed_with(podman, devices: list[str], gpu_dev, cdi_dir, env: dict[str, str] | None = None) -> Any:
    """The probe's report from a podman container given ``devices`` (CDI names) from ``cdi_dir`` and started
    with ``env``, the host's fake GPU nodes mounted at /host-dev."""
    result = podman.run(podman.image, probe_args(), devices=devices, volumes=[f"{gpu_dev}:/host-dev:dev"],
                        cdi_dir=str(cdi_dir), env=env)
    assert result.returncode == 0, result.stderr
    return parse_probe(result.stdout)


def assert_sees_exactly(report, minors: list[int]) -> None:
    seen = verdicts(report.opens)
    for i in range(4):
        assert seen[f"/dev/nvidia{i}"] == (GRANTED if i in minors else ABSENT), (i, report.opens)
        assert seen[f"/host-dev/nvidia{i}"] == (GRANTED if i in minors else DENIED), (i, report.opens)
    for path in CONTROL_PATHS:
        assert seen[path] == GRANTED, (path, report.opens)
    expected = {f"/dev/nvidia{i}": ("c", 195, i, 0o666) for i in minors}
    expected |= {f"/dev/{name}": ("c", major, minor, 0o666) for name, (major, minor) in CONTROL_NODES.items()}
    assert report.nodes == expected


def test_podman_injects_the_generated_node_spec(podman, gpu_dev, tmp_path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    code = cli.main(["cdi", "generate", "--host-file", PCIE, *own_fact_args(tmp_path), "--dev-dir", gpu_dev,
                     "--volume-dir", str(tmp_path / "volume"), "--output", str(cdi_dir / "nvidia.yaml")])
    assert code == 0
    uuid2 = load_host_file(PCIE).gpus[2].uuid
    host_dev = f"{gpu_dev}:/host-dev:dev"
    for device, minors in (("nvidia.com/gpu=1", [1]), (f"nvidia.com/gpu={uuid2}", [2]), ("nvidia.com/gpu=all", [0, 1, 2, 3])):
        result = podman.run(podman.image, probe_args(), devices=[device], volumes=[host_dev], cdi_dir=str(cdi_dir),
                            env={"PATH": "/opt/conda/bin:/bin"})
        assert result.returncode == 0, result.stderr
        report = parse_probe(result.stdout)
        assert_sees_exactly(report, minors)
        assert report.env["PATH"] == "/opt/conda/bin:/bin" and "LD_LIBRARY_PATH" not in report.env  # R-DR-2
        assert "NVIDIA_VISIBLE_DEVICES" not in report.env
        assert "ro" in report.mounts["/usr/local/nvidia"]
    assert os.listdir(cdi_dir) == ["nvidia.yaml"]


def test_podman_refuses_an_unknown_device_with_the_reason(podman, tmp_path) -> None:
    result = podman.run(podman.image, ["/bin/true"], devices=["nvidia.com/gpu=7"], cdi_dir=str(tmp_path))
    assert result.returncode != 0
    assert "unresolvable CDI devices nvidia.com/gpu=7" in result.stderr


def test_runc_with_a_merged_oci_fragment(runc, busybox_rootfs, gpu_dev, tmp_path) -> None:
    uuids = {Gpu.nvidia(i): f"GPU-{i}" for i in range(4)}
    control = {os.path.join(gpu_dev, name): DeviceRule("c", major, minor, "rwm")
               for name, (major, minor) in CONTROL_NODES.items()}
    volume_dir = tmp_path / "volume"
    (volume_dir / "lib64").mkdir(parents=True)
    volume = ContainerBindMount(host_path=str(volume_dir), container_path="/usr/local/nvidia")
    grant = container_grant({Gpu.nvidia(0), Gpu.nvidia(3)}, uuids, control, gpu_dev, volume=volume,
                            volume_env={"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"})
    result = runc.run(busybox_rootfs, ContainerLaunchInfo(grant=grant).to_oci(), probe_args(),
                      binds={"/host-dev": gpu_dev})
    assert result.returncode == 0, result.stderr
    report = parse_probe(result.stdout)
    assert_sees_exactly(report, [0, 3])
    assert report.env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0,GPU-3"
    assert report.env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert "ro" in report.mounts["/usr/local/nvidia"]


def test_podman_refuses_a_version_newer_than_it_reads_and_the_debug_log_says_why(podman, tmp_path) -> None:
    """Why ``SUPPORTED_VERSIONS`` stops at 0.5.0: podman 4.3.1 refuses 0.6.0,
    and says so only in its debug log (the harness shows it)."""
    spec = container_spec("c1", container_grant(set(), {}, {}, "/dev"))
    assert spec.cdi_version == "0.3.0"
    newer = msgspec.structs.replace(spec, cdi_version="0.6.0")
    (tmp_path / "gpu-isolator-container_c1.json").write_bytes(msgspec.json.encode(newer))
    refused = podman.run(podman.image, ["/bin/true"], devices=["gpu-isolator/container=c1"], cdi_dir=str(tmp_path))
    assert refused.returncode != 0
    assert "unresolvable CDI devices gpu-isolator/container=c1" in refused.stderr
    assert 'invalid version \\"0.6.0\\"' in refused.stderr  # from the --log-level=debug rerun
    (tmp_path / "gpu-isolator-container_c1.json").write_bytes(encode_spec(spec))
    accepted = podman.run(podman.image, ["/bin/sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES"],
                          devices=["gpu-isolator/container=c1"], cdi_dir=str(tmp_path))
    assert accepted.returncode == 0, accepted.stderr
    assert accepted.stdout == "none\n"


def test_podman_injects_what_the_kubelet_plugin_allocates(podman, gpu_dev, tmp_path) -> None:
    """R-K8-4: the CDI names ``Allocate`` answers resolve in the node spec the
    plugin wrote, and podman (``--device NAME``, as a CDI-enabled runtime
    does) gives the container exactly those GPUs."""
    from tests.support.host_facts import own_facts
    from tests.support.kubelet import FakeKubelet, PluginCommand, flag_args, plugin_directory

    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    uuids = [gpu.uuid for gpu in load_host_file(PCIE).gpus]
    flags = {"host_file": PCIE, "dev_dir": gpu_dev, "volume_dir": str(tmp_path / "volume"),
             "cdi_spec_dir": str(cdi_dir), **own_facts(tmp_path)}
    with plugin_directory() as directory:
        kubelet = FakeKubelet(directory).start()
        plugin = PluginCommand(flag_args(flags) + [f"--device_plugin_dir={directory}"], tmp_path)
        try:
            plugin.start()
            kubelet.wait_registrations(1)
            answer = kubelet.allocate("nvidia.com/gpu", [uuids[3], uuids[1]])
        finally:
            kubelet.close()
            assert plugin.stop() == 0
            plugin.close()
    names = [device.name for device in answer.cdi_devices]
    assert names == [f"nvidia.com/gpu={uuids[1]}", f"nvidia.com/gpu={uuids[3]}"]
    report = probed_with(podman, names, gpu_dev, cdi_dir)
    assert_sees_exactly(report, [1, 3])
    assert "ro" in report.mounts["/usr/local/nvidia"]
    assert os.listdir(cdi_dir) == ["gpu-isolator-node.json"]
