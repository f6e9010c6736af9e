"""``gpu-isolator cdi generate`` (R-CD-4): the node's static spec, kind
``nvidia.com/gpu``, devices by index, by UUID and ``all``; shared edits with
the control devices and the driver volume; JSON on stdout is the JSON alone;
no NVML and no host file is a clear error."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from actors.nvml import load_host_file
from actors.nvml._open import nvml_available
from isolators import cli
from isolators.cdi import HOOK_FILE, decode_spec, validate_spec
from tests.support.cdi import generate, spec_with_slash_dev
from tests.support.host_facts import own_fact_args

REPO = Path(__file__).resolve().parents[2]
DGX = str(REPO / "examples" / "dgx-8gpu.toml")
PCIE = str(REPO / "examples" / "pcie-4gpu.toml")


def test_json_on_stdout_is_the_spec_alone(capsys, tmp_path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    code, out, err = generate(capsys, tmp_path, "--host-file", PCIE, "--dev-dir", str(dev))
    assert code == 0, err
    document = json.loads(out)  # nothing else on stdout
    spec = decode_spec(out.encode(), "json")
    uuids = [gpu.uuid for gpu in load_host_file(PCIE).gpus]
    assert spec.kind == "nvidia.com/gpu" and spec.cdi_version == "0.5.0"
    assert [d.name for d in spec.devices] == ["0", "1", "2", "3", *uuids, "all"]
    minors = [gpu.minor for gpu in load_host_file(PCIE).gpus]
    for device, minor in zip(spec.devices, minors + minors):
        (node,) = device.container_edits.device_nodes
        assert (node.path, node.host_path, node.type, node.major, node.minor, node.permissions, node.file_mode) == (
            f"/dev/nvidia{minor}", str(dev / f"nvidia{minor}"), "c", 195, minor, "rwm", 0o666)
        assert device.container_edits.env == [] and device.container_edits.mounts == []
    assert [n.path for n in spec.devices[-1].container_edits.device_nodes] == [f"/dev/nvidia{m}" for m in minors]
    shared = spec.container_edits
    assert [(n.path, n.host_path, n.major, n.minor) for n in shared.device_nodes] == [
        ("/dev/nvidiactl", str(dev / "nvidiactl"), 195, 255),
        ("/dev/nvidia-uvm", str(dev / "nvidia-uvm"), 508, 0),
        ("/dev/nvidia-uvm-tools", str(dev / "nvidia-uvm-tools"), 508, 1),
        ("/dev/nvidia-modeset", str(dev / "nvidia-modeset"), 195, 254),  # the host file's default
    ]
    volume = tmp_path / "volume" / f"nvidia_{load_host_file(PCIE).driver_version}"
    assert [(m.host_path, m.container_path, m.options) for m in shared.mounts] == [
        (str(volume), "/usr/local/nvidia", ["rbind", "ro"])]
    assert volume.is_dir()  # the volume the spec mounts exists
    assert shared.env == []  # R-DR-2: no PATH, no LD_LIBRARY_PATH (and no NVIDIA_VISIBLE_DEVICES)
    [hook] = shared.hooks  # the container's own loader cache finds the volume's libraries
    assert (hook.hook_name, hook.path, hook.args) == ("createContainer", sys.executable, [
        sys.executable, "-I", HOOK_FILE, "update-ldcache", "--folder", "/usr/local/nvidia/lib64",
        "--folder", "/usr/local/nvidia/lib"])
    code, out, err = generate(capsys, tmp_path, "--host-file", PCIE, "--dev-dir", str(dev),
                              "--cdi-hook", "/usr/local/bin/gpu-isolator-cdi-hook")
    [hook] = decode_spec(out.encode(), "json").container_edits.hooks
    assert hook.path == "/usr/local/bin/gpu-isolator-cdi-hook" and hook.args[:2] == [hook.path, "update-ldcache"]
    assert document["devices"][0] == {"name": "0", "containerEdits": {"deviceNodes": [{
        "path": "/dev/nvidia0", "hostPath": str(dev / "nvidia0"), "type": "c", "major": 195, "minor": 0,
        "fileMode": 438, "permissions": "rwm"}]}}


def fake_binary_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``nvidia-smi`` of "this machine", first on PATH."""
    bin_dir = tmp_path / "host-bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho this machine\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_a_host_file_node_reads_no_fact_of_this_machine_unless_asked(capsys, tmp_path, monkeypatch) -> None:
    """No --ld-cache, no --proc-dir: the volume the spec mounts copies nothing of
    this machine -- no library from its loader cache (the suite fails a test that
    opens /etc/ld.so.cache or /proc/devices), no binary from its PATH."""
    fake_binary_on_path(tmp_path, monkeypatch)
    dev = tmp_path / "dev"
    dev.mkdir()
    argv = ["cdi", "generate", "--volume-dir", str(tmp_path / "volume"), "--host-file", PCIE, "--dev-dir", str(dev)]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    volume = tmp_path / "volume" / f"nvidia_{load_host_file(PCIE).driver_version}"
    (mount,) = decode_spec(out.encode(), "json").container_edits.mounts
    assert mount.host_path == str(volume)
    assert {name: os.listdir(volume / name) for name in ("bin", "lib", "lib64")} == {"bin": [], "lib": [], "lib64": []}
    code = cli.main([*argv, *own_fact_args(tmp_path)])  # asked: its loader cache (empty) and the search path
    out, err = capsys.readouterr()
    assert code == 0, err
    assert os.listdir(volume / "bin") == ["nvidia-smi"]
    mounts = decode_spec(out.encode(), "json").container_edits.mounts  # the binary at its usual path (R-DR-2)
    assert [(m.host_path, m.container_path, m.options) for m in mounts[1:]] == [
        (str(volume / "bin" / "nvidia-smi"), "/usr/bin/nvidia-smi", ["ro", "nosuid", "nodev", "bind"])]


def test_a_host_file_node_with_mig_devices_needs_its_proc_dir_named(capsys, tmp_path) -> None:
    code = cli.main(["cdi", "generate", "--volume-dir", str(tmp_path / "volume"), "--host-file",
                     str(REPO / "examples" / "h200-mig.toml"), "--dev-dir", "/dev"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "has MIG devices, whose capability facts come from a proc dir; this simulated node reads none of" \
           " this machine's: name one (proc_dir)" in err, err


def test_yaml_carries_the_same_spec(capsys, tmp_path) -> None:
    _, as_json, _ = generate(capsys, tmp_path, "--host-file", DGX)
    code, as_yaml, err = generate(capsys, tmp_path, "--host-file", DGX, "--format", "yaml")
    assert code == 0, err
    assert yaml.safe_load(as_yaml) == json.loads(as_json)
    assert validate_spec(decode_spec(as_yaml.encode(), "yaml")).devices[-1].name == "all"


def test_nodes_in_slash_dev_carry_no_host_path(capsys, tmp_path) -> None:
    spec, _out = spec_with_slash_dev(capsys, tmp_path, "--host-file", DGX)
    nodes = [n for d in spec.devices for n in d.container_edits.device_nodes] + spec.container_edits.device_nodes
    assert nodes and all(n.host_path is None for n in nodes)
    assert spec.cdi_version == "0.5.0"  # still: names by index start with a digit


def test_output_file_is_written_atomically_in_the_format_of_its_extension(capsys, tmp_path) -> None:
    target = tmp_path / "cdi" / "nvidia.yaml"
    target.parent.mkdir()
    code, out, err = generate(capsys, tmp_path, "--host-file", DGX, "--output", str(target))
    assert code == 0, err
    assert out.startswith(f"Wrote {target}: kind nvidia.com/gpu, cdiVersion 0.5.0, devices nvidia.com/gpu=0, ")
    assert out.rstrip().endswith("nvidia.com/gpu=all")
    spec = decode_spec(target.read_bytes(), "yaml")
    assert len(spec.devices) == 17
    assert sorted(os.listdir(target.parent)) == ["nvidia.yaml"]


@pytest.mark.parametrize("argv, needle", [
    (["--output", "x.json", "--format", "yaml"], "--format yaml does not match --output 'x.json'"),
    (["--output", "spec.txt"], "--output 'spec.txt' must end in .json or .yaml"),
    (["--format", "xml"], "argument --format: invalid choice: 'xml'"),
])
def test_bad_arguments_are_one_line_usage_errors(capsys, tmp_path, argv, needle) -> None:
    code, out, err = generate(capsys, tmp_path, "--host-file", DGX, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_missing_output_directory_is_a_clear_error(capsys, tmp_path) -> None:
    code, out, err = generate(capsys, tmp_path, "--host-file", DGX, "--output", str(tmp_path / "no" / "x.json"))
    assert code == 2 and out == ""
    assert err.strip() == (f"gpu-isolator: error: Failed to write CDI spec '{tmp_path}/no/x.json': the CDI spec"
                           f" directory '{tmp_path}/no' does not exist (create it first; container engines read"
                           " /etc/cdi and /var/run/cdi)")


def test_without_nvml_and_without_a_host_file_it_fails_clearly(capsys, tmp_path) -> None:
    if nvml_available():
        pytest.skip("this machine has a working NVML")
    code, out, err = generate(capsys, tmp_path)
    assert code == 2 and out == ""
    assert err.startswith("gpu-isolator: error: nvmlInit failed: ")
    assert err.rstrip().endswith("is the NVIDIA driver installed and loaded? Without a GPU, pass --host-file FILE"
                                 " to describe a simulated node")
    assert not (tmp_path / "volume").exists()  # nothing built for a node it could not read


def test_a_bad_host_file_is_a_clear_error(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('driver_version = "1"\n[[gpus]]\nminor = "x"\n')
    code, out, err = generate(capsys, tmp_path, "--host-file", str(bad))
    assert code == 2 and out == ""
    assert err.startswith("gpu-isolator: error: ") and str(bad) in err and "Traceback" not in err
