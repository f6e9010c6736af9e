"""GPU resources from flags: Mesos' ``enumerateGpuResources`` / ``enumerateGpus``.

Rules (R-FL-1, in Mesos' order, with Mesos' messages):
1. ``--nvidia_gpu_devices`` without ``gpu/nvidia`` in ``--isolation`` → error.
2. Only the ``gpus`` entry of ``--resources`` matters (parse errors of the
   whole text still surface).
3. Without the ``gpu/nvidia`` isolator, or without a usable NVML (no host
   file and no driver), the ``gpus`` value passes through unchecked.
4. ``gpus:0`` given explicitly → no GPUs and no discovery; devices given
   with it → error.
5. Devices without a ``gpus`` resource → error; a ``gpus`` resource without
   devices → error.
6. A fractional ``gpus`` → error; duplicate devices → error; a count that
   differs from the devices → error; more than the node has → error; a
   device index the node does not have → error (Mesos only found that out
   later, in ``create``).
7. Neither given → every GPU NVML reports (``gpus:<count>``).
- MIG (R-MG-3): under ``--nvidia_mig_strategy=single`` or ``mixed`` the
  rules of ``_mig_resources`` apply (after rules 1-3); under ``none`` a
  ``mig-<profile>`` resource is an error naming the flag to set. Without
  the isolator or NVML, ``mig-<profile>`` entries pass through unchecked
  beside ``gpus``.
- ``enumerate_indices(flags, resources)``: the NVML indices an allocator
  manages: the devices when given, else ``0..gpus-1``.
- Mesos names the flag ``'--nvidia_gpus_devices'`` in some messages (a
  typo); these messages name it correctly, ``'--nvidia_gpu_devices'``.
"""

from __future__ import annotations

import logging

from actors.flags import Flags
from actors.nvml import Nvml, NvmlError, NvmlUnavailable, open_nvml
from actors.resources import Resources

from ._errors import AllocatorError
from ._indices import check_devices_pairing, enumerate_indices
from ._mig_resources import mig_resource_names, mig_strategy_resources

__all__ = ["gpu_resources", "enumerate_indices", "has_explicit_zero_gpus"]

logger = logging.getLogger(__name__)


def has_explicit_zero_gpus(resources: Resources) -> bool:
    """Whether ``--resources`` spells out ``gpus`` as zero. (Mesos looks for the
    text "gpus" anywhere in the flag; the parsed value remembers an explicit 0.)"""
    return resources.gpus() == 0


def gpu_resources(flags: Flags, nvml: Nvml | None = None) -> Resources:
    """The ``gpus`` resource this node offers (see module rules); raises
    AllocatorError with Mesos' message. ``nvml`` (initialised) overrides the
    port chosen from ``flags.host_file``. Blocking when it asks NVML."""
    isolators = set(flags.isolators())
    devices = flags.nvidia_gpu_devices

    if devices is not None and "gpu/nvidia" not in isolators:
        raise AllocatorError(
            "'--nvidia_gpu_devices' can only be specified if the"
            " `--isolation` flag contains 'gpu/nvidia'"
        )

    parsed = Resources.parse(flags.resources or "")
    named_mig = mig_resource_names(parsed)
    resources = parsed.filter(["gpus", *named_mig])

    if "gpu/nvidia" not in isolators:
        return resources
    if named_mig and flags.nvidia_mig_strategy == "none":
        raise AllocatorError(
            f"'--resources' names {', '.join(repr(name) for name in named_mig)}: MIG devices are"
            " resources of their own only with '--nvidia_mig_strategy=mixed'"
        )

    opened = False
    if nvml is None:
        try:
            nvml = open_nvml(flags.host_file)
            opened = True
        except NvmlUnavailable as exc:
            # Mesos: without NVML the resources pass through unchecked.
            logger.info("NVML is not available (%s); 'gpus' passes through unchecked", exc.text)
            return resources
        except NvmlError as exc:
            raise AllocatorError(f"Failed to nvml::initialize: {exc}") from None

    try:
        try:
            available = nvml.device_count()
        except NvmlError as exc:
            raise AllocatorError(f"Failed to nvml::deviceGetCount: {exc}") from None
        if flags.nvidia_mig_strategy != "none":
            try:
                mig = mig_strategy_resources(flags, parsed, nvml, available)
            except NvmlError as exc:
                raise AllocatorError(f"Failed to read the MIG devices from NVML: {exc}") from None
            if mig is not None:
                return mig
    finally:
        if opened:
            nvml.close()

    gpus = resources.gpus()
    if check_devices_pairing(gpus, devices, has_explicit_zero_gpus(resources)):
        return Resources()

    if gpus is not None and devices is not None:
        if round(gpus * 1000) % 1000 != 0:
            raise AllocatorError(
                f"The 'gpus' resource must be an non-negative integer (got {gpus:g})"
            )
        if len(set(devices)) != len(devices):
            duplicates = sorted({index for index in devices if devices.count(index) > 1})
            raise AllocatorError(
                f"'--nvidia_gpu_devices' contains duplicates: {', '.join(map(str, duplicates))}"
            )
        if len(devices) != gpus:
            raise AllocatorError(
                "'--resources' and '--nvidia_gpu_devices' specify different numbers of GPU devices"
                f" ({gpus:g} and {len(devices)})"
            )
        if gpus > available:
            raise AllocatorError(
                "The number of GPUs requested is greater than the number of GPUs available"
                f" on the machine ({gpus:g} requested, {available} available)"
            )
        missing = sorted(index for index in devices if index >= available)
        if missing:
            raise AllocatorError(
                f"'--nvidia_gpu_devices' names GPU index {', '.join(map(str, missing))} but the"
                f" machine has {available} GPUs (indices 0-{available - 1})"
            )
        return resources

    return Resources(scalars={"gpus": float(available)})
