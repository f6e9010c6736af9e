"""MIG profile names: ``1g.18gb``, ``1c.3g.71gb``, ``1g.24gb+me``.

Rules (NVIDIA's naming, as ``nvidia-smi mig -lgip`` and the device plugin
write it):
- A profile is ``[<C>c.]<G>g.<GB>gb[+<attr>[,<attr>…]]``: C compute slices
  (written only when fewer than the GPU instance's G slices), G GPU-instance
  slices, GB the memory size in GB as NVIDIA rounds it, optional attributes
  such as ``me`` (media extensions) or ``gfx``. ``parse_profile`` checks the
  form and returns the numbers; anything else is a ``ValueError`` that says
  what form is expected.
- ``gpu_instance_profile(profile)`` is the GPU instance's own profile (the
  ``<C>c.`` prefix dropped): MIG devices that share a GPU instance share it.
- ``MIG_RESOURCE_PREFIX`` + profile is the resource name of the ``mixed``
  strategy (``mig-1g.18gb``); ``profile_of_resource`` reverses it.
- ``profile_memory_mib`` is a default memory size for a profile (simulated
  nodes): the GB figure x 960 MiB.
- ``profile_from_attributes`` names a profile from NVML's device attributes
  (slice counts, memory in MB) and the parent's memory, with NVIDIA's
  rounding (memory as a fraction of the GPU rounded up to eighths, times the
  GPU's memory in whole GB, rounded half away from zero): the fallback when
  the driver cannot name the GPU-instance profile itself.
"""

from __future__ import annotations

import math
import re

import msgspec

__all__ = [
    "MIG_RESOURCE_PREFIX",
    "MigProfile",
    "parse_profile",
    "gpu_instance_profile",
    "profile_of_resource",
    "resource_of_profile",
    "profile_from_attributes",
    "profile_memory_mib",
]

MIG_RESOURCE_PREFIX = "mig-"

_PROFILE = re.compile(
    r"^(?:(?P<c>[1-9]\d?)c\.)?(?P<g>[1-9]\d?)g\.(?P<gb>[1-9]\d{0,4})gb"
    r"(?:\+(?P<attrs>[a-z][a-z0-9.]*(?:,[a-z][a-z0-9.]*)*))?$"
)


class MigProfile(msgspec.Struct, frozen=True, kw_only=True):
    """The numbers of a profile name (see module rules)."""

    compute_slices: int
    gpu_slices: int
    memory_gb: int
    attributes: tuple[str, ...] = ()


def parse_profile(text: str) -> MigProfile:
    """The numbers of a profile name; ValueError naming the expected form."""
    match = _PROFILE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"Invalid MIG profile {text!r}: expected '<G>g.<GB>gb' such as '1g.18gb'"
            " (optionally '<C>c.' before it and '+<attribute>' after it, e.g. '1c.3g.71gb', '1g.24gb+me')"
        )
    g = int(match.group("g"))
    c = int(match.group("c")) if match.group("c") else g
    if c > g:
        raise ValueError(
            f"Invalid MIG profile {text!r}: a compute instance of {c} slices cannot be larger"
            f" than its GPU instance of {g}"
        )
    attrs = tuple(match.group("attrs").split(",")) if match.group("attrs") else ()
    return MigProfile(compute_slices=c, gpu_slices=g, memory_gb=int(match.group("gb")), attributes=attrs)


def gpu_instance_profile(profile: str) -> str:
    """``1c.3g.71gb`` -> ``3g.71gb`` (the GPU instance's profile)."""
    parse_profile(profile)
    head, _, rest = profile.partition(".")
    return rest if head.endswith("c") else profile


def resource_of_profile(profile: str) -> str:
    """``1g.18gb`` -> ``mig-1g.18gb``."""
    return MIG_RESOURCE_PREFIX + profile


def profile_of_resource(name: str) -> str | None:
    """``mig-1g.18gb`` -> ``1g.18gb``; None when ``name`` is not a MIG resource."""
    if not name.startswith(MIG_RESOURCE_PREFIX):
        return None
    return name[len(MIG_RESOURCE_PREFIX):]


def profile_memory_mib(profile: str) -> int:
    """A default memory size for a profile: its GB figure x 960 MiB — a little
    under the figure, as real MIG memory is (NVIDIA rounds the name up), so
    ``profile_from_attributes`` names it back on GPUs of today's sizes."""
    return parse_profile(profile).memory_gb * 960


def profile_from_attributes(
    gpu_slices: int, compute_slices: int, memory_mb: int, parent_memory_bytes: int
) -> str:
    """Name a profile from NVML's MIG device attributes (see module rules)."""
    one_gb = 1024 * 1024 * 1024
    fraction = (memory_mb * 1024 * 1024) / max(1, parent_memory_bytes)
    fraction = math.ceil(fraction * 8) / 8
    total_gb = (parent_memory_bytes + one_gb - 1) // one_gb
    gb = int(math.floor(fraction * total_gb + 0.5))
    name = f"{gpu_slices}g.{gb}gb"
    return name if compute_slices == gpu_slices else f"{compute_slices}c.{name}"
