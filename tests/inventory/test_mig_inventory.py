"""R-MG-1: MIG devices in the NVML port, the host file and the inventory.

The same host file read by the simulated node and by the real ``pynvml``
bindings over the fake NVML (tests/native/fake_nvml.c) gives the same MIG
inventory; the bindings name profiles as the driver does, and fall back to
NVIDIA's rounding when the driver cannot name them.
"""

from __future__ import annotations

import msgspec
import pytest

from actors.gpu import Gpu
from actors.mig import MigDevice
from actors.nvml import HostFileError, NvmlError, NvmlNotSupported, SimulatedNvml, load_host_file
from actors.nvml import read_inventory, read_usage

from .test_fake_nvml_bindings import simulated  # the simulated node as the probe reports the bindings


def test_h200_balanced_layout_is_read_with_ids_uuids_profiles_and_memory(data_dir):
    nvml = SimulatedNvml.from_file(data_dir / "h200-mig.toml")
    nvml.init()
    inventory = read_inventory(nvml)
    assert [g.mig for g in inventory.gpus] == [True, False, True, True]
    of_gpu0 = inventory.mig_devices_of(0)
    assert [(m.index, m.gi, m.ci, m.profile, m.memory_total_mib) for m in of_gpu0] == [
        (0, 3, 0, "1g.18gb", 16896),
        (1, 4, 0, "1g.18gb", 16896),
        (2, 2, 0, "2g.35gb", 33792),
        (3, 1, 0, "3g.71gb", 71424),
    ]
    assert of_gpu0[0].uuid == "MIG-0f8b2f6c-1a11-5b2e-9c21-000000000003"
    assert all(m.uuid.startswith("MIG-") for m in inventory.mig_devices)
    assert len({m.uuid for m in inventory.mig_devices}) == len(inventory.mig_devices) == 6
    assert [m.device for m in inventory.mig_devices_of(2)] == [
        MigDevice(Gpu(195, 2), 1, 0), MigDevice(Gpu(195, 2), 1, 1)
    ]
    assert inventory.mig_devices_of(2)[0].profile == "1c.3g.71gb"
    assert inventory.mig_devices_of(3) == [] and inventory.mig_devices_of(1) == []
    assert inventory.by_mig()[MigDevice(Gpu(195, 0), 2, 0)].resource_name == "mig-2g.35gb"


def test_mig_handles_answer_as_nvml_does(data_dir):
    nvml = SimulatedNvml.from_file(data_dir / "h200-mig.toml")
    nvml.init()
    gpu = nvml.handle(0)
    assert nvml.max_mig_device_count(gpu) == 7
    mig = nvml.mig_device_handle(gpu, 1)
    assert (nvml.gpu_instance_id(mig), nvml.compute_instance_id(mig)) == (4, 0)
    assert nvml.mig_parent_handle(mig) == gpu
    assert nvml.memory(mig).used == 1024 * 1024 * 1024
    for call in (nvml.utilization, nvml.power_mw, nvml.temperature_c):
        with pytest.raises(NvmlNotSupported):
            call(mig)
    with pytest.raises(NvmlError) as empty:
        nvml.mig_device_handle(gpu, 4)
    assert empty.value.code == 6  # NVML_ERROR_NOT_FOUND: an empty slot
    with pytest.raises(NvmlError) as not_a_gpu:
        nvml.minor(mig)
    assert not_a_gpu.value.code == 2
    with pytest.raises(NvmlNotSupported):
        nvml.max_mig_device_count(nvml.handle(1))  # MIG mode off
    usage = read_usage(nvml, [(0, Gpu(195, 0))])
    assert usage[0].utilization_gpu_percent == 0  # the whole GPU still answers


def test_bindings_over_the_fake_nvml_report_the_same_mig_inventory(probe, data_dir):
    path = data_dir / "h200-mig.toml"
    config = probe.config(load_host_file(path))
    [result] = probe.run([{"op": "inventory", "config": config}])
    assert "error" not in result, result
    for key in ("kind", "source", "control_devices"):
        result["inventory"].pop(key)
    assert result == simulated(path)
    assert [m["profile"] for m in result["inventory"]["mig_devices"]] == [
        "1g.18gb", "1g.18gb", "2g.35gb", "3g.71gb", "1c.3g.71gb", "1c.3g.71gb"
    ]


def test_bindings_name_profiles_from_attributes_when_the_driver_cannot(probe, data_dir):
    path = data_dir / "h200-mig.toml"
    config = probe.config(load_host_file(path))
    results = probe.run([
        {"op": "inventory", "config": config, "fail_after_init": "nvmlDeviceGetGpuInstanceProfileInfoV=13"},
        {"op": "inventory", "config": config, "fail_after_init": "nvmlDeviceGetGpuInstanceById=4"},
        {"op": "inventory", "config": config, "fail_after_init": "nvmlDeviceGetGpuInstanceId=999"},
    ])
    for result in results[:2]:
        assert "error" not in result, result
        assert [m["profile"] for m in result["inventory"]["mig_devices"]] == [
            "1g.18gb", "1g.18gb", "2g.35gb", "3g.71gb", "1c.3g.71gb", "1c.3g.71gb"
        ]
    assert results[2]["error"]["type"] == "NvmlError"
    assert results[2]["error"]["function"] == "nvmlDeviceGetGpuInstanceId"
    assert "GPU index 0" in results[2]["error"]["message"]


HOST_ERRORS = [
    ("mig_devices = [{gi = 1, ci = 0, profile = '1g.18gb'}]", "gpus[0].mig_devices",
     "MIG devices are listed but 'mig' is not true (MIG mode is off)"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1g18gb'}]", "gpus[0].mig_devices[0].profile",
     "invalid MIG profile '1g18gb': expected '<G>g.<GB>gb' such as '1g.18gb'"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '4c.2g.20gb'}]", "gpus[0].mig_devices[0].profile",
     "a compute instance of 4 slices cannot be larger than its GPU instance of 2"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1g.5gb'}, {gi = 1, ci = 0, profile = '1g.5gb'}]",
     "gpus[0].mig_devices[1]", "gi 1 ci 0 is already gpus[0].mig_devices[0]"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1c.2g.10gb'}, {gi = 1, ci = 1, profile = '1c.3g.20gb'}]",
     "gpus[0].mig_devices[1].profile",
     "'1c.3g.20gb' puts GPU instance 1 in profile '3g.20gb', but gpus[0].mig_devices[0] puts it in '2g.10gb'"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1g.5gb', uuid = 'GPU-x'}]",
     "gpus[0].mig_devices[0].uuid", "a MIG device UUID starts with 'MIG-', got 'GPU-x'"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1g.5gb', uuid = 'MIG-a'},"
     " {gi = 2, ci = 0, profile = '1g.5gb', uuid = 'MIG-a'}]",
     "gpus[0].mig_devices[1].uuid", "UUID 'MIG-a' is already used by gpus[0].mig_devices[0]"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '7g.80gb'}]", "gpus[0].mig_devices",
     "the GPU instances need 76800 MiB in all, more than the GPU's memory_total_mib 16384"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1g.5gb', memory_used_mib = 9000}]",
     "gpus[0].mig_devices[0].memory_used_mib", "9000 MiB used is more than its memory_total_mib 4800"),
    ("mig = true\nmig_devices = [{gi = 1, ci = 0, profile = '1g.5gb', colour = 'red'}]",
     "gpus[0].mig_devices[0].colour", "unknown key 'colour'"),
    ("mig = true\nmig_devices = [{gi = 1, profile = '1g.5gb'}]", "gpus[0].mig_devices[0]",
     "missing required field `ci`"),
    ("mig = true\nmig_devices = [" + ", ".join(f"{{gi = {i}, ci = 0, profile = '1g.1gb'}}" for i in range(8)) + "]",
     "gpus[0].mig_devices", "8 MIG devices, more than a GPU has (7)"),
]


@pytest.mark.parametrize("body, field, problem", HOST_ERRORS, ids=[e[1] + ":" + e[2][:20] for e in HOST_ERRORS])
def test_bad_mig_host_files_get_one_clear_error(body, field, problem):
    with pytest.raises(HostFileError) as error:
        SimulatedNvml.from_text("[[gpus]]\n" + body + "\n", "node.toml")
    message = str(error.value)
    assert message.startswith("Invalid host file 'node.toml': " + field + ":"), message
    assert problem in message, message


def test_mig_inventory_encodes_and_decodes(data_dir):
    nvml = SimulatedNvml.from_file(data_dir / "h200-mig.toml")
    nvml.init()
    inventory = read_inventory(nvml)
    again = msgspec.json.decode(msgspec.json.encode(inventory), type=type(inventory))
    assert again == inventory


def test_mig_resources_through_the_bindings_equal_the_simulated_nodes(probe, data_dir):
    from actors import NvidiaGpuAllocator
    from actors.flags import Flags

    path = data_dir / "h200-mig.toml"
    config = probe.config(load_host_file(path))
    cases = [
        {"nvidia_mig_strategy": "mixed"},
        {"nvidia_mig_strategy": "mixed", "resources": "mig-1g.18gb:3"},
        {"nvidia_mig_strategy": "single", "resources": "gpus:6", "nvidia_gpu_devices": "0,2"},
        {"nvidia_mig_strategy": "single"},
    ]
    results = probe.run([{"op": "resources", "config": config, "flags": flags} for flags in cases])
    for flags, result in zip(cases, results):
        try:
            expected = {"resources": str(NvidiaGpuAllocator.resources(Flags.from_dict({**flags, "host_file": str(path)})))}
        except Exception as exc:  # noqa: BLE001 - the same error is expected
            expected = {"error": {"type": type(exc).__name__, "message": str(exc), "function": None, "code": None}}
        assert result == expected, flags
    assert results[0] == {"resources": "gpus:1;mig-1c.3g.71gb:2;mig-1g.18gb:2;mig-2g.35gb:1;mig-3g.71gb:1"}
    assert results[1]["error"]["type"] == "AllocatorError"


def test_inspect_shows_mig_devices_under_their_gpu(data_dir):
    from isolators.inventory_table import render_gpu_table, render_inventory

    nvml = SimulatedNvml.from_file(data_dir / "h200-mig.toml")
    nvml.init()
    inventory = read_inventory(nvml)
    lines = render_gpu_table(inventory, {MigDevice(Gpu(195, 0), 4, 0): "allocated"}).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["0", "0:0", "0:1", "0:2", "0:3", "1", "2", "2:0", "2:1", "3"]
    assert "MIG-0f8b2f6c-1a11-5b2e-9c21-000000000003" in lines[2] and "└ MIG 1g.18gb (GI 3, CI 0)" in lines[2]
    assert "16896 MiB" in lines[2]
    assert lines[3].endswith("allocated") and not lines[2].endswith("allocated")
    assert "└ MIG 1c.3g.71gb (GI 1, CI 1)" in lines[9]
    assert render_inventory(inventory).splitlines()[0].endswith("4 GPUs, 6 MIG devices")


def test_mig_usage_is_read_on_the_mig_handle_alike_in_both_implementations(probe, data_dir):
    from actors.nvml import read_mig_usage

    path = data_dir / "h200-mig.toml"
    nvml = SimulatedNvml.from_file(path)
    nvml.init()
    inventory = read_inventory(nvml)
    targets = [(m.parent_index, m.index, m.device) for m in inventory.mig_devices]
    expected = msgspec.json.decode(msgspec.json.encode({"mig_usage": read_mig_usage(nvml, targets)}))
    [result] = probe.run([{"op": "mig_usage", "config": probe.config(load_host_file(path))}])
    assert result == expected
    second = expected["mig_usage"][1]
    assert second["memory_used_bytes"] == 1024 * 1024 * 1024 and second["memory_total_bytes"] == 16896 * 1024 * 1024
    assert second["utilization_gpu_percent"] is None and second["power_mw"] is None  # not on a MIG handle


@pytest.mark.asyncio
async def test_the_service_reads_gpus_and_mig_devices_in_one_job(data_dir):
    from actors.nvml import GpuUsage, MigDeviceUsage, NvmlService

    nvml = SimulatedNvml.from_file(data_dir / "h200-mig.toml")
    nvml.init()
    service = NvmlService(nvml)
    try:
        readings = await service.usages([Gpu(195, 1), MigDevice(Gpu(195, 0), 4, 0)])
        assert isinstance(readings[Gpu(195, 1)], GpuUsage)
        assert isinstance(readings[MigDevice(Gpu(195, 0), 4, 0)], MigDeviceUsage)
        assert readings[MigDevice(Gpu(195, 0), 4, 0)].index == 1
        with pytest.raises(KeyError, match="MIG device 195:0/gi9/ci0 is not on this node"):
            await service.usages([MigDevice(Gpu(195, 0), 9, 0)])
    finally:
        await service.close()
