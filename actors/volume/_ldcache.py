"""The dynamic loader's cache (``/etc/ld.so.cache``), parsed directly.

Rules of the file (glibc ``elf/cache.c``, ``sysdeps/generic/dl-cache.h``):

- new format (ldconfig's default since glibc 2.32)::

      "glibc-ld.so.cache1.1"  nlibs:u32  len_strings:u32  flags:u8  pad[3]
      extension_offset:u32  unused[3]:u32                  (48 bytes)
      entries[nlibs]: flags:i32 key:u32 value:u32 osversion:u32 hwcap:u64
      string table (len_strings bytes)

  ``key`` (the library's name) and ``value`` (its path) are byte offsets from
  the start of that header. The header's ``flags`` byte gives the byte order
  (0: not recorded, i.e. native; 2: little endian; 3: big endian).
- old format (``ld.so-1.7.0``)::

      "ld.so-1.7.0" pad nlibs:u32                           (16 bytes)
      entries[nlibs]: flags:i32 key:u32 value:u32
      string table

  offsets count from the end of the entry array. In the "compat" layout
  (glibc 2.2 to 2.31's default) a complete new-format cache sits inside the
  old string table, at the next 8-byte boundary; when it is there its
  entries are the ones returned (they carry more), otherwise the old ones.
- Entry flags: the low byte is the type (0 libc4, 1 ELF, 2 ELF libc5, 3 ELF
  libc6), the next bits the architecture (0x0300 x86-64, 0x0a00 AArch64,
  ...). ``LdCacheEntry.is_64bit`` and ``arch`` decode them; every entry is
  returned, in file order, and the caller filters (``is_elf``).
- Anything that does not add up -- a short file, an unknown magic, an entry
  array or string table running past the end, an offset outside the string
  table, a string without its NUL -- raises one ``LdCacheError`` naming the
  file and the fault. Nothing here raises ``struct.error`` or ``IndexError``.
"""

from __future__ import annotations

import logging
import os
import struct
import sys

import msgspec

from ._errors import LdCacheError

__all__ = ["LdCacheEntry", "parse_ld_cache", "read_ld_cache", "DEFAULT_LD_CACHE"]

logger = logging.getLogger(__name__)

DEFAULT_LD_CACHE = "/etc/ld.so.cache"

MAGIC_NEW = b"glibc-ld.so.cache1.1"
MAGIC_OLD = b"ld.so-1.7.0"

_HEADER_NEW = "20sIIB3xI3I"      # 48 bytes
_ENTRY_NEW = "iIIIQ"             # 24 bytes
_HEADER_OLD = "11sxI"            # 16 bytes
_ENTRY_OLD = "iII"               # 12 bytes
_NEW_ALIGN = 8

FLAG_TYPE_MASK = 0x00FF
FLAG_REQUIRED_MASK = 0xFF00

_TYPES = {0x00: "libc4", 0x01: "ELF", 0x02: "libc5", 0x03: "libc6"}

# Architecture bits -> (name as ldconfig -p prints it, 64-bit?).
_ARCHES: dict[int, tuple[str, bool]] = {
    0x0000: ("", False),
    0x0100: ("64bit", True),            # SPARC 64
    0x0200: ("IA-64", True),
    0x0300: ("x86-64", True),
    0x0400: ("64bit", True),            # s390x
    0x0500: ("64bit", True),            # ppc64
    0x0600: ("N32", False),             # MIPS64 n32
    0x0700: ("64bit", True),            # MIPS64 n64
    0x0800: ("x32", False),             # x86-64 x32 ABI
    0x0900: ("hard-float", False),      # ARM hard float
    0x0A00: ("AArch64", True),
    0x0B00: ("soft-float", False),      # ARM soft float
    0x0C00: ("nan2008", False),         # MIPS 32 nan2008
    0x0D00: ("N32,nan2008", False),
    0x0E00: ("64bit,nan2008", True),
    0x0F00: ("soft-float", True),       # RISC-V lp64
    0x1000: ("double-float", True),     # RISC-V lp64d
    0x1100: ("soft-float", True),       # LoongArch lp64s
    0x1200: ("double-float", True),     # LoongArch lp64d
}


class LdCacheEntry(msgspec.Struct, frozen=True):
    """One library of the cache: its name (the soname) and its path."""

    name: str
    path: str
    flags: int
    os_version: int = 0
    hwcap: int = 0

    @property
    def is_elf(self) -> bool:
        """An ELF library (types ELF, libc5, libc6; not libc4's a.out)."""
        return (self.flags & FLAG_TYPE_MASK) in (0x01, 0x02, 0x03)

    @property
    def is_64bit(self) -> bool:
        """Whether the architecture bits name a 64-bit ABI."""
        return _ARCHES.get(self.flags & FLAG_REQUIRED_MASK, ("", False))[1]

    @property
    def arch(self) -> str:
        """The flags as ``ldconfig -p`` prints them, e.g. ``libc6,x86-64``."""
        kind = _TYPES.get(self.flags & FLAG_TYPE_MASK, "unknown")
        bits = self.flags & FLAG_REQUIRED_MASK
        if bits in _ARCHES:
            arch = _ARCHES[bits][0]
        else:
            arch = f"unknown=0x{bits:x}"
        return f"{kind},{arch}" if arch else kind


def read_ld_cache(path: str = DEFAULT_LD_CACHE) -> list[LdCacheEntry]:
    """Read and parse the loader cache at ``path`` (blocking)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise LdCacheError(
            f"Failed to read ld.so cache '{path}': {exc.strerror or exc}") from None
    return parse_ld_cache(data, path)


def parse_ld_cache(data: bytes, path: str = "<memory>") -> list[LdCacheEntry]:
    """Parse the bytes of a loader cache; ``path`` only names it in errors."""
    return _Parser(data, path).parse()


class _Parser:
    def __init__(self, data: bytes, path: str) -> None:
        self.data = data
        self.path = path

    def fail(self, what: str) -> LdCacheError:
        return LdCacheError(f"Invalid ld.so cache '{self.path}': {what}")

    def parse(self) -> list[LdCacheEntry]:
        data = self.data
        if data.startswith(MAGIC_NEW):
            return self.parse_new(0)
        if data.startswith(MAGIC_OLD):
            return self.parse_old()
        if not data:
            raise self.fail("the file is empty")
        raise self.fail(
            f"unknown magic {data[:20]!r} (expected {MAGIC_NEW.decode()!r}"
            f" or {MAGIC_OLD.decode()!r})")

    def entries_end(self, start: int, nlibs: int, entry_size: int, header: str) -> int:
        """Where ``nlibs`` entries starting at ``start`` end; a truncated file fails."""
        end = start + nlibs * entry_size
        if end > len(self.data):
            raise self.fail(
                f"truncated: {header} lists {nlibs} entries ({nlibs * entry_size} bytes) but only"
                f" {len(self.data) - start} bytes follow it")
        return end

    def parse_old(self) -> list[LdCacheEntry]:
        data = self.data
        header_size = struct.calcsize("=" + _HEADER_OLD)
        if len(data) < header_size:
            raise self.fail(
                f"truncated: the old-format header needs {header_size} bytes,"
                f" the file has {len(data)}")
        _, nlibs = struct.unpack_from("=" + _HEADER_OLD, data, 0)
        entry_size = struct.calcsize("=" + _ENTRY_OLD)
        entries_end = self.entries_end(header_size, nlibs, entry_size, "the old-format header")
        # Compat layout: the new format is embedded, 8-byte aligned, at the
        # start of the old string table.
        new_start = -(-entries_end // _NEW_ALIGN) * _NEW_ALIGN
        if data.startswith(MAGIC_NEW, new_start):
            return self.parse_new(new_start)
        entries = []
        for i in range(nlibs):
            flags, key, value = struct.unpack_from(
                "=" + _ENTRY_OLD, data, header_size + i * entry_size)
            name = self.string(entries_end, len(data), key, i, "name")
            lib = self.string(entries_end, len(data), value, i, "path")
            entries.append(LdCacheEntry(name=name, path=lib, flags=flags))
        return entries

    def parse_new(self, start: int) -> list[LdCacheEntry]:
        data = self.data
        header_size = struct.calcsize("<" + _HEADER_NEW)
        if len(data) - start < header_size:
            raise self.fail(
                f"truncated: the new-format header at offset {start} needs"
                f" {header_size} bytes, the file has {len(data) - start}")
        endian = data[start + 28]
        if endian == 0:
            order = "<" if sys.byteorder == "little" else ">"
        elif endian == 2:
            order = "<"
        elif endian == 3:
            order = ">"
        else:
            raise self.fail(f"invalid byte-order flag {endian} in the header")
        _, nlibs, len_strings, _, _, _, _, _ = struct.unpack_from(
            order + _HEADER_NEW, data, start)
        entry_size = struct.calcsize(order + _ENTRY_NEW)
        entries_start = start + header_size
        entries_end = self.entries_end(entries_start, nlibs, entry_size, "the header")
        strings_end = entries_end + len_strings
        if strings_end > len(data):
            raise self.fail(
                f"truncated: the string table of {len_strings} bytes runs"
                f" {strings_end - len(data)} bytes past the end of the file")
        entries = []
        for i in range(nlibs):
            flags, key, value, osversion, hwcap = struct.unpack_from(
                order + _ENTRY_NEW, data, entries_start + i * entry_size)
            name = self.string(start, strings_end, key, i, "name")
            lib = self.string(start, strings_end, value, i, "path")
            entries.append(LdCacheEntry(
                name=name, path=lib, flags=flags, os_version=osversion,
                hwcap=hwcap))
        return entries

    def string(self, base: int, end: int, offset: int, index: int, what: str) -> str:
        position = base + offset
        if position >= end:
            raise self.fail(
                f"entry {index}: {what} offset {offset} is outside the string"
                f" table ({end - base} bytes)")
        nul = self.data.find(b"\0", position, end)
        if nul < 0:
            raise self.fail(
                f"entry {index}: {what} at offset {offset} is not NUL-terminated"
                " before the end of the string table")
        return os.fsdecode(self.data[position:nul])
