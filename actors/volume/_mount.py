"""Making sure the volume's binaries can run: the ``noexec`` check (MESOS-5923).

Rules:
- The filesystem holding a path is the mount in ``/proc/self/mountinfo``
  whose mount point is the longest path prefix (whole components, unlike
  Mesos' string prefix) of the path's real path; among mounts stacked on the
  same point the last listed (the topmost) wins.
- If that mount's per-mount options contain ``noexec``, a ``tmpfs``
  (``nosuid,nodev``, ``mode=755``) is mounted over the volume directory, so
  the driver binaries copied into it can be executed, and a log line says so.
  Mounting needs root: without it a warning says the binaries will not run
  and the volume is built anyway.
- A failed mount raises ``VolumeError("Failed to mount '<path>': ...")``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import msgspec

from ._errors import VolumeError

__all__ = ["MountEntry", "read_mount_table", "mount_of", "ensure_executable"]

logger = logging.getLogger(__name__)

MS_NOSUID = 0x2
MS_NODEV = 0x4


class MountEntry(msgspec.Struct, frozen=True):
    """One line of ``/proc/<pid>/mountinfo`` (the fields the volume needs)."""

    target: str
    fs_type: str
    source: str
    options: tuple[str, ...]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    if "\\" not in field:
        return field
    out = bytearray()
    raw = field.encode("utf-8", "surrogateescape")
    i = 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 4 <= len(raw) and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return os.fsdecode(bytes(out))


def read_mount_table(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    """The mounts of this process's mount namespace, in table order."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise VolumeError(f"Failed to get mount table: {exc}") from None
    table = []
    for line in lines:
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
            table.append(MountEntry(
                target=_unescape(fields[4]),
                options=tuple(fields[5].split(",")),
                fs_type=fields[separator + 1],
                source=_unescape(fields[separator + 2]),
            ))
        except (ValueError, IndexError):
            raise VolumeError(
                f"Failed to get mount table: malformed line in '{path}': {line!r}") from None
    return table


def _is_under(path: str, root: str) -> bool:
    if root == "/":
        return True
    return path == root or path.startswith(root.rstrip("/") + "/")


def mount_of(path: str, table: list[MountEntry]) -> MountEntry | None:
    """The mount holding ``path`` (already a real path) in ``table``."""
    best: MountEntry | None = None
    for entry in table:
        if _is_under(path, entry.target):
            if best is None or len(entry.target) >= len(best.target):
                best = entry
    return best


def _mount_tmpfs(target: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    result = libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs",
                        ctypes.c_ulong(MS_NOSUID | MS_NODEV), b"mode=755")
    if result != 0:
        errno = ctypes.get_errno()
        raise VolumeError(f"Failed to mount '{target}': {os.strerror(errno)}")


def ensure_executable(host_path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Mount a tmpfs over ``host_path`` if its filesystem is ``noexec``.

    Returns whether a tmpfs was mounted. Blocking.
    """
    real = os.path.realpath(host_path)
    entry = mount_of(real, read_mount_table(mountinfo))
    if entry is None or "noexec" not in entry.options:
        return False
    if os.geteuid() != 0:
        logger.warning(
            "The NVIDIA volume '%s' is on '%s', which is mounted noexec; only root"
            " can mount a tmpfs over it, so the driver binaries in the volume"
            " (nvidia-smi, ...) will not be executable in containers",
            host_path, entry.target)
        return False
    _mount_tmpfs(host_path)
    logger.info(
        "Mounted a tmpfs over the NVIDIA volume '%s': its filesystem '%s' is"
        " mounted noexec, which would stop containers from running the driver"
        " binaries (nvidia-smi, ...) copied into it", host_path, entry.target)
    return True
