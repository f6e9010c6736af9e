"""MIG resources from flags: R-FL-1 for MIG devices (R-MG-3).

Rules (``--nvidia_mig_strategy``; ``none`` never comes here):
- The GPUs considered are ``--nvidia_gpu_devices`` (duplicates and indices
  the node lacks are errors, as for ``gpus``) or every GPU NVML reports.
  Each is MIG-enabled (its MIG devices are read) or not.
- ``single``: every MIG device is one unit of ``gpus``. Considered GPUs
  with MIG on and off at once → error at start. With none in MIG mode the
  whole-GPU rules apply unchanged. Otherwise ``gpus`` follows R-FL-1 with
  "the number of MIG devices of the considered GPUs" in place of "the
  number of devices": neither given → all of them; devices without
  ``gpus`` / ``gpus`` without devices → Mesos' errors; fractional, a
  different count → errors. ``mig-<profile>`` resources → error (they are
  ``mixed``'s). Profiles that differ are allowed, with a warning: a unit of
  ``gpus`` is then not always the same size.
- ``mixed``: ``gpus`` counts the considered GPUs with MIG off, by R-FL-1
  (an explicit ``gpus:0`` means none of them, and is what a node whose
  considered GPUs all run MIG may say, devices given or not). Each
  ``mig-<profile>`` of ``--resources`` is checked: the name must be a
  profile of NVIDIA's form that some considered MIG device has (else the
  error lists the node's profiles), its value a whole number (a range or
  set, or a fraction → error), at most the devices of that profile (else
  error); a profile not named offers all its devices. The result lists
  ``gpus`` (when any) and every ``mig-<profile>``, profiles sorted.
- ``managed_units(flags, resources, inventory)`` turns the result into the
  allocator's pools: resource name → units, in unit order: ``gpus`` →
  whole GPUs (by the whole-GPU rules' indices, or under ``mixed`` the
  considered GPUs with MIG off; under ``single`` the MIG devices);
  ``mig-<profile>`` → the first N MIG devices of that profile (parent
  index, then MIG index). ``needs_inventory`` tells whether any unit is
  handed out at all.
- Every error is an ``AllocatorError`` naming the flag, the value and what
  to do next; nothing is changed.
"""

from __future__ import annotations

import collections
import logging

from actors.flags import Flags
from actors.mig import MIG_RESOURCE_PREFIX, MigDeviceInfo, Unit, parse_profile, profile_of_resource
from actors.nvml import Nvml, NodeInventory, read_mig_devices
from actors.resources import Resources

from ._errors import AllocatorError
from ._indices import check_devices_pairing, enumerate_indices

__all__ = ["mig_strategy_resources", "managed_units", "mig_resource_names", "needs_inventory"]

logger = logging.getLogger(__name__)

_WHOLE = "gpus"


def mig_resource_names(resources: Resources) -> list[str]:
    """The ``mig-<profile>`` names of ``resources``, in their order."""
    return [name for name in resources.names() if name.startswith(MIG_RESOURCE_PREFIX)]


def _is_whole(value: float) -> bool:
    return round(value * 1000) % 1000 == 0


def _considered(flags: Flags, available: int) -> list[int]:
    devices = flags.nvidia_gpu_devices
    if devices is None:
        return list(range(available))
    if len(set(devices)) != len(devices):
        duplicates = sorted({index for index in devices if devices.count(index) > 1})
        raise AllocatorError(f"'--nvidia_gpu_devices' contains duplicates: {', '.join(map(str, duplicates))}")
    missing = sorted(index for index in devices if index >= available)
    if missing:
        raise AllocatorError(
            f"'--nvidia_gpu_devices' names GPU index {', '.join(map(str, missing))} but the"
            f" machine has {available} GPUs (indices 0-{max(0, available - 1)})"
        )
    return list(devices)


def _gpus_value(resources: Resources) -> float | None:
    if _WHOLE in resources.others:
        raise AllocatorError(
            f"The 'gpus' resource must be an non-negative integer (got {resources.others[_WHOLE]!r})"
        )
    return resources.scalars.get(_WHOLE)


def _indices(indices: list[int]) -> str:
    return ", ".join(map(str, indices))


def mig_strategy_resources(flags: Flags, parsed: Resources, nvml: Nvml, available: int) -> Resources | None:
    """The ``gpus`` and ``mig-<profile>`` resources under ``single``/``mixed``
    (see module rules); None when the whole-GPU rules apply unchanged
    (``single`` on a node without MIG). Blocking: it asks NVML."""
    strategy = flags.nvidia_mig_strategy
    named = mig_resource_names(parsed)
    if strategy == "single" and named:
        raise AllocatorError(
            f"'--resources' names {', '.join(repr(n) for n in named)}, a resource of"
            " '--nvidia_mig_strategy=mixed'; under 'single' every MIG device is one of 'gpus'"
        )
    considered = _considered(flags, available)
    layout: dict[int, list[MigDeviceInfo] | None] = {index: read_mig_devices(nvml, index) for index in considered}
    mig_on = [index for index in considered if layout[index] is not None]
    mig_off = [index for index in considered if layout[index] is None]
    devices = flags.nvidia_gpu_devices
    gpus = _gpus_value(parsed)

    if strategy == "single":
        if not mig_on:
            return None
        if mig_off:
            raise AllocatorError(
                "'--nvidia_mig_strategy=single' needs every GPU in MIG mode or none: GPU index"
                f" {_indices(mig_on)} {'has' if len(mig_on) == 1 else 'have'} MIG mode on and"
                f" {_indices(mig_off)} {'has' if len(mig_off) == 1 else 'have'} it off (use"
                " '--nvidia_mig_strategy=mixed' for such a node, or select GPUs with '--nvidia_gpu_devices')"
            )
        units = [mig for index in mig_on for mig in layout[index] or ()]
        profiles = sorted({mig.profile for mig in units})
        if len(profiles) > 1:
            logger.warning(
                "'--nvidia_mig_strategy=single' on MIG devices of different profiles (%s): a unit of"
                " 'gpus' is not always the same size ('mixed' names each profile)",
                ", ".join(profiles),
            )
        count = len(units)
        if check_devices_pairing(gpus, devices, gpus == 0 and _WHOLE in parsed):
            return Resources()
        if gpus is not None:
            if not _is_whole(gpus):
                raise AllocatorError(f"The 'gpus' resource must be an non-negative integer (got {gpus:g})")
            if gpus != count:
                raise AllocatorError(
                    f"'--resources' asks for {gpus:g} gpus but the GPUs of '--nvidia_gpu_devices'"
                    f" (index {_indices(considered)}) have {count} MIG devices; under"
                    " '--nvidia_mig_strategy=single' each MIG device is one of 'gpus'"
                )
        return Resources(scalars={_WHOLE: float(count)})

    # mixed
    result: dict[str, float] = {}
    whole = len(mig_off)
    explicit_zero = gpus == 0 and _WHOLE in parsed
    if gpus is None or explicit_zero:
        if devices is not None and gpus is None and whole:
            raise AllocatorError(
                "'--nvidia_gpu_devices' cannot be set without also setting 'gpus' in '--resources'"
                f" (GPU index {_indices(mig_off)} of it {'has' if whole == 1 else 'have'} MIG mode off)"
            )
        if explicit_zero and devices is not None and whole:
            raise AllocatorError(
                f"'--resources' specifies 0 GPUs but '--nvidia_gpu_devices' selects GPU index"
                f" {_indices(mig_off)} with MIG mode off"
            )
        if gpus is None and whole:
            result[_WHOLE] = float(whole)
    else:
        if devices is None:
            raise AllocatorError(
                "The `gpus` resource cannot be set without also setting `--nvidia_gpu_devices`"
            )
        if not _is_whole(gpus):
            raise AllocatorError(f"The 'gpus' resource must be an non-negative integer (got {gpus:g})")
        if gpus != whole:
            raise AllocatorError(
                "'--resources' and '--nvidia_gpu_devices' specify different numbers of GPU devices"
                f" ({gpus:g} and {whole}: under '--nvidia_mig_strategy=mixed' the GPUs with MIG mode on"
                f"{' (index ' + _indices(mig_on) + ')' if mig_on else ''} count as their 'mig-<profile>'"
                " resources, not as 'gpus')"
            )
        result[_WHOLE] = float(whole)

    per_profile = collections.Counter(mig.profile for index in mig_on for mig in layout[index] or ())
    known = ", ".join(sorted(per_profile)) or "none (no MIG device on the GPUs considered)"
    for name in named:
        profile = profile_of_resource(name) or ""
        try:
            parse_profile(profile)
        except ValueError as exc:
            problem = str(exc)
            raise AllocatorError(
                f"Invalid resource {name!r} in '--resources': {problem[0].lower() + problem[1:]}"
            ) from None
        if profile not in per_profile:
            raise AllocatorError(
                f"Unknown MIG profile {profile!r} in '--resources' ({name!r}): the node's MIG devices"
                f" have profiles {known}"
            )
        if name in parsed.others:
            raise AllocatorError(f"The {name!r} resource must be a non-negative integer (got {parsed.others[name]!r})")
        value = parsed.scalars[name]
        if not _is_whole(value):
            raise AllocatorError(f"The {name!r} resource must be a non-negative integer (got {value:g})")
        if value > per_profile[profile]:
            raise AllocatorError(
                f"The number of {name!r} devices requested is greater than the number available on the"
                f" machine ({value:g} requested, {per_profile[profile]} available)"
            )
    for profile in sorted(per_profile):
        name = MIG_RESOURCE_PREFIX + profile
        result[name] = parsed.scalars[name] if name in parsed.scalars else float(per_profile[profile])
    return Resources(scalars=result)


def needs_inventory(flags: Flags, resources: Resources) -> bool:
    """Whether ``resources`` hand out any unit (else no NVML is touched at all)."""
    if flags.nvidia_mig_strategy == "none":
        return bool(enumerate_indices(flags, resources))
    return any(
        value > 0 for name, value in resources.scalars.items() if name == _WHOLE or name.startswith(MIG_RESOURCE_PREFIX)
    )


def _whole_gpus_by_rules(flags: Flags, resources: Resources, inventory: NodeInventory) -> list[Unit]:
    units: list[Unit] = []
    for index in enumerate_indices(flags, resources):
        try:
            units.append(inventory.by_index(index).gpu)
        except IndexError:
            raise AllocatorError(
                f"Failed to nvml::deviceGetHandleByIndex: no GPU with index {index}"
                f" (the node has {len(inventory.gpus)} GPUs)"
            ) from None
    return units


def managed_units(flags: Flags, resources: Resources, inventory: NodeInventory) -> dict[str, list[Unit]]:
    """The allocator's pools for ``resources`` (see module rules)."""
    strategy = flags.nvidia_mig_strategy
    if strategy == "none":
        return {_WHOLE: _whole_gpus_by_rules(flags, resources, inventory)}
    considered = (
        list(flags.nvidia_gpu_devices) if flags.nvidia_gpu_devices is not None else [g.index for g in inventory.gpus]
    )
    try:
        infos = [inventory.by_index(index) for index in considered]
    except IndexError as exc:
        raise AllocatorError(f"Failed to nvml::deviceGetHandleByIndex: {exc}") from None
    mig_on = [info.index for info in infos if info.mig]
    if strategy == "single":
        if not mig_on:
            return {_WHOLE: _whole_gpus_by_rules(flags, resources, inventory)}
        wanted = int(resources.scalars.get(_WHOLE, 0))
        units: list[Unit] = [mig.device for index in mig_on for mig in inventory.mig_devices_of(index)]
        return {_WHOLE: units[:wanted]}
    pools: dict[str, list[Unit]] = {}
    wanted_whole = int(resources.scalars.get(_WHOLE, 0))
    if wanted_whole:
        pools[_WHOLE] = [info.gpu for info in infos if not info.mig][:wanted_whole]
    for name in mig_resource_names(resources):
        profile = profile_of_resource(name)
        devices = [mig.device for index in mig_on for mig in inventory.mig_devices_of(index) if mig.profile == profile]
        pools[name] = devices[: int(resources.scalars.get(name, 0))]
    return pools
