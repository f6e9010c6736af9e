"""Host files and the simulated node (R-NV-1, SPEC section 4)."""

from __future__ import annotations

import pytest

from actors.gpu import Gpu
from actors.nvml.testing import nvml_library_missing
from actors.nvml import DEFAULT_CONTROL_DEVICES, EMBEDDED_HOST_FILE, TOPOLOGY_HOSTBRIDGE, TOPOLOGY_INTERNAL
from actors.nvml import TOPOLOGY_NODE, TOPOLOGY_SINGLE, TOPOLOGY_SYSTEM, HostFileError, NvmlError
from actors.nvml import NvmlNotSupported, NvmlUnavailable, SimulatedNvml, embedded_simulated_node
from actors.nvml import embedded_host_spec, load_host_file, nvml_available, open_nvml, parse_host_file
from actors.nvml import read_inventory, read_usage


def inventory_of(text: str, name: str = "node.toml"):
    nvml = SimulatedNvml.from_text(text, name)
    nvml.init()
    return read_inventory(nvml)


def test_gpu_count_shorthand_gives_plain_gpus_with_minors_by_position():
    inventory = inventory_of("gpu_count = 3")
    assert [info.gpu for info in inventory.gpus] == [Gpu(195, 0), Gpu(195, 1), Gpu(195, 2)]
    assert len({info.uuid for info in inventory.gpus}) == 3
    assert len({info.pci_bus_id for info in inventory.gpus}) == 3
    assert all(all(level in (None, TOPOLOGY_INTERNAL) for level in row) for row in inventory.topology)
    assert inventory.control_devices == DEFAULT_CONTROL_DEVICES
    assert DEFAULT_CONTROL_DEVICES == {
        "nvidiactl": "195:255", "nvidia-uvm": "235:0",
        "nvidia-uvm-tools": "235:1", "nvidia-modeset": "195:254",
    }
    assert inventory_of("gpu_count = 0").gpus == []


def test_dgx_example_has_two_nvlink_islands(data_dir):
    spec = load_host_file(data_dir / "dgx8-nvlink.toml")
    assert len(spec.gpus) == 8
    for gpu in spec.gpus:
        island = range(0, 4) if gpu.index < 4 else range(4, 8)
        assert gpu.nvlink == {peer: 6 for peer in island if peer != gpu.index}
    assert spec.topology_level(0, 1) == TOPOLOGY_SINGLE
    assert spec.topology_level(0, 2) == TOPOLOGY_HOSTBRIDGE
    assert spec.topology_level(0, 4) == TOPOLOGY_SYSTEM


def test_pcie_example_and_json_host_file(data_dir):
    inventory = read_inventory(open_nvml(data_dir / "pcie4.toml"))
    assert [info.name for info in inventory.gpus] == ["NVIDIA RTX A6000"] * 4
    assert inventory.gpus[2].pci_bus_id == "00000000:B1:00.0"  # normalised as NVML prints it
    assert all(info.nvlink == {} for info in inventory.gpus)
    assert inventory.control_devices["nvidia-uvm"] == "508:0"
    assert inventory.control_devices["nvidiactl"] == "195:255"  # default kept
    mixed = read_inventory(open_nvml(str(data_dir / "mixed.json")))
    assert [info.minor for info in mixed.gpus] == [3, 1, 7, 0]
    assert mixed.level(0, 1) == TOPOLOGY_INTERNAL  # same board
    assert mixed.level(2, 3) == TOPOLOGY_NODE and mixed.gpus[2].nvlink == {3: 12}
    assert mixed.gpus[2].mig is True and mixed.driver_version == "470.223.02"


def test_embedded_node_is_valid_and_never_stands_in_for_a_missing_driver():
    assert "[[gpus]]" in EMBEDDED_HOST_FILE
    assert len(embedded_host_spec().gpus) == 8
    assert len(read_inventory(embedded_simulated_node()).gpus) == 8
    with nvml_library_missing():
        with pytest.raises(NvmlUnavailable) as caught:
            open_nvml(None)  # no host file: the real NVML or an error, never the embedded node
    assert str(caught.value) == (
        "nvmlInit failed: NVML Shared Library Not Found (NVML_ERROR_LIBRARY_NOT_FOUND); is the NVIDIA"
        " driver installed and loaded? Without one, set '--host_file' (Flags.host_file) to a host file"
        " to use a simulated node"
    )


@pytest.mark.parametrize(
    ("text", "field", "problem"),
    [
        ("gpu_count = [", "", "not valid TOML"),
        ("gpu_count = 'two'", "gpu_count", "expected `int`, got 'two'"),
        ("gpu_count = 1000000", "gpu_count", "<= 1024, got 1000000"),
        ("gpu_count = -2", "gpu_count", ">= 0, got -2"),
        ("[[gpus]]\nminor = -1", "gpus[0].minor", ">= 0, got -1"),
        ("[[gpus]]\nminor = 1\n[[gpus]]\nminor = 1", "gpus[1].minor", "minor 1 is already used by gpus[0]"),
        ("[[gpus]]\nminor = 255", "gpus[0].minor", "minor 255 is the control device 'nvidiactl'"),
        ("[[gpus]]\nminr = 1", "gpus[0].minr", "unknown key 'minr'"),
        ("gpu_count = 1\ncolour = 'red'", "colour", "unknown key 'colour'"),
        ("[[gpus]]\nuuid = 'GPU-a'\n[[gpus]]\nuuid = 'GPU-a'", "gpus[1].uuid", "already used by gpus[0]"),
        ("[[gpus]]\npci_bus_id = 'bus 3'", "gpus[0].pci_bus_id", "expected a PCI bus id"),
        ("[[gpus]]\npci_bus_id = '0:3:0.0'\n[[gpus]]\npci_bus_id = '00000000:03:00.0'",
         "gpus[1].pci_bus_id", "already used by gpus[0]"),
        ("[[gpus]]\nnvlink = { '3' = 2 }", "gpus[0].nvlink", "peer 3 is not a GPU index"),
        ("[[gpus]]\nnvlink = { '0' = 2 }", "gpus[0].nvlink", "cannot have NVLink links to itself"),
        ("[[gpus]]\nnvlink = { '1' = 2 }\n[[gpus]]\nnvlink = { '0' = 3 }", "gpus[1].nvlink", "but gpus[0].nvlink says 2"),
        ("[[gpus]]\nnvlink = { '1' = 0 }\n[[gpus]]", "gpus[0].nvlink", ">= 1"),
        ("[[gpus]]\nnvlink = { x = 1 }", "gpus[0].nvlink", "expected `int`"),
        ("[[gpus]]\nmemory_total_mib = 'lots'", "gpus[0].memory_total_mib", "got 'lots'"),
        ("[[gpus]]\nmemory_total_mib = 10\nmemory_used_mib = 20", "gpus[0].memory_used_mib", "more than"),
        ("gpu_count = 1\n[control_devices]\nnvidiactl = '195'", "control_devices.nvidiactl", "expected 'major:minor'"),
        ("gpu_count = 1\n[[gpus]]", "gpu_count", "not both"),
        ("driver_version = '1.0'", "gpus", "missing"),
    ],
)
def test_malformed_host_files_get_one_clear_error_naming_the_field(text, field, problem):
    with pytest.raises(HostFileError) as caught:
        parse_host_file(text, "node.toml")
    message = str(caught.value)
    assert message.startswith("Invalid host file 'node.toml':")
    assert f" {field}:" in message if field else True
    assert problem in message
    assert "\n" not in message


def test_too_many_nvlinks_and_gpus_are_rejected():
    peers = "\n".join("[[gpus]]" for _ in range(3))
    with pytest.raises(HostFileError, match=r"gpus\[0\].nvlink: 20 NVLink links in all, more than a GPU has \(18\)"):
        parse_host_file("[[gpus]]\nnvlink = { '1' = 10, '2' = 10 }\n" + peers, "n.toml")
    with pytest.raises(HostFileError, match=r"gpus: expected `array` of length <= 1024"):
        parse_host_file('{"gpus": [' + ",".join(["{}"] * 1025) + "]}", "n.json")


def test_bad_json_and_unreadable_files(tmp_path):
    with pytest.raises(HostFileError, match="not valid JSON"):
        parse_host_file('{"gpu_count": }', "node.json")
    with pytest.raises(HostFileError, match=r"Invalid host file 'node.json': gpus\[0\].name: expected `str"):
        parse_host_file('{"gpus": [{"name": 7}]}', "node.json")
    with pytest.raises(HostFileError, match="Cannot read host file"):
        load_host_file(tmp_path / "absent.toml")
    with pytest.raises(HostFileError):
        SimulatedNvml.from_file(tmp_path / "absent.toml")


def test_simulated_node_behaves_like_nvml():
    nvml = SimulatedNvml.from_text(
        "[[gpus]]\nminor = 4\npower_mw = 50000\ntemperature_c = 40\nmemory_used_mib = 100\n[[gpus]]"
    )
    with pytest.raises(NvmlError, match=r"nvmlDeviceGetCount_v2 failed: Uninitialized \(NVML_ERROR_UNINITIALIZED\)"):
        nvml.device_count()
    nvml.init()
    assert nvml.device_count() == 2 and nvml.minor(nvml.handle(0)) == 4
    with pytest.raises(NvmlError, match="NVML_ERROR_INVALID_ARGUMENT"):
        nvml.handle(2)
    with pytest.raises(NvmlNotSupported):
        nvml.power_mw(nvml.handle(1))
    with pytest.raises(NvmlNotSupported):
        nvml.topology_level(0, 1)  # no topology facts
    usage = read_usage(nvml, [(0, Gpu(195, 4)), (1, Gpu(195, 1))])
    assert usage[0].power_mw == 50000 and usage[0].temperature_c == 40
    assert usage[0].memory_used_bytes == 100 * 1024 * 1024
    assert usage[1].power_mw is None and usage[1].temperature_c is None
    nvml.set_usage(1, utilization_gpu=90)
    assert nvml.utilization(1).gpu == 90
    nvml.fail("nvmlDeviceGetMinorNumber", 15)
    with pytest.raises(NvmlError, match=r"nvmlDeviceGetMinorNumber failed: GPU is lost.*GPU index 0"):
        read_inventory(nvml)
    nvml.fail("nvmlDeviceGetMinorNumber", None)
    assert len(read_inventory(nvml).gpus) == 2


def test_simulated_node_delivers_health_events_as_nvml_does():
    nvml = SimulatedNvml.from_text(
        '[[gpus]]\n[[gpus]]\nsupported_events = ["xid"]\n[[gpus]]\nsupported_events = []\n'
    )
    nvml.init()
    assert [nvml.supported_event_types(i) for i in range(3)] == [0xA, 0x8, 0]
    assert nvml.inject_xid(0, 79) == 0  # no event set yet: the event is lost, as in NVML
    event_set = nvml.event_set_create()
    nvml.register_events(0, 0x8 | 0x2, event_set)
    nvml.register_events(1, 0x8, event_set)
    with pytest.raises(NvmlNotSupported, match="nvmlDeviceRegisterEvents failed: Not Supported"):
        nvml.register_events(1, 0x8 | 0x2, event_set)  # ECC is not supported: nothing registered
    with pytest.raises(NvmlNotSupported):
        nvml.register_events(2, 0x8, event_set)
    assert nvml.event_set_wait(event_set, 0) is None  # timeout
    assert nvml.inject_xid(1, 79) == 1
    assert nvml.inject_xid(0, 13) == 1
    assert nvml.inject_ecc(0) == 1
    assert nvml.inject_ecc(1) == 0  # registered for Xids only
    assert nvml.inject_xid(2, 79) == 0  # registered for nothing
    events = [nvml.event_set_wait(event_set, 0) for _ in range(4)]
    assert [(e.index, e.kind, e.code, e.describe()) for e in events[:3]] == [
        (1, "xid", 79, "Xid 79"), (0, "xid", 13, "Xid 13"), (0, "ecc", 0, "double-bit ECC error"),
    ]
    assert events[3] is None
    with pytest.raises(ValueError, match="No GPU with index 5"):
        nvml.inject_xid(5, 79)
    nvml.fail("nvmlEventSetWait_v2", 999)
    with pytest.raises(NvmlError, match=r"^nvmlEventSetWait_v2 failed: Unknown Error \(NVML_ERROR_UNKNOWN\)$"):
        nvml.event_set_wait(event_set, 0)
    nvml.fail("nvmlEventSetWait_v2", None)
    nvml.event_set_free(event_set)
    with pytest.raises(NvmlError, match="Invalid Argument"):
        nvml.event_set_wait(event_set, 0)  # a freed set
