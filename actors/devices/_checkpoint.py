"""The cgroups v2 device checkpoint: every managed cgroup's (allow, deny).

Rules:
- cgroups v2 has no ``devices.list``: the kernel holds only compiled
  programs, so the policy of each cgroup lives in one JSON file under
  ``work_dir`` (``<work_dir>/devices/cgroups_v2.json``), written whole and
  atomically: a temporary file, ``fsync``, ``rename`` over the old one,
  ``fsync`` of the directory. A reader sees the old file or the new one.
- The file names the root it belongs to (``<hierarchy>/<cgroups_root>``);
  a file for another root is refused.
- A missing file is a first start (no state). A file that is empty,
  truncated, not JSON, of the wrong shape or with a bad rule or cgroup name
  raises ``CheckpointError`` with an operator hint: it is never read as
  empty, since that would hand out GPUs that containers still use.
- Leftover temporary files (a crash while writing) are ignored and replaced.
"""

from __future__ import annotations

import os
from typing import Mapping

import msgspec

from ._backend import validate_cgroup
from ._errors import CheckpointError, DeviceControlError
from ._policy import Policy

VERSION = 1


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    allow: tuple[str, ...]
    deny: tuple[str, ...]


class _File(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    root: str
    cgroups: dict[str, _Entry]


_decoder = msgspec.json.Decoder(_File)
_encoder = msgspec.json.Encoder()


class DeviceCheckpoint:
    """One checkpoint file (see module rules)."""

    def __init__(self, file: str, root: str) -> None:
        self.file = file
        self.root = root

    def _error(self, reason: str) -> CheckpointError:
        return CheckpointError(
            f"Device checkpoint {self.file} is unreadable: {reason}. It records which devices"
            f" (GPUs) each container cgroup under {self.root} may use, so it is never read as"
            " empty. Restore it from a backup, or stop the containers, remove their cgroups"
            " and delete the file to start afresh."
        )

    def load(self) -> dict[str, Policy]:
        """Every cgroup's policy; {} when there is no file yet."""
        try:
            with open(self.file, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return {}
        except OSError as error:
            raise self._error(f"cannot read it ({error.strerror})") from error
        if not data:
            raise self._error("it is empty (truncated)")
        try:
            decoded = _decoder.decode(data)
        except msgspec.DecodeError as error:
            raise self._error(f"{error} (truncated or garbled)") from error
        if decoded.version != VERSION:
            raise self._error(f"unknown version {decoded.version} (this build reads version {VERSION})")
        if decoded.root != self.root:
            raise self._error(f"it belongs to cgroup root {decoded.root!r}, not {self.root!r}")
        states: dict[str, Policy] = {}
        for cgroup, entry in decoded.cgroups.items():
            try:
                validate_cgroup(cgroup)
                states[cgroup] = Policy.from_lines(entry.allow, entry.deny)
            except DeviceControlError as error:
                raise self._error(f"bad entry for cgroup {cgroup!r}: {error}") from error
        return states

    def encode(self, states: Mapping[str, Policy]) -> bytes:
        """The file's bytes for ``states``."""
        cgroups = {cgroup: _Entry(*states[cgroup].lines()) for cgroup in sorted(states)}
        return _encoder.encode(_File(VERSION, self.root, cgroups))

    def write(self, states: Mapping[str, Policy]) -> None:
        """Replace the file with ``states``, atomically and durably."""
        data = self.encode(states)
        directory = os.path.dirname(self.file)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        temporary = self.file + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, self.file)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
