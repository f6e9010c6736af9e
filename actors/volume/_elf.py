"""ELF facts the volume needs about a library, read with pyelftools.

Rules:
- ``read_elf(path)`` returns an ``ElfInfo``: the class (32 or 64), the
  machine, the ``DT_NEEDED`` entries in file order, and the ABI version of
  the ``NT_GNU_ABI_TAG`` note (owner ``GNU``) as ``"major.minor.tiny"``
  (``"2.3.99"``), or ``None`` when the file has no such note.
- Notes are looked for in ``SHT_NOTE`` sections, and in ``PT_NOTE``
  segments when the file has no section headers; ``DT_NEEDED`` likewise in
  the dynamic section, else the ``PT_DYNAMIC`` segment.
- A file that is not ELF, is truncated or has corrupt structures raises one
  ``ElfError`` naming the file and the fault ("Failed to load ELF file
  '<path>': ..."); pyelftools' own exceptions never escape.
"""

from __future__ import annotations

import logging
import struct

import msgspec
from elftools.elf.dynamic import DynamicSection, DynamicSegment
from elftools.elf.elffile import ELFFile

from ._errors import ElfError

__all__ = ["ElfInfo", "read_elf"]

logger = logging.getLogger(__name__)

_ELF_MAGIC = b"\x7fELF"


class ElfInfo(msgspec.Struct, frozen=True):
    """What the volume needs to know about one ELF file."""

    path: str
    elf_class: int
    machine: str
    needed: tuple[str, ...] = ()
    abi_version: str | None = None


def read_elf(path: str) -> ElfInfo:
    """Read the class, NEEDED entries and ABI note of the ELF file at ``path``."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_ELF_MAGIC))
            if head != _ELF_MAGIC:
                raise ElfError(
                    f"Failed to load ELF file '{path}': not an ELF file"
                    f" (starts with {head!r}, expected {_ELF_MAGIC!r})")
            f.seek(0)
            try:
                return _read(path, ELFFile(f))
            except ElfError:
                raise
            except Exception as exc:  # pyelftools raises many kinds on corrupt input
                raise ElfError(
                    f"Failed to load ELF file '{path}': corrupt or truncated"
                    f" ({type(exc).__name__}: {exc})") from exc
    except OSError as exc:
        raise ElfError(
            f"Failed to load ELF file '{path}': {exc.strerror or exc}") from None


def _read(path: str, elf: ELFFile) -> ElfInfo:
    elf_class = elf.elfclass
    if elf_class not in (32, 64):
        raise ElfError(f"Failed to load ELF file '{path}': unknown ELF class {elf_class}")
    return ElfInfo(
        path=path,
        elf_class=elf_class,
        machine=str(elf["e_machine"]),
        needed=tuple(_needed(elf)),
        abi_version=_abi_version(elf, path),
    )


def _needed(elf: ELFFile) -> list[str]:
    dynamic = None
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            dynamic = section
            break
    if dynamic is None:
        for segment in elf.iter_segments():
            if isinstance(segment, DynamicSegment):
                dynamic = segment
                break
    if dynamic is None:
        return []
    return [str(tag.needed) for tag in dynamic.iter_tags("DT_NEEDED")]


def _abi_version(elf: ELFFile, path: str) -> str | None:
    containers = [s for s in elf.iter_sections() if s["sh_type"] == "SHT_NOTE"]
    if not containers:
        containers = [s for s in elf.iter_segments() if s["p_type"] == "PT_NOTE"]
    order = "<" if elf.little_endian else ">"
    for container in containers:
        for note in container.iter_notes():
            if note["n_name"] != "GNU" or note["n_type"] != "NT_GNU_ABI_TAG":
                continue
            desc = bytes(note["n_descdata"])
            if len(desc) < 16:
                raise ElfError(
                    f"Failed to load ELF file '{path}': the ABI note"
                    f" has {len(desc)} bytes of data, expected 16")
            _, major, minor, tiny = struct.unpack_from(order + "4I", desc)
            return f"{major}.{minor}.{tiny}"
    return None
