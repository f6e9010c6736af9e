"""Errors of the NVIDIA volume and of the device nodes it hands containers.

Rules:
- ``VolumeError`` is the base of every error building the volume reports; it
  is a ``runtime.Failure`` so a caller awaiting the volume actor catches one
  type. Messages name the file and what is wrong with it, in Mesos' wording
  where Mesos has one ("Failed to mount '<path>': ...").
- ``LdCacheError``: the loader cache cannot be read or is not a valid cache.
- ``ElfError``: a library named by the cache is not a readable ELF file.
- ``DeviceNodeError``: a ``/dev/nvidia*`` node cannot be listed or copied.
"""

from __future__ import annotations

from runtime import Failure

__all__ = ["VolumeError", "LdCacheError", "ElfError", "DeviceNodeError"]


class VolumeError(Failure):
    """The NVIDIA volume could not be built or used."""


class LdCacheError(VolumeError):
    """``/etc/ld.so.cache`` (or the given cache) is unreadable or corrupt."""


class ElfError(VolumeError):
    """A file is not an ELF object, or its ELF structures are corrupt."""


class DeviceNodeError(Failure):
    """A ``/dev/nvidia*`` device node could not be listed or copied."""
