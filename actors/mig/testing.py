"""Capability facts of a simulated MIG node, written as a real driver has them.

Rules:
- ``write_proc_dir(proc_dir, spec, caps_major=DEFAULT_CAPS_MAJOR)`` writes
  under ``proc_dir``: ``devices`` (a ``Character devices:`` section with the
  ``nvidia-caps`` major), ``driver/nvidia-caps/mig-minors`` and, for every
  MIG device of the host spec, its two capability proc files
  (``driver/nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access``, with the
  driver's ``DeviceFileMinor``/``DeviceFileMode`` lines). Blocking.
- Minors follow the driver's table: ``config`` 1, ``monitor`` 2, then per
  GPU minor N, per GPU instance G (0..14) the GI's access node and its
  compute instances C (0..7): ``3 + 135 N + 9 G`` and ``+ 1 + C``
  (``cap_minor``). Every GPU of the spec gets its whole table, as on a
  real node, whether MIG is on or not.
- For tests, demos and the simulated node; nothing here runs on a real node.
"""

from __future__ import annotations

import os

from actors.nvml import HostSpec

__all__ = ["DEFAULT_CAPS_MAJOR", "cap_minor", "mig_minors_text", "write_proc_dir"]

DEFAULT_CAPS_MAJOR = 239
_INSTANCES = 15
_COMPUTE = 8
_PER_GPU = _INSTANCES * (1 + _COMPUTE)


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The driver's capability minor of ``gpu<N>/gi<G>[/ci<C>]/access``."""
    base = 3 + _PER_GPU * gpu_minor + (1 + _COMPUTE) * gi
    return base if ci is None else base + 1 + ci


def mig_minors_text(gpu_minors: list[int]) -> str:
    """``mig-minors`` for GPUs of these minors."""
    lines = ["config 1", "monitor 2"]
    for minor in sorted(gpu_minors):
        for gi in range(_INSTANCES):
            lines.append(f"gpu{minor}/gi{gi}/access {cap_minor(minor, gi)}")
            for ci in range(_COMPUTE):
                lines.append(f"gpu{minor}/gi{gi}/ci{ci}/access {cap_minor(minor, gi, ci)}")
    return "\n".join(lines) + "\n"


def write_proc_dir(proc_dir: str, spec: HostSpec, caps_major: int = DEFAULT_CAPS_MAJOR) -> str:
    """Write the capability facts of ``spec`` under ``proc_dir`` (see module rules)."""
    os.makedirs(os.path.join(proc_dir, "driver", "nvidia-caps"), exist_ok=True)
    with open(os.path.join(proc_dir, "devices"), "w") as handle:
        handle.write(
            "Character devices:\n  1 mem\n195 nvidia-frontend\n235 nvidia-uvm\n"
            f"{caps_major - 1} nvidia-caps-imex-channels\n{caps_major} nvidia-caps\n\nBlock devices:\n  7 loop\n"
        )
    with open(os.path.join(proc_dir, "driver", "nvidia-caps", "mig-minors"), "w") as handle:
        handle.write(mig_minors_text([gpu.minor for gpu in spec.gpus]))
    for gpu in spec.gpus:
        for mig in gpu.mig_devices:
            base = os.path.join(proc_dir, "driver", "nvidia", "capabilities", f"gpu{gpu.minor}", "mig", f"gi{mig.gi}")
            for directory, minor in ((base, cap_minor(gpu.minor, mig.gi)),
                                     (os.path.join(base, f"ci{mig.ci}"), cap_minor(gpu.minor, mig.gi, mig.ci))):
                os.makedirs(directory, exist_ok=True)
                with open(os.path.join(directory, "access"), "w") as handle:
                    handle.write(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    return proc_dir
