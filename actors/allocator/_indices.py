"""The devices flag against the ``gpus`` resource, and the NVML indices they
select (R-FL-1, Mesos' ``enumerateGpuResources`` / ``enumerateGpus``).

Rules:
- ``check_devices_pairing(gpus, devices, explicit_zero)``: Mesos' pairing
  rules with their messages -- devices with an explicit ``gpus:0`` →
  error; devices without ``gpus`` → error; ``gpus`` without devices →
  error. True when ``gpus:0`` was given explicitly (no GPUs at all).
  Shared by the whole-GPU rules and the ``single`` MIG strategy.
- ``enumerate_indices(flags, resources)``: the devices flag when given,
  else ``0..gpus-1``; a fractional ``gpus`` is an error.
"""

from __future__ import annotations

from actors.flags import Flags
from actors.resources import Resources

from ._errors import AllocatorError

__all__ = ["check_devices_pairing", "enumerate_indices"]


def check_devices_pairing(gpus: float | None, devices: list[int] | None, explicit_zero: bool) -> bool:
    """Mesos' rules for ``--nvidia_gpu_devices`` beside ``gpus`` (see module rules)."""
    if explicit_zero:
        if devices is not None:
            raise AllocatorError(
                "'--nvidia_gpu_devices' cannot be specified when '--resources' specifies 0 GPUs"
            )
        return True
    if devices is not None and gpus is None:
        raise AllocatorError(
            "'--nvidia_gpu_devices' cannot be set without also setting 'gpus' in '--resources'"
        )
    if gpus is not None and devices is None:
        raise AllocatorError(
            "The `gpus` resource cannot be set without also setting `--nvidia_gpu_devices`"
        )
    return False


def enumerate_indices(flags: Flags, resources: Resources) -> list[int]:
    """The NVML indices to manage: the devices flag, else ``0..gpus-1``."""
    if flags.nvidia_gpu_devices is not None:
        return list(flags.nvidia_gpu_devices)
    gpus = resources.gpus() or 0
    if round(gpus * 1000) % 1000 != 0:
        raise AllocatorError(f"The 'gpus' resource must be an non-negative integer (got {gpus:g})")
    return list(range(int(gpus)))
