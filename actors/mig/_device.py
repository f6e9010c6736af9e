"""A MIG device: its identity (``MigDevice``) and what an inventory knows of it.

Rules:
- A MIG device *is* its place on its parent GPU: ``MigDevice(parent, gi,
  ci)`` — the parent's ``Gpu`` identity (R-NV-4), the GPU-instance id and
  the compute-instance id. These three numbers are what the kernel sees
  (the parent's ``/dev/nvidia<minor>`` and the capability nodes of
  ``gpu<minor>/gi<gi>`` and ``gpu<minor>/gi<gi>/ci<ci>``), so they decide
  which device rules a holder needs; UUID, profile and memory hang off
  ``MigDeviceInfo``, never off the identity.
- ``MigDevice`` is a frozen msgspec Struct (hashable, encodable:
  ``{"parent": {"major": 195, "minor": 0}, "gi": 1, "ci": 0}``);
  ``str()`` is ``195:0/gi1/ci0`` and ``MigDevice.parse`` reverses it.
- An allocation unit is a whole GPU (``Gpu``) or a MIG device. Units of both
  kinds order together, by ``unit_sort_key``: a GPU sorts as
  ``(major, minor, -1, -1)``, a MIG device as ``(major, minor, gi, ci)``,
  i.e. right after its parent and before the next GPU. ``MigDevice``'s
  comparisons accept a ``Gpu`` on either side (Python falls back to the
  reflected method), so ``sorted()`` of a mixed set works while
  ``Gpu``-to-``Gpu`` comparisons stay msgspec's own.
- Both kinds encode as plain objects (``Gpu``: ``{"major", "minor"}``).
  msgspec cannot decode an untagged union of two Structs, and ``Gpu``'s
  encoding stays as it is, so a value that may hold either kind is decoded
  with ``as_unit`` (an object with ``parent`` is a MIG device; text
  ``195:0`` / ``195:0/gi1/ci0`` is accepted too), or kept as two typed lists.
"""

from __future__ import annotations

import re
from typing import Annotated, Union

import msgspec

from actors.gpu import Gpu

__all__ = ["MigDevice", "MigDeviceInfo", "Unit", "unit_sort_key", "is_unit", "format_units", "as_unit"]

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_TEXT = re.compile(r"^\s*(\d+)\s*[:.]\s*(\d+)\s*/\s*gi(\d+)\s*/\s*ci(\d+)\s*$")


class MigDevice(msgspec.Struct, frozen=True):
    """A MIG device by its place: parent GPU, GPU instance, compute instance."""

    parent: Gpu
    gi: _NonNegative
    ci: _NonNegative

    def __str__(self) -> str:
        return f"{self.parent.major}:{self.parent.minor}/gi{self.gi}/ci{self.ci}"

    def __repr__(self) -> str:
        return f"MigDevice({self.parent!r}, gi={self.gi}, ci={self.ci})"

    @classmethod
    def parse(cls, text: str) -> "MigDevice":
        """Parse ``"195:0/gi1/ci0"``; raises ValueError otherwise."""
        match = _TEXT.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"Invalid MIG device {text!r}: expected 'major:minor/gi<G>/ci<C>', e.g. '195:0/gi1/ci0'")
        major, minor, gi, ci = (int(group) for group in match.groups())
        return cls(Gpu(major, minor), gi, ci)

    # Ordering with GPUs and other MIG devices (see module rules).
    def _key(self) -> tuple[int, int, int, int]:
        return (self.parent.major, self.parent.minor, self.gi, self.ci)

    def __lt__(self, other: object) -> bool:
        return _compare(self, other, lambda a, b: a < b)

    def __le__(self, other: object) -> bool:
        return _compare(self, other, lambda a, b: a <= b)

    def __gt__(self, other: object) -> bool:
        return _compare(self, other, lambda a, b: a > b)

    def __ge__(self, other: object) -> bool:
        return _compare(self, other, lambda a, b: a >= b)


def _compare(self: MigDevice, other: object, op) -> bool:
    if isinstance(other, (MigDevice, Gpu)):
        return op(self._key(), unit_sort_key(other))
    return NotImplemented


Unit = Union[Gpu, MigDevice]
"""An allocation unit: a whole GPU or a MIG device."""


def unit_sort_key(unit: Unit) -> tuple[int, int, int, int]:
    """The order of units of both kinds (see module rules)."""
    if isinstance(unit, Gpu):
        return (unit.major, unit.minor, -1, -1)
    return (unit.parent.major, unit.parent.minor, unit.gi, unit.ci)


def is_unit(value: object) -> bool:
    """Whether ``value`` is an allocation unit (a ``Gpu`` or a ``MigDevice``)."""
    return isinstance(value, (Gpu, MigDevice))


def as_unit(value: object) -> Unit:
    """A unit from its decoded form or its text (see module rules); ValueError otherwise."""
    if isinstance(value, (Gpu, MigDevice)):
        return value
    try:
        if isinstance(value, str):
            return MigDevice.parse(value) if "/" in value else Gpu.parse(value)
        if isinstance(value, dict):
            return msgspec.convert(value, MigDevice if "parent" in value else Gpu)
    except msgspec.ValidationError as exc:
        raise ValueError(f"Invalid GPU or MIG device {value!r}: {exc}") from None
    raise ValueError(
        f"Invalid GPU or MIG device {value!r}: expected '195:0', '195:0/gi1/ci0' or their object forms"
    )


def format_units(units) -> str:
    """``{195:0, 195:1/gi1/ci0}`` (sorted), as every allocator message writes units."""
    return "{" + ", ".join(str(unit) for unit in sorted(set(units), key=unit_sort_key)) + "}"


class MigDeviceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the inventory knows about one MIG device (NVML or a simulated node)."""

    device: MigDevice
    """The identity: parent GPU, GPU-instance id, compute-instance id."""
    parent_index: int
    """The parent GPU's NVML index."""
    index: int
    """The MIG device index on its parent (``nvmlDeviceGetMigDeviceHandleByIndex``)."""
    uuid: str
    """``MIG-…``."""
    profile: str
    """The MIG profile, e.g. ``1g.18gb`` (``1c.3g.71gb`` for a compute instance
    smaller than its GPU instance)."""
    memory_total_mib: int

    @property
    def gi(self) -> int:
        return self.device.gi

    @property
    def ci(self) -> int:
        return self.device.ci

    @property
    def resource_name(self) -> str:
        """The resource this device counts under in the ``mixed`` strategy."""
        return f"mig-{self.profile}"
