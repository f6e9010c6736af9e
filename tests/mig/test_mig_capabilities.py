"""R-MG-2: the capability facts of MIG devices, read from ``<proc_dir>``."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.devices import DeviceRule
from actors.gpu import Gpu
from actors.mig import MigCapabilityError, MigDevice, read_mig_capabilities

EXAMPLE_PROC = Path(__file__).resolve().parents[2] / "examples" / "h200-mig-proc"


def write_proc(root: Path, devices: str | None, minors: str | None) -> str:
    if devices is not None:
        (root / "devices").write_text(devices)
    if minors is not None:
        (root / "driver" / "nvidia-caps").mkdir(parents=True, exist_ok=True)
        (root / "driver" / "nvidia-caps" / "mig-minors").write_text(minors)
    return str(root)


def test_the_example_node_has_the_major_and_minors_of_a_real_driver():
    caps = read_mig_capabilities(str(EXAMPLE_PROC))
    assert caps.major == 239  # the nvidia-caps line, not nvidia-caps-imex-channels
    device = MigDevice(Gpu(195, 0), 3, 0)
    assert caps.cap_minors(device) == (30, 31)
    assert caps.mig_device_rules(device) == [
        DeviceRule("c", 195, 0, "rwm"), DeviceRule("c", 239, 30, "r"), DeviceRule("c", 239, 31, "r")
    ]
    assert caps.cap_node_paths(device, "/dev") == ("/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31")
    assert caps.proc_files(device) == (
        f"{EXAMPLE_PROC}/driver/nvidia/capabilities/gpu0/mig/gi3/access",
        f"{EXAMPLE_PROC}/driver/nvidia/capabilities/gpu0/mig/gi3/ci0/access",
    )
    caps.require([device, MigDevice(Gpu(195, 0), 1, 0)])


def test_two_mig_devices_of_one_gpu_share_the_parent_rule_and_nothing_else():
    caps = read_mig_capabilities(str(EXAMPLE_PROC))
    first = set(caps.mig_device_rules(MigDevice(Gpu(195, 0), 3, 0)))
    second = set(caps.mig_device_rules(MigDevice(Gpu(195, 0), 4, 0)))
    assert first & second == {DeviceRule("c", 195, 0, "rwm")}


def test_the_minor_of_the_parent_names_the_gpu_in_the_minors_file(tmp_path):
    proc = write_proc(tmp_path, "Character devices:\n508 nvidia-caps\n",
                      "gpu7/gi1/access 300\ngpu7/gi1/ci0/access 301\n")
    caps = read_mig_capabilities(proc)
    assert caps.cap_minors(MigDevice(Gpu(195, 7), 1, 0)) == (300, 301)
    with pytest.raises(KeyError):
        caps.cap_minors(MigDevice(Gpu(195, 0), 1, 0))


def test_missing_facts_are_one_error_naming_every_device_and_file(tmp_path):
    proc = write_proc(tmp_path, "Character devices:\n195 nvidia-frontend\n", "gpu0/gi1/access 12\n")
    caps = read_mig_capabilities(proc)
    assert caps.major is None
    with pytest.raises(MigCapabilityError) as error:
        caps.require([MigDevice(Gpu(195, 0), 2, 0), MigDevice(Gpu(195, 0), 1, 0)])
    assert str(error.value) == (
        f"MIG devices without capability facts in '{proc}/driver/nvidia-caps/mig-minors' and '{proc}/devices'"
        f" (2): MIG device 195:0/gi1/ci0: no 'nvidia-caps' line in '{proc}/devices', no line"
        " 'gpu0/gi1/ci0/access'; MIG device 195:0/gi2/ci0: no 'nvidia-caps' line in"
        f" '{proc}/devices', no line 'gpu0/gi2/access', no line 'gpu0/gi2/ci0/access'. Each MIG device"
        " needs its GPU- and compute-instance capability minors and the 'nvidia-caps' major (is the"
        " nvidia-caps driver loaded? on a test node, point '--proc_dir' at files of your own)"
    )
    empty = read_mig_capabilities(str(tmp_path / "absent"))
    assert empty.major is None and empty.minors == {}
    empty.require([])  # nothing needs facts: fine


@pytest.mark.parametrize(
    "devices, minors, message",
    [
        (None, "gpu0/gi1/access twelve\n", "line 1: 'gpu0/gi1/access twelve' is not '<path> <minor>'"),
        (None, "config 1\ngpu0/gi1/acces 12\n", "line 2: 'gpu0/gi1/acces' is not 'gpu<N>/gi<G>/access'"),
        (None, "gpu0/gi1/access 12\ngpu0/gi1/access 13\n", "line 2: 'gpu0/gi1/access' is listed twice (12 and 13)"),
        (None, "gpu0/gi1/access 99999999\n", "is not '<path> <minor>'"),
        ("Character devices:\n99999 nvidia-caps\n", None, "the 'nvidia-caps' line has major '99999'"),
        (None, "gpu" + "x" * 200 + " 1\n", "is not 'gpu<N>/gi<G>/access'"),
    ],
)
def test_malformed_capability_files_are_one_clear_error(tmp_path, devices, minors, message):
    proc = write_proc(tmp_path, devices, minors)
    with pytest.raises(MigCapabilityError) as error:
        read_mig_capabilities(proc)
    assert message in str(error.value)
    assert len(str(error.value)) < 300


def test_a_binary_or_huge_file_is_refused(tmp_path):
    proc = write_proc(tmp_path, None, None)
    (tmp_path / "devices").write_bytes(b"\xff\xfe" * 10)
    with pytest.raises(MigCapabilityError, match="is not ASCII text"):
        read_mig_capabilities(proc)
    (tmp_path / "devices").write_text("Character devices:\n" + "1 mem\n" * 300000)
    with pytest.raises(MigCapabilityError, match="larger than"):
        read_mig_capabilities(proc)


def test_the_example_h200_node_has_facts_for_every_mig_device():
    from actors import NvidiaGpuAllocator
    from actors.flags import Flags
    from actors.nvml import SimulatedNvml, read_inventory

    host_file = EXAMPLE_PROC.parent / "h200-mig.toml"
    flags = Flags(host_file=str(host_file), proc_dir=str(EXAMPLE_PROC), nvidia_mig_strategy="mixed")
    assert str(NvidiaGpuAllocator.resources(flags)) == "gpus:1;mig-1g.18gb:2;mig-2g.35gb:1;mig-3g.71gb:1"
    nvml = SimulatedNvml.from_file(host_file)
    nvml.init()
    inventory = read_inventory(nvml)
    read_mig_capabilities(flags.proc_dir).require(mig.device for mig in inventory.mig_devices)


def test_a_simulated_nodes_proc_dir_has_the_drivers_numbering(tmp_path):
    from actors.mig.testing import cap_minor, write_proc_dir
    from actors.nvml import load_host_file

    spec = load_host_file(Path(__file__).resolve().parents[1] / "inventory" / "data" / "h200-mig.toml")
    proc = write_proc_dir(str(tmp_path / "proc"), spec, caps_major=508)
    caps = read_mig_capabilities(proc)
    assert caps.major == 508
    assert (cap_minor(0, 0), cap_minor(0, 0, 0), cap_minor(0, 1), cap_minor(1, 0)) == (3, 4, 12, 138)
    devices = [MigDevice(Gpu(195, g.minor), m.gi, m.ci) for g in spec.gpus for m in g.mig_devices]
    caps.require(devices)
    assert caps.cap_minors(MigDevice(Gpu(195, 2), 1, 1)) == (cap_minor(2, 1), cap_minor(2, 1, 1))
    for device in devices:
        for path, minor in zip(caps.proc_files(device), caps.cap_minors(device)):
            with open(path) as handle:
                assert handle.read().splitlines()[0] == f"DeviceFileMinor: {minor}"
