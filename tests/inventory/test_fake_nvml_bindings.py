"""R-NV-3: the real pynvml path, against a fake NVML written in C.

Each test converts a host file into the fake's config, runs the real
``pynvml`` bindings (``BindingsNvml``) over the fake library in a child
process (``nvml_probe.py``), and compares with ``SimulatedNvml`` reading the
same host file here.
"""

from __future__ import annotations

import msgspec

from actors.nvml import SimulatedNvml, load_host_file, read_inventory, read_usage, register_health_events

HOST_FILES = ["dgx8-nvlink.toml", "pcie4.toml", "mixed.json"]


def simulated(path):
    nvml = SimulatedNvml.from_file(path)
    nvml.init()
    inventory = read_inventory(nvml)
    usage = read_usage(nvml, [(g.index, g.gpu) for g in inventory.gpus])
    event_set = nvml.event_set_create()
    registration = register_health_events(nvml, event_set, range(len(inventory.gpus)))
    nvml.event_set_free(event_set)
    # Through JSON, as the child's answer travels (NVLink peer keys become text).
    result = msgspec.json.decode(msgspec.json.encode({"inventory": inventory, "usage": usage, "health": registration}))
    # Only a simulated node knows its control devices; a real one has /dev.
    for key in ("kind", "source", "control_devices"):
        result["inventory"].pop(key)
    return result


def test_both_implementations_report_the_same_inventory(probe, data_dir, tmp_path):
    plain = tmp_path / "plain.toml"
    plain.write_text("gpu_count = 3\n")
    paths = [data_dir / name for name in HOST_FILES] + [plain]
    jobs = [{"op": "inventory", "config": probe.config(load_host_file(path))} for path in paths]
    results = probe.run(jobs)
    for i, (path, result) in enumerate(zip(paths, results)):
        assert "error" not in result, result
        assert result["inventory"]["kind"] == "nvml"
        for key in ("kind", "source", "control_devices"):
            result["inventory"].pop(key)
        expected = simulated(path)
        assert result == expected, path.name
    dgx = results[0]["inventory"]
    assert [g["gpu"]["minor"] for g in dgx["gpus"]] == list(range(8))
    assert dgx["gpus"][0]["nvlink"] == {"1": 6, "2": 6, "3": 6}
    assert dgx["topology"][0][1] == 10 and dgx["topology"][0][4] == 50
    assert results[3]["inventory"]["topology"][0][1] is None  # not supported, as in the simulation
    # Registration per supported type: a GPU without ECC events still reports Xids;
    # one that supports neither is health-unknown (both implementations alike).
    assert results[2]["health"] == {"registered": {"0": ["xid", "ecc"], "2": ["xid"], "3": ["xid", "ecc"]},
                                    "unknown": [1]}
    assert results[0]["health"]["registered"] == {str(i): ["xid", "ecc"] for i in range(8)}


def test_allocation_over_the_bindings_picks_the_same_gpus(probe, data_dir):
    config = probe.config(load_host_file(data_dir / "dgx8-nvlink.toml"))
    # closing the allocator waits for its health monitor's event wait in progress: 0.2 s, not the default 5
    [result] = probe.run([{"op": "allocate", "config": config, "counts": [1, 4, 2],
                           "flags": {"nvidia_health_wait": 0.2}}])
    assert result == {"picks": [[0], [4, 5, 6, 7], [2, 3]]}


def test_nvml_errors_reach_the_caller_as_clear_errors(probe, data_dir):
    config = probe.config(load_host_file(data_dir / "pcie4.toml"))
    results = probe.run([
        {"op": "inventory", "config": config, "fail": "nvmlInitWithFlags=9"},
        {"op": "inventory", "config": config, "fail_after_init": "nvmlDeviceGetMinorNumber=3"},
        {"op": "inventory", "config": config, "fail_after_init": "nvmlDeviceGetPciInfo_v3=15"},
        {"op": "inventory", "config": config, "fail_after_init": "nvmlDeviceGetNumaNodeId=3"},
        {"op": "uninitialized", "config": config},
    ])
    assert results[0]["error"] == {
        "type": "NvmlUnavailable",
        "message": "nvmlInit failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED); is the NVIDIA"
        " driver installed and loaded? Without one, set '--host_file' (Flags.host_file) to a host file"
        " to use a simulated node",
        "function": "nvmlInit",
        "code": 9,
    }
    assert results[1]["error"]["type"] == "NvmlNotSupported"
    assert results[1]["error"]["message"] == (
        "nvmlDeviceGetMinorNumber failed: Not Supported (NVML_ERROR_NOT_SUPPORTED); GPU index 0"
    )
    assert results[2]["error"]["message"] == (
        "nvmlDeviceGetPciInfo_v3 failed: GPU is lost (NVML_ERROR_GPU_IS_LOST); GPU index 0"
    )
    # An optional fact the GPU cannot give is recorded as unknown, not an error.
    assert [g["numa_node"] for g in results[3]["inventory"]["gpus"]] == [None] * 4
    assert results[4]["error"]["message"] == (
        "nvmlDeviceGetCount_v2 failed: Uninitialized (NVML_ERROR_UNINITIALIZED)"
    )


def test_gpu_resources_over_the_bindings(probe, data_dir):
    config = probe.config(load_host_file(data_dir / "pcie4.toml"))
    results = probe.run([
        {"op": "resources", "config": config, "flags": {}},
        {"op": "resources", "config": config, "flags": {"resources": "gpus:2", "nvidia_gpu_devices": [0, 3]}},
        {"op": "resources", "config": config, "flags": {"resources": "gpus:5", "nvidia_gpu_devices": [0, 1, 2, 3, 4]}},
        # No driver: Mesos passes the gpus resource through unchecked.
        {"op": "resources", "config": config, "fail": "nvmlInitWithFlags=9",
         "flags": {"resources": "gpus:5", "nvidia_gpu_devices": [0, 1, 2, 3, 4]}},
        {"op": "resources", "config": config, "fail": "nvmlInitWithFlags=999", "flags": {}},
    ])
    assert results[0] == {"resources": "gpus:4"}
    assert results[1] == {"resources": "gpus:2"}
    assert results[2]["error"]["type"] == "AllocatorError"
    assert results[2]["error"]["message"].startswith(
        "The number of GPUs requested is greater than the number of GPUs available on the machine"
    )
    assert results[3] == {"resources": "gpus:5"}
    assert results[4]["error"]["message"] == (
        "Failed to nvml::initialize: nvmlInit failed: Unknown Error (NVML_ERROR_UNKNOWN)"
    )


def test_both_implementations_deliver_the_same_health_events(probe, data_dir, tmp_path):
    """What reaches an event set: registered GPUs and types only, in order,
    with the Xid and the MIG GPU instance (nvmlEventSetWait_v2's eventData,
    gpuInstanceId)."""
    path = data_dir / "mixed.json"  # index 1: no events at all; index 2: Xids only
    raised = [("xid", 0, 79, None), ("ecc", 2, 0, None), ("xid", 2, 13, None), ("xid", 1, 79, None),
              ("ecc", 0, 0, None), ("xid", 3, 48, 5)]
    events = tmp_path / "events"
    events.write_text("")
    lines = ["\t".join(str(f) for f in (kind, index, *([code] if kind == "xid" else []),
                                          *([] if gi is None else [gi])))
             for kind, index, code, gi in raised]
    [result] = probe.run([{"op": "events", "config": probe.config(load_host_file(path)),
                           "events": str(events), "raise": lines}])
    nvml = SimulatedNvml.from_file(path)
    nvml.init()
    event_set = nvml.event_set_create()
    register_health_events(nvml, event_set, range(4))
    for kind, index, code, gi in raised:
        (nvml.inject_ecc(index, gi) if kind == "ecc" else nvml.inject_xid(index, code, gi))
    expected = []
    while (event := nvml.event_set_wait(event_set, 0)) is not None:
        expected.append(msgspec.to_builtins(event))
    assert result == {"events": expected}
    assert [(e["index"], e["kind"], e.get("code", 0), e.get("gpu_instance")) for e in expected] == [
        (0, "xid", 79, None), (2, "xid", 13, None), (0, "ecc", 0, None), (3, "xid", 48, 5),
    ]


def simulated_compute_steps(path, steps):
    from tests.support.nvml_probe import compute_steps

    nvml = SimulatedNvml.from_file(path)
    nvml.init()
    return nvml, msgspec.json.decode(msgspec.json.encode(compute_steps(nvml, steps)))


def test_compute_mode_is_the_drivers_state_and_both_implementations_agree(probe, data_dir, tmp_path):
    """R-MP-1's NVML part: get/set compute mode over the real pynvml (fake
    NVML) and the simulated node answer alike; the fake keeps the mode as
    the driver does (past nvmlShutdown, and in $FAKE_NVML_STATE for other
    processes), and refuses what NVML refuses."""
    path = data_dir / "h200-mig.toml"
    spec = load_host_file(path)
    mig_gpu = next(g.index for g in spec.gpus if g.mig_devices)
    steps = [
        [0, None],       # DEFAULT to begin with
        [0, 3],          # EXCLUSIVE_PROCESS
        "reopen",
        [0, None],       # still EXCLUSIVE_PROCESS: the driver's, not the session's
        [1, None],       # another GPU untouched
        [0, 1],          # EXCLUSIVE_THREAD is retired: refused, nothing changed
        [0, None],
        [[mig_gpu, 0], 3],  # a MIG device handle: refused
        [0, 0],          # back to DEFAULT
    ]
    state = tmp_path / "driver-state"
    [result] = probe.run([{"op": "compute_mode", "config": probe.config(spec), "state": str(state), "steps": steps}])
    assert "error" not in result, result
    answers = result["steps"]
    assert answers[:5] == [0, 3, "reopened", 3, 0]
    assert answers[5]["error"]["function"] == "nvmlDeviceSetComputeMode"
    assert answers[5]["error"]["code"] == 2  # NVML_ERROR_INVALID_ARGUMENT
    assert answers[6] == 3
    assert answers[7]["error"]["code"] == 2 and answers[7]["error"]["function"] == "nvmlDeviceSetComputeMode"
    assert answers[8] == 0
    gpu0 = spec.gpus[0].uuid
    assert state.read_text() == f"compute\t{gpu0}\t3\ncompute\t{gpu0}\t0\n"
    simulated, expected = simulated_compute_steps(path, steps)
    assert [a if not isinstance(a, dict) else a["error"]["code"] for a in answers] == [
        a if not isinstance(a, dict) else a["error"]["code"] for a in expected]
    assert simulated.compute_mode_changes == [(gpu0, 3), (gpu0, 0)]
    # Another process reads the mode the last one left.
    probe.run([{"op": "compute_mode", "config": probe.config(spec), "state": str(state), "steps": [[0, 3]]}])
    [again] = probe.run([{"op": "compute_mode", "config": probe.config(spec), "state": str(state),
                          "steps": [[0, None], [1, None]]}])
    assert again["steps"] == [3, 0]
