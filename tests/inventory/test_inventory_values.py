"""Gpu, Resources and Flags: the values the GPU inventory trades in."""

from __future__ import annotations

import json

import msgspec
import pytest

from actors.flags import DEFAULT_ISOLATION, Flags, FlagsError, parse_duration
from actors.gpu import NVIDIA_MAJOR, Gpu, GpuInfo
from actors.resources import Resources, ResourcesError

# ------------------------------------------------------------------ Gpu


def test_gpu_is_a_frozen_ordered_hashable_device_number():
    assert NVIDIA_MAJOR == 195
    a, b, c = Gpu(195, 1), Gpu(195, 0), Gpu(10, 9)
    assert sorted([a, b, c]) == [c, b, a]
    assert Gpu(195, 1) == a and hash(Gpu(195, 1)) == hash(a)
    assert len({a, Gpu(195, 1), b}) == 2
    with pytest.raises(AttributeError):
        a.minor = 3  # type: ignore[misc]
    assert str(a) == "195:1" and Gpu.parse("195:1") == a and Gpu.parse("195.1") == a
    assert Gpu.nvidia(4) == Gpu(195, 4)
    with pytest.raises(ValueError, match="Invalid GPU 'x'"):
        Gpu.parse("x")


def test_gpu_round_trips_through_msgspec():
    data = msgspec.json.encode(Gpu(195, 3))
    assert json.loads(data) == {"major": 195, "minor": 3}
    assert msgspec.json.decode(data, type=Gpu) == Gpu(195, 3)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"major": 195, "minor": -1}', type=Gpu)


def test_gpu_info_hangs_richer_facts_off_the_identity():
    info = GpuInfo(index=2, gpu=Gpu(195, 7), uuid="GPU-x", name="A100", pci_bus_id="00000000:07:00.0",
                   memory_total_mib=40960, nvlink={3: 12})
    assert info.minor == 7 and info.nvlink == {3: 12} and info.numa_node is None
    assert msgspec.json.decode(msgspec.json.encode(info), type=GpuInfo) == info


# ------------------------------------------------------------------ Resources


def test_resources_parse_the_agent_text_form():
    r = Resources.parse("cpus:1;mem:128;gpus:2")
    assert r.gpus() == 2.0 and r.get("cpus") == 1.0 and r.get("disk") is None
    assert str(r) == "cpus:1;mem:128;gpus:2"
    assert Resources.parse(str(r)) == r
    assert Resources.parse("gpus:2;cpus:1") == Resources.parse(" cpus : 1 ; gpus:2 ;")
    assert Resources.parse("cpus:1").gpus() is None
    assert Resources.parse("gpus:0").gpus() == 0.0 and "gpus" in Resources.parse("gpus:0")
    assert Resources.parse("") == Resources() and not Resources()


def test_resources_add_repeated_scalars_and_keep_ranges_and_roles():
    r = Resources.parse("cpus:1;cpus:0.5;ports:[31000-32000];gpus(*):2")
    assert r.get("cpus") == 1.5 and r.gpus() == 2.0
    assert r.others == {"ports": "[31000-32000]"}
    assert r.filter(["gpus"]) == Resources.parse("gpus:2")
    assert Resources.parse("gpus:0.3333333").gpus() == 0.333  # Mesos' three decimals


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus", "Bad value for resources, missing or extra ':' in gpus"),
        ("cpus:1;gpus:1:2", "Bad value for resources, missing or extra ':' in gpus:1:2"),
        ("gpus:abc", "Bad value for resource 'gpus' in 'gpus:abc': 'abc' is not a number"),
        ("gpus:nan", "Bad value for resource 'gpus' in 'gpus:nan': 'nan' is not a finite number"),
        ("gpus:inf", "'inf' is not a finite number"),
        ("gpus:-1", "Bad value for resource 'gpus' in 'gpus:-1': '-1' is negative"),
        ("gpus:", "Bad value for resource 'gpus': empty value in 'gpus:'"),
        (":2", "missing resource name in ':2'"),
        ("gpus(x:2", "mismatched parentheses in gpus(x:2"),
        ("ports:[1-2", "unterminated '['"),
    ],
)
def test_malformed_resources_name_the_entry(text, message):
    with pytest.raises(ResourcesError) as caught:
        Resources.parse(text)
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_resources_cross_msgspec_and_coerce_from_text():
    r = Resources.parse("cpus:1;gpus:2")
    assert msgspec.json.decode(msgspec.json.encode(r), type=Resources) == r

    class Config(msgspec.Struct):
        resources: Resources | str

    decoded = msgspec.convert({"resources": "gpus:3"}, Config)
    assert Resources.coerce(decoded.resources).gpus() == 3.0
    assert Resources.coerce(msgspec.convert({"resources": msgspec.to_builtins(r)}, Config).resources) == r
    assert Resources.coerce({"gpus": 1}) == Resources.parse("gpus:1")
    with pytest.raises(ResourcesError, match="expected a number"):
        Resources.coerce({"gpus": "x"})


# ------------------------------------------------------------------ Flags


def test_flags_defaults_follow_mesos_and_the_spec():
    flags = Flags()
    assert flags.isolation == DEFAULT_ISOLATION == "filesystem/linux,cgroups/devices,gpu/nvidia"
    assert flags.isolators() == ["filesystem/linux", "cgroups/devices", "gpu/nvidia"]
    assert flags.resources is None and flags.nvidia_gpu_devices is None
    assert flags.cgroups_root == "gpu-isolator" and flags.dev_dir == "/dev"
    assert flags.device_backend == "auto" and flags.host_file is None
    assert flags.reconcile_interval is None and flags.gpu_allocation == "topology"
    assert flags.runtime_dir and flags.work_dir and flags.volume_dir


def test_flags_from_args_take_dashes_or_underscores():
    flags = Flags.from_args([
        "--isolation=cgroups/devices,gpu/nvidia",
        "--nvidia-gpu-devices=0,1",
        "--resources", "cpus:2;gpus:2",
        "--host_file=/tmp/node.toml",
        "--device-backend=memory",
        "--reconcile_interval=30secs",
        "--cgroups_root=mesos/gpu",
    ])
    assert flags.nvidia_gpu_devices == [0, 1]
    assert flags.resources == "cpus:2;gpus:2" and flags.host_file == "/tmp/node.toml"
    assert flags.device_backend == "memory" and flags.reconcile_interval == 30.0
    assert flags.cgroups_root == "mesos/gpu"
    assert Flags.from_args(["--reconcile_interval=500ms"]).reconcile_interval == 0.5
    assert parse_duration("2mins") == 120.0
    assert Flags().nvidia_usage_max_age == 1.0  # NVML's own longest utilisation sample
    assert Flags.from_args(["--nvidia_usage_max_age=250ms"]).nvidia_usage_max_age == 0.25
    assert Flags.from_args(["--nvidia_usage_max_age=0"]).nvidia_usage_max_age == 0.0  # read every time
    assert Flags().nvidia_health_backoff == 1.0
    assert Flags.from_args(["--nvidia_health_backoff=50ms"]).nvidia_health_backoff == 0.05


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus=1"], "Failed to load unknown flag 'bogus'"),
        (["isolation=x"], "expected '--name=value'"),
        (["--nvidia_gpu_devices=0,x"], "'x' in '0,x' is not a non-negative integer"),
        (["--nvidia_gpu_devices=-1"], "not a non-negative integer"),
        (["--device_backend=cgroups_v3"], "Invalid '--device_backend' 'cgroups_v3': expected one of auto,"),
        (["--cgroups_root=../escape"], "Invalid '--cgroups_root' '../escape'"),
        (["--cgroups_root=/abs"], "it must be a relative path"),
        (["--cgroups_root=a//b"], "every component must be a plain name"),
        (["--cgroups_root="], "Invalid '--cgroups_root': it must not be empty"),
        (["--reconcile_interval=soon"], "Failed to load flag 'reconcile_interval': Invalid duration 'soon'"),
        (["--reconcile_interval=0"], "Invalid '--reconcile_interval' 0.0"),
        (["--resources"], "Failed to load flag 'resources': missing value"),
        (["--nvidia_usage_max_age=2hrs"], "Invalid '--nvidia_usage_max_age' 7200.0: expected seconds, from 0"),
        (["--nvidia_usage_max_age=soon"], "Failed to load flag 'nvidia_usage_max_age': Invalid duration 'soon'"),
        (["--nvidia_health_backoff=0"], "Invalid '--nvidia_health_backoff' 0.0: expected seconds, more than 0 and at"
                                        " most 30"),
        (["--nvidia_health_backoff=1mins"], "Invalid '--nvidia_health_backoff' 60.0: expected seconds, more than 0"),
        (["--nvidia_health_backoff=soon"], "Failed to load flag 'nvidia_health_backoff': Invalid duration 'soon'"),
        (["--cdi_hook=bin/hook"], "Invalid '--cdi_hook' 'bin/hook': expected the absolute path of a program on the"
                                  " host"),
    ],
)
def test_bad_flags_are_clear_errors(args, message):
    with pytest.raises(FlagsError) as caught:
        Flags.from_args(args)
    assert message in str(caught.value)


def test_flags_validate_on_direct_construction():
    with pytest.raises(FlagsError, match="cgroups_root"):
        Flags(cgroups_root="a/../b")
    with pytest.raises(FlagsError, match="device_backend"):
        Flags(device_backend="nope")  # type: ignore[arg-type]
    assert Flags().replace(resources="gpus:1").resources == "gpus:1"


def test_flags_from_toml_and_json_files(tmp_path):
    toml = tmp_path / "flags.toml"
    toml.write_text('isolation = "gpu/nvidia"\nnvidia-gpu-devices = [0, 2]\nresources = "gpus:2"\n')
    assert Flags.from_file(toml).nvidia_gpu_devices == [0, 2]
    js = tmp_path / "flags.json"
    js.write_text(json.dumps({"nvidia_gpu_devices": "1,3", "device_backend": "memory"}))
    flags = Flags.from_file(js)
    assert flags.nvidia_gpu_devices == [1, 3] and flags.device_backend == "memory"
    bad = tmp_path / "bad.toml"
    bad.write_text("isolation = [")
    with pytest.raises(FlagsError, match="is not valid TOML"):
        Flags.from_file(bad)
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"gpus": 2}')
    with pytest.raises(FlagsError, match="Failed to load unknown flag 'gpus'"):
        Flags.from_file(unknown)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"host_file": 3}')
    with pytest.raises(FlagsError, match="Failed to load flag 'host_file' with value 3: Expected `str"):
        Flags.from_file(wrong)
    with pytest.raises(FlagsError, match="Failed to read flags file"):
        Flags.from_file(tmp_path / "missing.toml")
