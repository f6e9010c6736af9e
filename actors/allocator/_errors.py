"""Errors of the GPU allocator.

Rules:
- ``AllocatorError`` (a ``runtime.Failure``) is raised for invalid GPU flags
  (R-FL-1, Mesos' messages) and fails the Future of an allocator call that
  cannot be honoured (R-AL-1); the message carries the offending value.
- ``format_gpus`` writes a set of GPUs the way every message does:
  ``{195:1, 195:999}``, sorted.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime import Failure

from actors.gpu import Gpu

__all__ = ["AllocatorError", "format_gpus"]


class AllocatorError(Failure):
    """A GPU allocation request or GPU flag that cannot be honoured."""


def format_gpus(gpus: Iterable[Gpu]) -> str:
    """``{195:0, 195:3}`` (sorted)."""
    return "{" + ", ".join(str(gpu) for gpu in sorted(set(gpus))) + "}"
