"""The grant as engines take it (R-CD-3): ``container_grant``,
``ContainerLaunchInfo.to_oci()`` and ``merge_oci``, and the one-device
container spec rendered from the same grant (R-CD-1, R-CD-2)."""

from __future__ import annotations

import copy

import pytest

from actors import Gpu
from actors.devices import DeviceRule
from isolators import ContainerID, ContainerLaunchInfo
from isolators.cdi import CONTAINER_KIND, container_device_name, container_grant, container_spec, encode_spec
from isolators.cdi import DriverInjection, merge_oci, spec_extras, validate_spec
from isolators import ContainerBindMount

UUIDS = {Gpu.nvidia(i): f"GPU-{i:04d}" for i in range(4)}
CONTROL = {"/tmp/dev/nvidiactl": DeviceRule("c", 195, 255, "rwm"), "/tmp/dev/nvidia-uvm": DeviceRule("c", 235, 0, "rwm")}
VOLUME = ContainerBindMount(host_path="/var/run/gpu-isolator/volume/nvidia_550.54.15", container_path="/usr/local/nvidia")
VOLUME_ENV = {"PATH": "/usr/bin:/usr/local/nvidia/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}


def test_grant_holds_exactly_the_gpus_then_the_control_devices() -> None:
    grant = container_grant({Gpu.nvidia(3), Gpu.nvidia(1)}, UUIDS, CONTROL, "/tmp/dev")
    assert [(d.path, d.host_path, d.type, d.major, d.minor, d.permissions, d.file_mode) for d in grant.devices] == [
        ("/dev/nvidia1", "/tmp/dev/nvidia1", "c", 195, 1, "rwm", 0o666),
        ("/dev/nvidia3", "/tmp/dev/nvidia3", "c", 195, 3, "rwm", 0o666),
        ("/dev/nvidiactl", "/tmp/dev/nvidiactl", "c", 195, 255, "rwm", 0o666),
        ("/dev/nvidia-uvm", "/tmp/dev/nvidia-uvm", "c", 235, 0, "rwm", 0o666),
    ]
    assert grant.environment == {"NVIDIA_VISIBLE_DEVICES": "GPU-0001,GPU-0003"}
    assert grant.mounts == ()
    none = container_grant(set(), UUIDS, CONTROL, "/tmp/dev")
    assert none.environment == {"NVIDIA_VISIBLE_DEVICES": "none"}
    assert [d.path for d in none.devices] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    with pytest.raises(ValueError, match=r"No UUID known for GPUs \['195:9'\]"):
        container_grant({Gpu.nvidia(9)}, UUIDS, CONTROL, "/tmp/dev")


def test_to_oci_renders_the_grant_with_exact_rules_only() -> None:
    grant = container_grant({Gpu.nvidia(0), Gpu.nvidia(2)}, UUIDS, CONTROL, "/tmp/dev",
                            volume=VOLUME, volume_env=VOLUME_ENV)
    info = ContainerLaunchInfo(grant=grant, environment={"PATH": "/usr/bin:/usr/local/nvidia/bin"})
    fragment = info.to_oci()
    assert fragment == {
        "process": {"env": [
            "PATH=/usr/bin:/usr/local/nvidia/bin",
            "NVIDIA_VISIBLE_DEVICES=GPU-0000,GPU-0002",
            "LD_LIBRARY_PATH=/usr/local/nvidia/lib64",
        ]},
        "mounts": [{"destination": "/usr/local/nvidia", "type": "bind",
                    "source": "/var/run/gpu-isolator/volume/nvidia_550.54.15", "options": ["rbind", "ro"]}],
        "linux": {
            "devices": [
                {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666, "uid": 0, "gid": 0},
                {"path": "/dev/nvidia2", "type": "c", "major": 195, "minor": 2, "fileMode": 0o666, "uid": 0, "gid": 0},
                {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 0o666, "uid": 0,
                 "gid": 0},
                {"path": "/dev/nvidia-uvm", "type": "c", "major": 235, "minor": 0, "fileMode": 0o666, "uid": 0,
                 "gid": 0},
            ],
            "resources": {"devices": [
                {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"},
                {"allow": True, "type": "c", "major": 195, "minor": 2, "access": "rwm"},
                {"allow": True, "type": "c", "major": 195, "minor": 255, "access": "rwm"},
                {"allow": True, "type": "c", "major": 235, "minor": 0, "access": "rwm"},
            ]},
        },
    }
    for rule in fragment["linux"]["resources"]["devices"]:  # never a wildcard
        assert rule["allow"] is True and rule["major"] is not None and rule["minor"] is not None


def test_to_oci_of_a_launch_info_without_grant_is_an_empty_fragment() -> None:
    assert ContainerLaunchInfo().to_oci() == {
        "process": {"env": []}, "mounts": [], "linux": {"devices": [], "resources": {"devices": []}}}


def test_task_environment_and_grant_win_in_that_order() -> None:
    grant = container_grant(set(), UUIDS, {}, "/dev")
    info = ContainerLaunchInfo(environment={"A": "1", "NVIDIA_VISIBLE_DEVICES": "all"},
                               task_environment={"A": "2"}, grant=grant)
    assert info.to_oci()["process"]["env"] == ["A=2", "NVIDIA_VISIBLE_DEVICES=none"]


RUNC_SPEC = {
    "process": {"env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
                "args": ["sh"]},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
               {"destination": "/usr/local/nvidia", "type": "bind", "source": "/old", "options": ["rbind"]}],
    "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]},
              "devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 7}],
              "namespaces": [{"type": "pid"}]},
}


def test_merge_oci_replaces_by_key_and_appends_rules_after_the_deny_all() -> None:
    grant = container_grant({Gpu.nvidia(0)}, UUIDS, CONTROL, "/tmp/dev", volume=VOLUME, volume_env=VOLUME_ENV)
    before = copy.deepcopy(RUNC_SPEC)
    fragment = ContainerLaunchInfo(grant=grant).to_oci()
    merged = merge_oci(RUNC_SPEC, fragment)
    assert RUNC_SPEC == before  # inputs untouched
    assert merged["process"]["env"] == [
        "PATH=/usr/bin:/usr/local/nvidia/bin", "TERM=xterm", "NVIDIA_VISIBLE_DEVICES=GPU-0000",
        "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]
    assert merged["process"]["args"] == ["sh"]
    assert [m["destination"] for m in merged["mounts"]] == ["/proc", "/usr/local/nvidia"]
    assert merged["mounts"][1]["source"] == VOLUME.host_path
    assert [(d["path"], d["minor"]) for d in merged["linux"]["devices"]] == [
        ("/dev/nvidia0", 0), ("/dev/nvidiactl", 255), ("/dev/nvidia-uvm", 0)]
    rules = merged["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert rules[1:] == fragment["linux"]["resources"]["devices"]
    assert merged["linux"]["namespaces"] == [{"type": "pid"}]
    assert merge_oci(merged, fragment) == merged  # merging twice changes nothing
    assert merge_oci({}, ContainerLaunchInfo().to_oci()) == {}


def test_the_container_spec_is_one_device_from_the_same_grant() -> None:
    cid = ContainerID("train")
    grant = container_grant({Gpu.nvidia(0), Gpu.nvidia(1)}, UUIDS, CONTROL, "/tmp/dev",
                            volume=VOLUME, volume_env=VOLUME_ENV)
    injection = DriverInjection(program=("/opt/hook",), binaries=("nvidia-smi",))
    spec = validate_spec(container_spec(container_device_name(cid), grant, injection))
    assert spec.kind == CONTAINER_KIND and spec.cdi_version == "0.5.0"  # hostPath differs from path
    assert spec.qualified_names() == ["gpu-isolator/container=train"]
    (device,) = spec.devices
    edits = device.container_edits
    assert edits.env == ["NVIDIA_VISIBLE_DEVICES=GPU-0000,GPU-0001"]  # R-DR-2: never PATH or LD_LIBRARY_PATH
    assert [(n.path, n.host_path, n.major, n.minor, n.permissions) for n in edits.device_nodes] == [
        (d.path, d.host_path, d.major, d.minor, "rwm") for d in grant.devices]
    assert [(m.host_path, m.container_path, m.options) for m in edits.mounts] == [
        (VOLUME.host_path, "/usr/local/nvidia", ["rbind", "ro"]),
        (f"{VOLUME.host_path}/bin/nvidia-smi", "/usr/bin/nvidia-smi", ["ro", "nosuid", "nodev", "bind"])]
    assert [(h.hook_name, h.path, h.args) for h in edits.hooks] == [("createContainer", "/opt/hook", [
        "/opt/hook", "update-ldcache", "--folder", "/usr/local/nvidia/lib64", "--folder", "/usr/local/nvidia/lib"])]
    assert spec.container_edits is None
    encode_spec(spec)
    with pytest.raises(ValueError, match="needs its DriverInjection"):
        container_spec("train", grant)
    assert ContainerLaunchInfo(grant=grant).to_oci()["process"]["env"] == [  # the Mesos rendering keeps them
        "NVIDIA_VISIBLE_DEVICES=GPU-0000,GPU-0001", "PATH=/usr/bin:/usr/local/nvidia/bin",
        "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]


def test_container_spec_declares_0_3_0_when_nodes_are_in_dev_and_the_name_starts_with_a_letter() -> None:
    grant = container_grant({Gpu.nvidia(0)}, UUIDS, {"/dev/nvidiactl": DeviceRule("c", 195, 255, "rwm")}, "/dev")
    spec = container_spec("c1", grant)
    assert spec.cdi_version == "0.3.0"
    assert all(node.host_path is None for node in spec.devices[0].container_edits.device_nodes)
    assert container_spec("4b1c", grant).cdi_version == "0.5.0"


def test_spec_extras_read_back_the_volume() -> None:
    grant = container_grant({Gpu.nvidia(1)}, UUIDS, CONTROL, "/tmp/dev", volume=VOLUME, volume_env=VOLUME_ENV)
    injection = DriverInjection(program=("/opt/hook",), binaries=("nvidia-smi",))
    mounts, env = spec_extras(container_spec("c1", grant, injection))
    assert mounts == (VOLUME,) and env == {}  # the binaries' mounts are the injection's; no env in a spec
    again = container_grant({Gpu.nvidia(1), Gpu.nvidia(2)}, UUIDS, CONTROL, "/tmp/dev", volume=mounts[0],
                            volume_env=env)
    assert again.mounts == grant.mounts
    assert spec_extras(container_spec("c1", container_grant(set(), UUIDS, CONTROL, "/dev"))) == ((), {})
