"""Errors of the GPU allocator.

Rules:
- ``AllocatorError`` (a ``runtime.Failure``) is raised for invalid GPU flags
  (R-FL-1, Mesos' messages) and fails the Future of an allocator call that
  cannot be honoured (R-AL-1); the message carries the offending value.
- ``format_gpus`` writes a set of GPUs the way every message does:
  ``{195:1, 195:999}``, sorted.
- ``unit_set`` checks that every value a caller passes is a unit (a
  ``Gpu`` or a ``MigDevice``) before any call looks at it.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime import Failure

from actors.gpu import Gpu
from actors.mig import MigDevice, Unit

__all__ = ["AllocatorError", "format_gpus", "unit_set"]


class AllocatorError(Failure):
    """A GPU allocation request or GPU flag that cannot be honoured."""


def format_gpus(gpus: Iterable[Gpu]) -> str:
    """``{195:0, 195:3}`` (sorted)."""
    return "{" + ", ".join(str(gpu) for gpu in sorted(set(gpus))) + "}"


def unit_set(gpus: Iterable[Unit]) -> set[Unit]:
    """The units passed, as a set; anything else fails naming it."""
    result = set()
    for gpu in gpus:
        if not isinstance(gpu, (Gpu, MigDevice)):
            raise AllocatorError(f"Expected Gpu or MigDevice values, got {gpu!r}")
        result.add(gpu)
    return result
