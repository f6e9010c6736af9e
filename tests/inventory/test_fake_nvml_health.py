"""R-HE-1..5 end to end through the real ``pynvml`` and the fake NVML (C).

A child process (``health_probe.py``) preloads the fake library, builds the
real components with ``host_file=None`` (so ``BindingsNvml``), and appends
Xid / ECC / error records to the events file the fake's
``nvmlEventSetWait_v2`` reads while the health monitor waits on it:
event set, registration per supported type (``nvmlDeviceGetSupportedEventTypes``),
Xid filtering, the allocator and the isolator's ``watch()``.
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from actors.nvml import host_spec_from_dict
from actors.volume.testing import write_ld_cache

from tests.support.fake_nvml import HEALTH_PROBE

# GPU 0 reports Xids but no ECC events (like many consumer or older boards);
# GPU 3 reports none at all.
NODE = {
    "driver_version": "550.54.15",
    "gpus": [
        {"supported_events": ["xid"]},
        {},
        {},
        {"supported_events": []},
    ],
}


@pytest.fixture
def health_job(probe, tmp_path: Path):
    """A job for ``health_probe.py``: node config, events file and directories."""
    if os.geteuid() != 0:
        pytest.skip("the isolator needs /dev/nvidiactl-like char nodes: mknod needs root")
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidiactl", stat.S_IFCHR | 0o666, os.makedev(195, 255))
    os.mknod(dev / "nvidia-uvm", stat.S_IFCHR | 0o666, os.makedev(235, 0))
    events = tmp_path / "events"
    events.write_text("")
    own_cache = write_ld_cache(tmp_path / "ld.so.cache")
    proc = tmp_path / "proc"
    proc.mkdir()

    def job(scenario: str, **extra: object) -> dict:
        return {
            "scenario": scenario,
            "config": probe.config(host_spec_from_dict(NODE)),
            "events": str(events),
            "dirs": {
                "dev_dir": str(dev),
                "runtime_dir": str(tmp_path / "run"),
                "work_dir": str(tmp_path / "work"),
                "node_ledger": str(tmp_path / "ledger"),  # the real NVML has one by default: the test's own
                "volume_dir": str(tmp_path / "volume"),
                "ld_cache": own_cache, "proc_dir": str(proc),  # the node's, never the host's
                "cgroups_root": f"gpu-isolator-test-{uuid.uuid4().hex[:12]}",
            },
            **extra,
        }

    return job


def test_an_xid_on_a_gpu_without_ecc_events_reaches_watch_and_the_allocator(probe, health_job):
    [result] = probe.run([health_job("isolator")], script=HEALTH_PROBE)
    assert result["kind"] == "nvml"  # the real bindings, not a simulated node
    assert result["unwatched"] == ["195:3"]
    assert result["a"] == [0]
    assert result["limitation"] == {
        "reason": "REASON_GPU_UNHEALTHY",
        "message": "GPU 195:0 of container a became unhealthy: Xid 79",
    }
    # The ECC record on GPU 0 was never delivered (not supported there) and
    # Xid 13 changed nothing: Xid 79 is the only reason.
    assert result["unhealthy"] == {"195:0": "Xid 79"}
    assert result["b"] == [1]  # a new prepare avoids the unhealthy GPU
    assert result["available_after_cleanup"] == [2, 3]  # released, still withheld
    assert result["available_after_mark_healthy"] == [0, 2, 3]
    assert result["ecc"] == "double-bit ECC error"
    assert result["unhealthy_at_end"] == {"195:2": "double-bit ECC error"}
    # Closing stopped the events thread and shut NVML down.
    assert result["after_close"] == "nvmlDeviceGetCount_v2 failed: Uninitialized (NVML_ERROR_UNINITIALIZED)"


def test_wait_errors_back_off_and_then_mark_every_gpu_unhealthy(probe, health_job):
    [result] = probe.run([health_job("wait_errors")], script=HEALTH_PROBE)
    assert result["pending_while_retrying"] == [True] * 4
    reason = (
        "node health unknown: waiting for NVML health events failed 5 times in a row:"
        " nvmlEventSetWait_v2 failed: Unknown Error (NVML_ERROR_UNKNOWN)"
    )
    assert result["watch"] == reason
    assert result["unhealthy"] == {f"195:{m}": reason for m in range(4)}
    assert [line.split("; ")[-1] for line in result["failures"]] == [
        "retrying in 1s", "retrying in 2s", "retrying in 4s", "retrying in 8s", "retrying in 16s",
    ]
    assert result["failures"][0] == (
        "Waiting for NVML health events failed (1 in a row): nvmlEventSetWait_v2 failed: Unknown Error"
        " (NVML_ERROR_UNKNOWN); retrying in 1s"
    )
    assert result["recovered"] == ["NVML health events are received again after 5 failed waits"]
    assert result["available_after_recovery"] == []  # back only through mark_healthy


def test_no_driver_is_an_isolator_error_naming_nvml(probe, health_job):
    [result] = probe.run([health_job("no_driver", fail="nvmlInitWithFlags=9")], script=HEALTH_PROBE)
    assert result == {
        "type": "IsolatorError",
        "message": "Failed to initialize NVML (no host file given, so the real NVML is required):"
        " nvmlInit failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED); is the NVIDIA driver"
        " installed and loaded? Without one, set '--host_file' (Flags.host_file) to a host file to use"
        " a simulated node",
        "cause": "NvmlUnavailable",
        "actors": 0,
    }


def test_the_real_nvml_has_the_node_ledger_on_by_default(probe, health_job, tmp_path):
    """SPEC R-NL-1: no --node_ledger on the real NVML (the fake library here): the default ledger,
    which $GPU_ISOLATOR_NODE_LEDGER sets (a directory of the test's own, never /run); empty: off."""
    ledger = tmp_path / "env-ledger"
    [on, off] = probe.run([health_job("ledger_default", ledger_env=str(ledger)),
                           health_job("ledger_default", ledger_env="")], script=HEALTH_PROBE)
    assert on["state"] == {"node_ledger": str(ledger), "owner": f"isolator:{tmp_path / 'work'}"}
    assert len(on["leases"]) == 1 and on["leases"][0].startswith("GPU-")  # container a's GPU, by its UUID
    assert on["said"] == [f"node ledger {ledger}: GPUs are shared with the other front doors of this node"
                          f" (as isolator:{tmp_path / 'work'})"]
    assert off["state"] == {"node_ledger": None, "owner": None} and off["leases"] is None
    assert off["said"] == ["node ledger off ($GPU_ISOLATOR_NODE_LEDGER is empty): this front door does not"
                           " coordinate its GPUs with other front doors of this node; never run another beside it"]
