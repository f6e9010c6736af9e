"""The fake NVML (tests/native/fake_nvml.c) and the child process that runs
the real ``pynvml`` against it.

Rules:
- ``build_fake_nvml(directory)`` compiles the fake with gcc into
  ``<directory>/libnvidia-ml.so.1`` (the ``fake_nvml_lib`` fixture does it
  once per session; None when gcc is absent, so the fixture can skip with
  the reason ``NO_GCC``).
- ``fake_config_text(spec)`` is a host file (``HostSpec``) in the fake's
  line format: driver, GPUs, NVLinks, topology, MIG devices, the event
  types each GPU supports.
- ``NvmlProbe(lib, tmp)`` runs jobs in ONE child Python process that
  preloads the fake (``nvml_probe.py``, or ``health_probe.py`` or
  ``mig_kernel_probe.py`` beside it):
  pynvml caches its library handle in module globals, so loading the fake
  into the pytest process would make every later "is there a driver?"
  check say yes. ``config(spec)`` writes a config file for a job;
  ``run(jobs, script=NVML_PROBE)`` sends them as JSON and returns the
  child's JSON answer (a failing child is an AssertionError with its
  stderr).
- ``fake_nvml_node(base, lib, spec)``: the options and environment of a
  command (``kubelet-plugin``, ``dra-plugin``) on the fake NVML with no
  host file -- mknod'ed control devices (root), proc, ld.so.cache, volume,
  CDI and node ledger dirs under ``base`` -- and the events file the fake's
  ``nvmlEventSetWait_v2`` reads; ``raise_event(events, *fields)`` appends
  one event line (``xid <index> <code>``, ``error 999 <n>``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from actors.mig import gpu_instance_profile, parse_profile
from actors.nvml import HostSpec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKE_NVML_SOURCE = REPO / "tests" / "native" / "fake_nvml.c"
NVML_PROBE = HERE / "nvml_probe.py"
HEALTH_PROBE = HERE / "health_probe.py"
MIG_KERNEL_PROBE = HERE / "mig_kernel_probe.py"
NO_GCC = "gcc is not installed: cannot build the fake NVML (tests/native/fake_nvml.c)"

EVENT_BITS = {"xid": 0x8, "ecc": 0x2}  # nvmlEventTypeXidCriticalError, nvmlEventTypeDoubleBitEccError


def build_fake_nvml(directory: Path) -> Path | None:
    """The fake NVML built in ``directory`` (None without gcc)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    out = Path(directory) / "libnvidia-ml.so.1"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
         "-Wl,-soname,libnvidia-ml.so.1", "-o", str(out), str(FAKE_NVML_SOURCE)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def fake_nvml_node(base: Path, lib: Path, spec: HostSpec) -> tuple[list[str], dict[str, str], Path]:
    """Options and environment for a command on the fake NVML; the events file (see module rules)."""
    from actors.volume.testing import write_ld_cache

    dev = base / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidiactl", stat.S_IFCHR | 0o666, os.makedev(195, 255))
    os.mknod(dev / "nvidia-uvm", stat.S_IFCHR | 0o666, os.makedev(235, 0))
    (base / "proc").mkdir()
    (base / "cdi").mkdir()
    config = base / "fake-nvml.conf"
    config.write_text(fake_config_text(spec))
    events = base / "events"
    events.write_text("")
    options = [f"--dev_dir={dev}", f"--proc_dir={base / 'proc'}", f"--ld_cache={write_ld_cache(base / 'ld.so.cache')}",
               f"--volume_dir={base / 'volume'}", f"--cdi_spec_dir={base / 'cdi'}", "--nvidia_health_wait=0.2",
               f"--node_ledger={base / 'ledger'}"]  # the real NVML has a node ledger by default: the test's own
    env = {"LD_LIBRARY_PATH": str(lib.parent), "FAKE_NVML_CONFIG": str(config), "FAKE_NVML_EVENTS": str(events),
           "FAKE_NVML_FAIL": ""}
    return options, env, events


def raise_event(events: Path, *fields: Any) -> None:
    """Append one event line for the fake's event wait."""
    with open(events, "a") as handle:
        handle.write("\t".join(str(f) for f in fields) + "\n")


def fake_config_text(spec: HostSpec) -> str:
    """The fake NVML's line format (see fake_nvml.c) for a resolved host file."""
    mib = 1024 * 1024
    lines = [f"driver\t{spec.driver_version}"]
    for g in spec.gpus:
        fields = [
            g.minor, g.memory_total_mib * mib, g.memory_used_mib * mib, g.utilization_gpu,
            g.utilization_memory, -1 if g.power_mw is None else g.power_mw,
            -1 if g.temperature_c is None else g.temperature_c,
            -1 if g.numa_node is None else g.numa_node, int(g.mig), g.pci_bus_id, g.uuid,
            g.name.replace("\t", " "),
        ]
        lines.append("gpu\t" + "\t".join(str(f) for f in fields))
    for g in spec.gpus:
        for peer, count in g.nvlink.items():
            lines += [f"link\t{g.index}\t{peer}"] * count
    for i in range(len(spec.gpus)):
        for j in range(i + 1, len(spec.gpus)):
            level = spec.topology_level(i, j)
            if level is not None:
                lines.append(f"topo\t{i}\t{j}\t{level}")
    lines += fake_mig_lines(spec)
    for g in spec.gpus:
        mask = sum(EVENT_BITS[kind] for kind in g.supported_events)
        lines.append(f"events\t{g.index}\t{mask}")
    return "\n".join(lines) + "\n"


def fake_mig_lines(spec: HostSpec) -> list[str]:
    """The fake NVML's "mig" lines: one per MIG device, in MIG index order.
    GPU-instance profiles get slots 0, 1, … per GPU in order of first use, and
    ids that differ from their slots (as NVML's profile ids do)."""
    mib = 1024 * 1024
    lines = []
    for g in spec.gpus:
        slots: dict[str, int] = {}
        for m in g.mig_devices:
            gi_profile = gpu_instance_profile(m.profile)
            slot = slots.setdefault(gi_profile, len(slots))
            numbers = parse_profile(m.profile)
            fields = [
                g.index, m.gi, m.ci, slot, 19 + 3 * slot, numbers.gpu_slices, numbers.compute_slices,
                m.memory_total_mib * mib, m.memory_used_mib * mib, m.uuid, f"MIG {gi_profile}",
            ]
            lines.append("mig\t" + "\t".join(str(f) for f in fields))
    return lines


class NvmlProbe:
    """Runs jobs against the real pynvml + fake NVML in one child process."""

    def __init__(self, lib: Path, tmp: Path) -> None:
        self.lib = lib
        self.tmp = tmp
        self._n = 0

    def config(self, spec: HostSpec) -> str:
        self._n += 1
        path = self.tmp / f"fake-nvml-{self._n}.conf"
        path.write_text(fake_config_text(spec))
        return str(path)

    def run(self, jobs: list[dict], script: Path = NVML_PROBE) -> list[dict]:
        """Run ``script LIB`` with ``jobs`` as JSON on stdin; its JSON answer."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for name in ("FAKE_NVML_FAIL", "FAKE_NVML_CONFIG", "FAKE_NVML_EVENTS", "FAKE_NVML_STATE"):
            env.pop(name, None)
        done = subprocess.run(
            [sys.executable, str(script), str(self.lib)],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        if done.returncode != 0:
            raise AssertionError(f"{script.name} failed ({done.returncode}):\n{done.stderr}")
        return json.loads(done.stdout)
