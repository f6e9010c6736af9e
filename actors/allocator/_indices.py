"""The NVML indices the whole-GPU rules manage (R-FL-1, Mesos' ``enumerateGpus``).

Rules:
- ``enumerate_indices(flags, resources)``: the devices flag when given,
  else ``0..gpus-1``; a fractional ``gpus`` is an error.
"""

from __future__ import annotations

from actors.flags import Flags
from actors.resources import Resources

from ._errors import AllocatorError

__all__ = ["enumerate_indices"]


def enumerate_indices(flags: Flags, resources: Resources) -> list[int]:
    """The NVML indices to manage: the devices flag, else ``0..gpus-1``."""
    if flags.nvidia_gpu_devices is not None:
        return list(flags.nvidia_gpu_devices)
    gpus = resources.gpus() or 0
    if round(gpus * 1000) % 1000 != 0:
        raise AllocatorError(f"The 'gpus' resource must be an non-negative integer (got {gpus:g})")
    return list(range(int(gpus)))
