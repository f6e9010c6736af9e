"""File format versions: every file a front door keeps says which format it is in.

Rules (SPEC R-SH-3):
- A kept file (the ledger's leases and owner files, ``serve``'s records,
  the DRA driver's checkpoint, the device plugin's state) is one JSON
  object whose ``"version"`` names its format. Files written before formats
  were numbered (release 0.1.0) have none: they are version 0, and a
  Struct that reads them declares ``version: int = 0``.
- A writer adds fields, never renames one, within a version: msgspec
  passes over fields it does not know, so a release that is still running
  during a rolling update reads what the next one wrote. A change an
  earlier reader would misread is a new version, and the earlier reader
  refuses it instead of guessing.
- ``decode_versioned(data, type, path, versions)`` is the one reader:
  truncated bytes, garbage, a wrong shape and a version outside
  ``versions`` each raise ``UnreadableFile``, whose text names the file,
  what is wrong and which versions this release reads. It never returns
  a half-read value.
- ``set_aside(path)`` moves a file nobody can read out of the way
  (``<name>.unreadable-<UTC time>``, next to it, never overwriting an
  earlier one) and returns where it went, so the front door can start,
  say which file and where it went, and rebuild what it holds from the
  truth outside the file (the kernel, PodResources, the ResourceClaims).
  Deleting it would lose what an operator needs to see what happened.
- Both are blocking file work: callers run them in the runtime's executor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from typing import TypeVar

import msgspec

__all__ = ["UnreadableFile", "decode_versioned", "set_aside", "FORMAT_VERSION_KEY"]

T = TypeVar("T")

FORMAT_VERSION_KEY = "version"
"""The top-level key that names a kept file's format version (absent: 0)."""


class UnreadableFile(Exception):
    """A kept file this release cannot read: ``path`` and ``reason``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class _Version(msgspec.Struct):
    version: int = 0


def _known(versions: Collection[int]) -> str:
    return ", ".join(str(v) for v in sorted(versions))


def decode_versioned(data: bytes, type_: type[T], path: str, versions: Collection[int]) -> T:
    """``data`` (the bytes of ``path``) as ``type_``, if its format version is
    one of ``versions``; else ``UnreadableFile`` (see the module rules)."""
    if not data.strip():
        raise UnreadableFile(path, "the file is empty (a write that never finished?)")
    try:
        version = msgspec.json.decode(data, type=_Version).version
    except msgspec.ValidationError as error:
        raise UnreadableFile(path, f"its format version is not a number ({error})") from None
    except msgspec.DecodeError as error:
        raise UnreadableFile(path, f"it is not a JSON object: truncated or not this project's file ({error})") from None
    if version not in versions:
        raise UnreadableFile(path, f"it is in format version {version}, and this release reads versions"
                                   f" {_known(versions)} (a later release wrote it?)")
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError
        raise UnreadableFile(path, f"it does not hold what format version {version} holds ({error})") from None


def set_aside(path: str) -> str:
    """Rename ``path`` to ``<path>.unreadable-<UTC time>`` (a free name) and return it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = f"{path}.unreadable-{stamp}"
    target, n = base, 1
    while True:
        try:
            os.link(path, target)  # fails rather than overwrite an earlier one
        except FileExistsError:
            n += 1
            target = f"{base}.{n}"
            continue
        os.unlink(path)
        return target
