"""The files the service trusts, checked as sshd's StrictModes checks a user's (SPEC R-SC-7).

Rules:
- ``check_trusted_dir(path, what)`` (blocking) resolves ``path`` and
  checks it and every directory above it, up to ``/``: each that exists
  must be a directory owned by root (or by the service's own user, when
  it does not run as root) and writable by no one else -- except a parent
  with the sticky bit (``/tmp``), whose entries only their owners may
  replace. Anything else raises ``UntrustedPath`` naming the directory,
  what is wrong and the fix, and the service refuses to start: a user who
  could replace any of them could make the root service follow a link
  into a file of their choosing.
- Directories that do not exist yet are not checked: the service makes
  them (mode 0700 for its work dir, 0755 for its socket's).
"""

from __future__ import annotations

import os
import stat

from runtime import Failure

__all__ = ["UntrustedPath", "check_trusted_dir"]


class UntrustedPath(Failure):
    """A directory the service must not trust; the message names it and the fix."""


def check_trusted_dir(path: str, what: str) -> str:
    """``path`` resolved, once it and its parents are trusted (see module rules)."""
    resolved = os.path.realpath(path)
    owners = {0, os.geteuid()}
    current = resolved
    while True:
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            info = None
        if info is not None:
            if not stat.S_ISDIR(info.st_mode):
                raise UntrustedPath(f"The {what} {path}: {current} is not a directory")
            if info.st_uid not in owners:
                raise UntrustedPath(f"The {what} {path} is not safe: {current} is owned by uid {info.st_uid}, not"
                                    f" root (chown root {current})")
            sticky_parent = current != resolved and info.st_mode & stat.S_ISVTX
            if info.st_mode & 0o022 and not sticky_parent:
                raise UntrustedPath(f"The {what} {path} is not safe: {current} has mode"
                                    f" {stat.S_IMODE(info.st_mode):04o}, writable by others (chmod go-w {current})")
        parent = os.path.dirname(current)
        if parent == current:
            return resolved
        current = parent
