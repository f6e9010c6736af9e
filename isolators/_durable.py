"""Writing a file's bytes so that they land: the one loop every atomic writer shares.

Rules:
- ``write_all(fd, data)`` writes every byte of ``data`` to ``fd``
  (``os.write`` may write less than asked: the rest is written until none
  is left) and then ``fsync``\\ s it, so a rename that follows publishes a
  file whose bytes are on disk. Opening the temporary file (its flags and
  mode), any ``fchmod`` before the sync, the rename, the directory's sync
  and the errors are the caller's: the CDI spec files, the service's
  records and the DRA driver's checkpoint each have rules of their own
  there.
- ``discard(path)`` removes a temporary file that will not be renamed
  into place (a failed write), as well as it can: a removal that fails
  leaves a temporary each writer's loader passes over.
"""

from __future__ import annotations

import os

__all__ = ["write_all", "discard"]


def write_all(fd: int, data: bytes, mode: int | None = None) -> None:
    """Write all of ``data`` to ``fd``, ``fchmod`` it to ``mode`` when given,
    then ``fsync`` it (see the module rules)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if mode is not None:
        os.fchmod(fd, mode)
    os.fsync(fd)


def discard(path: str) -> None:
    """Remove the temporary ``path`` if it can be (see the module rules)."""
    try:
        os.unlink(path)
    except OSError:
        pass
