"""MIG devices in CDI (R-MG-3): the node's static spec names them as NVIDIA
does (``<gpu>:<mig index>`` and the MIG UUID), each with its parent node and
its two capability nodes; the isolator's transient spec and ``to_oci()`` of a
container holding one MIG device hold the same, with its ``MIG-…`` UUID in
``NVIDIA_VISIBLE_DEVICES``. podman and runc, given them, let the container
open exactly those (ENXIO) and no other MIG device's capability nodes
(EPERM); after an update, the new one only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import runtime
from actors.nvml import load_host_file
from isolators import ContainerConfig, ContainerID, Resources, cli
from tests.support.engines import make_device_nodes, parse_probe
from tests.support import cdi
from tests.support.host_facts import own_fact_args
from tests.support.probes import ABSENT, DENIED, GRANTED, verdicts
from tests.support.mig import HOST, MIG, caps_of, mknod_mig_nodes, write_mig_proc

from .conftest import CONTROL_NODES

REPO = Path(__file__).resolve().parents[2]
H200 = str(REPO / "examples" / "h200-mig.toml")
PROC = str(REPO / "examples" / "h200-mig-proc")
CAPS_MAJOR = 239
# examples/h200-mig-proc: GPU 0's GI 3/CI 0 (0:0) are caps 30/31, GI 4 (0:1) 39/40, GI 2 (0:2) 21/22, GI 1 (0:3) 12/13.
CAPS = {"0:0": (30, 31), "0:1": (39, 40), "0:2": (21, 22), "0:3": (12, 13)}


def generate(capsys, tmp_path, *argv: str) -> tuple[int, str, str]:
    return cdi.generate(capsys, tmp_path, "--host-file", H200, *argv)


def test_mig_devices_are_named_as_nvidia_does_with_parent_and_capabilities(capsys, tmp_path) -> None:
    spec, out = cdi.spec_with_slash_dev(capsys, tmp_path, "--host-file", H200, "--proc-dir", PROC)
    migs = [m for g in load_host_file(H200).gpus for m in g.mig_devices]
    gpu_uuids = [g.uuid for g in load_host_file(H200).gpus]
    assert [d.name for d in spec.devices] == [
        "0", "1", "0:0", "0:1", "0:2", "0:3", *gpu_uuids, *(m.uuid for m in migs), "all"
    ]
    by_name = {d.name: d for d in spec.devices}
    for index, (name, (gi_minor, ci_minor)) in enumerate(CAPS.items()):
        for key in (name, migs[index].uuid):
            nodes = by_name[key].container_edits.device_nodes
            assert [(n.path, n.major, n.minor, n.permissions, n.file_mode) for n in nodes] == [
                ("/dev/nvidia0", 195, 0, "rwm", 0o666),
                (f"/dev/nvidia-caps/nvidia-cap{gi_minor}", CAPS_MAJOR, gi_minor, "r", 0o444),
                (f"/dev/nvidia-caps/nvidia-cap{ci_minor}", CAPS_MAJOR, ci_minor, "r", 0o444),
            ]
            assert nodes[1].host_path is None  # the dev dir is /dev
    every = [n.path for n in by_name["all"].container_edits.device_nodes]
    assert every[:2] == ["/dev/nvidia0", "/dev/nvidia1"] and len(every) == 2 + 8
    assert json.loads(out)["cdiVersion"] == "0.5.0"


def test_mig_devices_without_capability_facts_are_one_clear_error(capsys, tmp_path) -> None:
    code, out, err = generate(capsys, tmp_path, "--proc-dir", str(tmp_path / "no-proc"))
    assert code != 0 and out == ""
    assert err.startswith("gpu-isolator: error: MIG devices without capability facts in"
                          f" '{tmp_path}/no-proc/driver/nvidia-caps/mig-minors'")
    assert len(err.strip().splitlines()) == 1


@pytest.fixture
def mig_dev(tmp_path) -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = str(tmp_path / "dev")
    make_device_nodes(directory, {"nvidia0": (195, 0), "nvidia1": (195, 1), **CONTROL_NODES})
    make_device_nodes(os.path.join(directory, "nvidia-caps"),
                      {f"nvidia-cap{m}": (CAPS_MAJOR, m) for pair in CAPS.values() for m in pair})
    return directory


def test_podman_gives_a_container_one_mig_device_and_nothing_of_the_others(podman, mig_dev, tmp_path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    code = cli.main(["cdi", "generate", "--host-file", H200, *own_fact_args(tmp_path), "--proc-dir", PROC,
                     "--dev-dir", mig_dev,
                     "--volume-dir", str(tmp_path / "volume"), "--output", str(cdi_dir / "nvidia.yaml")])
    assert code == 0
    caps = [m for pair in CAPS.values() for m in pair]
    paths = ["/dev/nvidia0", "/dev/nvidia1", *(f"/dev/nvidia-caps/nvidia-cap{m}" for m in caps),
             "/host-dev/nvidia0", "/host-dev/nvidia1", *(f"/host-dev/nvidia-caps/nvidia-cap{m}" for m in caps)]
    result = podman.run(podman.image, ["/bin/sh", "/bin/probe", *paths], devices=["nvidia.com/gpu=0:1"],
                        volumes=[f"{mig_dev}:/host-dev:dev"], cdi_dir=str(cdi_dir))
    assert result.returncode == 0, result.stderr
    report = parse_probe(result.stdout)
    mine = set(CAPS["0:1"])
    seen = verdicts(report.opens)
    assert seen["/dev/nvidia0"] == GRANTED and seen["/host-dev/nvidia0"] == GRANTED
    assert seen["/dev/nvidia1"] == ABSENT and seen["/host-dev/nvidia1"] == DENIED
    for minor in caps:
        inside = f"/dev/nvidia-caps/nvidia-cap{minor}"
        through_host = f"/host-dev/nvidia-caps/nvidia-cap{minor}"
        assert seen[inside] == (GRANTED if minor in mine else ABSENT), (minor, report.opens)
        assert seen[through_host] == (GRANTED if minor in mine else DENIED), (minor, report.opens)
    assert report.nodes["/dev/nvidia0"] == ("c", 195, 0, 0o666) and "/dev/nvidia1" not in report.nodes


def _mig_probe_paths() -> list[str]:
    minors = [m for device in MIG.values() for m in caps_of(device)]
    inside = ["/dev/nvidia0", "/dev/nvidia1", *(f"/dev/nvidia-caps/nvidia-cap{m}" for m in minors)]
    return [*inside, *(p.replace("/dev/", "/host-dev/", 1) for p in inside)]


def _assert_sees_mig(report, granted: str) -> None:
    mine = set(caps_of(MIG[granted]))
    seen = verdicts(report.opens)
    assert seen["/dev/nvidia0"] == seen["/host-dev/nvidia0"] == GRANTED
    assert (seen["/dev/nvidia1"], seen["/host-dev/nvidia1"]) == (ABSENT, DENIED)
    for device in MIG.values():
        for minor in caps_of(device):
            expected = (GRANTED, GRANTED) if minor in mine else (ABSENT, DENIED)
            got = (seen[f"/dev/nvidia-caps/nvidia-cap{minor}"], seen[f"/host-dev/nvidia-caps/nvidia-cap{minor}"])
            assert got == expected, (minor, report.opens)


@pytest.mark.asyncio
async def test_engines_run_the_isolators_grant_of_one_mig_device(podman, runc, busybox_rootfs, node_factory,
                                                                  tmp_path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    node = node_factory("memory", host=HOST, nvidia_mig_strategy="mixed", cdi_spec_dir=str(cdi_dir))
    write_mig_proc(node.proc_dir)
    mknod_mig_nodes(node.dev_dir)
    host_dev = f"{node.dev_dir}:/host-dev:dev"
    async with runtime.Runtime():
        components, isolator = await node.start()
        uuid = {mig.device: mig.uuid for mig in components.inventory.mig_devices}
        info = await isolator.prepare(ContainerID("a"), ContainerConfig(resources=Resources.parse("mig-1g.18gb:1")))
        (device,) = info.cdi_devices

        def podman_sees(granted: str):
            result = podman.run(podman.image, ["/bin/sh", "/bin/probe", *_mig_probe_paths()], devices=[device],
                                volumes=[host_dev], cdi_dir=str(cdi_dir))
            assert result.returncode == 0, result.stderr
            report = parse_probe(result.stdout)
            _assert_sees_mig(report, granted)
            return report

        by_podman = podman_sees("1g-a")
        assert by_podman.env["NVIDIA_VISIBLE_DEVICES"] == uuid[MIG["1g-a"]]
        result = runc.run(busybox_rootfs, info.to_oci(), ["/bin/sh", "/bin/probe", *_mig_probe_paths()],
                          binds={"/host-dev": node.dev_dir})
        assert result.returncode == 0, result.stderr
        _assert_sees_mig(parse_probe(result.stdout), "1g-a")

        # After an update the spec names the new MIG device only.
        await isolator.update(ContainerID("a"), Resources.parse("mig-2g.35gb:1"))
        by_podman = podman_sees("2g")
        assert by_podman.env["NVIDIA_VISIBLE_DEVICES"] == uuid[MIG["2g"]]
        await isolator.cleanup(ContainerID("a"))
        assert list(cdi_dir.iterdir()) == []


def test_compute_instances_of_one_gpu_instance_share_its_cap_once_in_all(capsys, tmp_path) -> None:
    # tests/inventory/data/h200-mig.toml: GPU 2's GPU instance 1 holds two compute instances.
    from isolators.simulated_node import SimulatedNode

    node = SimulatedNode(tmp_path / "node", host=REPO / "tests" / "inventory" / "data" / "h200-mig.toml").create_files()
    code = cli.main(["cdi", "generate", "--host-file", node.host_file, "--volume-dir", node.volume_dir,
                     "--ld-cache", node.ld_cache, "--proc-dir", node.proc_dir])
    out, err = capsys.readouterr()
    assert code == 0, err
    devices = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in json.loads(out)["devices"]}
    every = devices["all"]
    assert len(every) == len(set(every))
    ci0, ci1 = devices["2:0"], devices["2:1"]
    assert ci0[:2] == ci1[:2] and ci0[2] != ci1[2]  # the parent and the GI's cap shared, each CI's own cap
    assert set(ci0 + ci1) <= set(every)
