#!/usr/bin/env python3
"""The CDI hook of this project: ``update-ldcache``, run by the container runtime on the host.

Rules (R-DR-2; the shape of NVIDIA's ``nvidia-cdi-hook update-ldcache``):
- ``<program> update-ldcache --folder DIR [--folder DIR ...] [--ldconfig
  PATH]`` is a ``createContainer`` hook: the runtime runs it once the
  container's mounts are in place and before its process starts, with
  the container's OCI state (JSON) on stdin. Its ``bundle`` names the
  bundle directory, whose ``config.json`` gives ``root.path`` (relative
  to the bundle, or absolute): the container's root filesystem as the
  hook sees it. A state or config that cannot be read, or a root that is
  empty or ``/``, is one line on stderr and exit 1 (the runtime then
  refuses to start the container: never a container without its driver).
- In the container's root (``chroot``: every path and symlink resolves
  inside it, so an image's ``/etc`` that is a symlink cannot make the hook
  write on the host) it writes ``/etc/ld.so.conf.d/00-gpu-isolator.conf``
  (mode 0644, atomically) listing the folders, for any later ``ldconfig``
  the image runs, then executes the host's ``ldconfig`` (default
  ``/sbin/ldconfig``, opened before the ``chroot``) as ``ldconfig -f
  /etc/ld.so.conf -C /etc/ld.so.cache <folders>``: the folders are also
  given on the command line, so an image without an ``ld.so.conf`` that
  includes ``ld.so.conf.d`` (busybox, distroless) still gets them in its
  cache. The container's own loader cache then finds the driver's
  libraries; no ``PATH`` or ``LD_LIBRARY_PATH`` is set, so a container's
  own (conda, a venv, a CUDA image) stays as it was.
- A folder is an absolute path with no ``..`` and no newline (it becomes a
  line of a conf file); anything else is refused before anything is done.
- Standard library only, and runnable as a file (``python3 -I <this file>
  update-ldcache ...``): the hook runs on the host, where the package's
  dependencies may not be. ``main(argv)`` is the command; the spec
  renders its invocation with ``hook_args``.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys

__all__ = ["CONF_FILE", "DEFAULT_LDCONFIG", "HOOK_FILE", "UPDATE_LDCACHE", "HookError", "container_root",
           "hook_args", "main", "update_ldcache"]

UPDATE_LDCACHE = "update-ldcache"
CONF_FILE = "/etc/ld.so.conf.d/00-gpu-isolator.conf"
DEFAULT_LDCONFIG = "/sbin/ldconfig"
HOOK_FILE = os.path.abspath(__file__)
"""This file: what a host's Python runs as the hook (``python3 -I HOOK_FILE update-ldcache ...``)."""


class HookError(Exception):
    """The hook cannot do its work; the message says what and where."""


def hook_args(folders: list[str], ldconfig: str | None = None) -> list[str]:
    """The arguments after the program: ``update-ldcache --folder F ... [--ldconfig PATH]``."""
    args = [UPDATE_LDCACHE]
    for folder in folders:
        args += ["--folder", _check_folder(folder)]
    if ldconfig is not None:
        args += ["--ldconfig", ldconfig]
    return args


def _check_folder(folder: str) -> str:
    if (not isinstance(folder, str) or not folder.startswith("/") or "\n" in folder or "\0" in folder
            or ".." in folder.split("/")):
        raise HookError(f"Invalid --folder {folder!r}: expected an absolute path without '..' or newlines")
    return folder


def container_root(state: bytes) -> str:
    """The container's root filesystem from its OCI state (see module rules)."""
    try:
        bundle = json.loads(state)["bundle"]
    except (ValueError, KeyError, TypeError) as error:
        raise HookError(f"Cannot read the container's OCI state on stdin ({type(error).__name__}: {error});"
                        " the runtime passes it to a createContainer hook") from None
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        raise HookError(f"The container's OCI state names no absolute bundle (got {bundle!r})")
    config = os.path.join(bundle, "config.json")
    try:
        with open(config, "rb") as handle:
            root = json.load(handle)["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise HookError(f"Cannot read root.path from {config} ({type(error).__name__}: {error})") from None
    if not isinstance(root, str) or not root:
        raise HookError(f"{config} names no root.path (got {root!r})")
    root = posixpath.normpath(posixpath.join(bundle, root))
    if root == "/":
        raise HookError(f"{config} names the host's / as the container's root: refusing to change its loader cache")
    return root


def _write_conf(folders: list[str]) -> None:
    """``CONF_FILE`` in the current root (after ``chroot``), atomically, mode 0644."""
    directory = posixpath.dirname(CONF_FILE)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    temporary = f"{CONF_FILE}.tmp-{os.getpid()}"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(descriptor, "".join(f"{folder}\n" for folder in dict.fromkeys(folders)).encode())
        os.fchmod(descriptor, 0o644)
    finally:
        os.close(descriptor)
    os.replace(temporary, CONF_FILE)


def update_ldcache(state: bytes, folders: list[str], ldconfig: str = DEFAULT_LDCONFIG) -> None:
    """Do the hook's work and become ``ldconfig`` (never returns unless it fails: ``HookError``)."""
    folders = [_check_folder(folder) for folder in folders]
    root = container_root(state)
    try:
        program = os.open(ldconfig, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise HookError(f"Cannot open the host's ldconfig {ldconfig!r}: {error.strerror} (pass --ldconfig PATH)")
    try:
        os.chroot(root)
        os.chdir("/")
    except OSError as error:
        raise HookError(f"Cannot enter the container's root {root}: {error.strerror}") from None
    try:
        _write_conf(folders)
    except OSError as error:
        raise HookError(f"Cannot write {CONF_FILE} in the container's root {root}: {error.strerror}") from None
    args = ["ldconfig", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *dict.fromkeys(folders)]
    try:
        os.execve(program, args, {})
    except OSError as error:
        raise HookError(f"Cannot run the host's ldconfig {ldconfig!r} in {root}: {error.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-isolator-cdi-hook", description="This project's CDI hooks.")
    commands = parser.add_subparsers(dest="command", required=True)
    update = commands.add_parser(UPDATE_LDCACHE, help="add folders to the container's loader cache"
                                 " (a createContainer hook: the OCI state on stdin)")
    update.add_argument("--folder", action="append", default=[], required=True,
                        help="a folder of the container whose libraries the loader must find (repeatable)")
    update.add_argument("--ldconfig", default=DEFAULT_LDCONFIG, help=f"the host's ldconfig (default {DEFAULT_LDCONFIG})")
    args = parser.parse_args(argv)
    try:
        update_ldcache(sys.stdin.buffer.read(), args.folder, args.ldconfig)
    except HookError as error:
        print(f"gpu-isolator-cdi-hook {UPDATE_LDCACHE}: error: {error}", file=sys.stderr)
        return 1
    return 0  # pragma: no cover - update_ldcache became ldconfig


if __name__ == "__main__":
    sys.exit(main())
