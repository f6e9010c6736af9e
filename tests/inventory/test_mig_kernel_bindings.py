"""R-MG-4 through the real ``pynvml`` bindings over the fake NVML: the same
kernel scenario as tests/isolators/test_isolator_mig.py (``tests.support.mig``),
with no host file -- the MIG devices, their ids, UUIDs and profiles come
from libnvidia-ml.so.1 (the fake), the capability facts from ``--proc_dir``,
the control devices from ``--dev_dir`` -- on cgroups v1 and v2 (root)."""

from __future__ import annotations

import os
import uuid

import pytest

from actors.nvml import host_spec_from_dict
from actors.volume.testing import write_ld_cache
from tests.support.fake_nvml import MIG_KERNEL_PROBE
from tests.support.kernel import KERNEL_BACKENDS, hierarchy_of, remove_test_cgroups, skip_reason
from tests.support.mig import EXPECTED, HOST, mknod_mig_nodes, write_mig_proc



@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_the_kernel_scenario_on_the_real_bindings(backend, probe, tmp_path, node_root_prefix) -> None:
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    dev_dir = str(tmp_path / "dev")
    mknod_mig_nodes(dev_dir)
    proc_dir = write_mig_proc(str(tmp_path / "proc"))
    root = f"{node_root_prefix}{uuid.uuid4().hex[:12]}"
    flags = {
        "host_file": None, "dev_dir": dev_dir, "proc_dir": proc_dir, "device_backend": backend,
        "cgroups_hierarchy": hierarchy_of(backend), "cgroups_root": root, "nvidia_mig_strategy": "mixed",
        "work_dir": str(tmp_path / "work"), "runtime_dir": str(tmp_path / "run"),
        "node_ledger": str(tmp_path / "ledger"),  # the real NVML has one by default: the test's own
        "volume_dir": str(tmp_path / "volume"), "gpu_allocation": "lowest",
        "ld_cache": write_ld_cache(tmp_path / "ld.so.cache"),  # the node's own, never the host's
        "nvidia_health_wait": 0.2,  # closing waits for the event wait in progress: 0.2 s, not the default 5
    }
    try:
        [seen] = probe.run([{"config": probe.config(host_spec_from_dict(HOST)), "flags": flags, "dev_dir": dev_dir}],
                           script=MIG_KERNEL_PROBE)
    finally:
        remove_test_cgroups(os.path.join(hierarchy_of(backend), root), v2=backend == "cgroups_v2")
    assert seen == EXPECTED
