"""Loader caches written by hand, for tests, demos and the simulated node.

Rules:
- ``new_cache_bytes(entries)`` is a new-format cache (``glibc-ld.so.cache1.1``,
  what ``ldconfig`` writes today) of ``(name, path, flags)`` rows, in any byte
  order (``order``; ``endian_flag`` to write a lying header).
- ``write_ld_cache(path, entries=())`` writes one; with no entries it is the
  cache of a node that has no driver libraries: a volume built from it
  copies nothing from the host (a simulated node's ``--ld_cache``).
- Nothing here runs on a real node.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

__all__ = ["new_cache_bytes", "write_ld_cache"]


def new_cache_bytes(entries: Iterable[tuple[str, str, int]], order: str = "<",
                    endian_flag: int | None = None) -> bytes:
    """A new-format cache (``glibc-ld.so.cache1.1``) of (name, path, flags)."""
    entries = list(entries)
    header_size, entry_size = 48, 24
    strings = bytearray()
    offsets = []
    base = header_size + entry_size * len(entries)
    for name, path, _ in entries:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += path.encode() + b"\0"
        offsets.append((key, value))
    if endian_flag is None:
        endian_flag = 2 if order == "<" else 3
    out = bytearray(struct.pack(order + "20sIIB3xI3I", b"glibc-ld.so.cache1.1",
                                len(entries), len(strings), endian_flag, 0, 0, 0, 0))
    for (_, _, flags), (key, value) in zip(entries, offsets):
        out += struct.pack(order + "iIIIQ", flags, key, value, 0, 0)
    return bytes(out + strings)


def write_ld_cache(path: str | os.PathLike[str], entries: Iterable[tuple[str, str, int]] = ()) -> str:
    """Write a native-order new-format cache of ``entries`` at ``path``; the path."""
    order = "<" if struct.pack("=I", 1) == struct.pack("<I", 1) else ">"
    with open(path, "wb") as handle:
        handle.write(new_cache_bytes(entries, order))
    return os.fspath(path)
