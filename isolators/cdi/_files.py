"""CDI spec files in a spec directory: atomic writes, removal, listing.

Rules:
- ``write_spec_file(directory, name, data)`` writes ``data`` to a hidden
  temporary file beside the target (``.<name>.<pid>.<random>.tmp``: engines
  read only ``*.json`` / ``*.yaml``, so they never see it), fsyncs it,
  renames it over ``<directory>/<name>`` and fsyncs the directory. Readers
  see the old spec or the new one, never a part. On any failure the
  temporary file is removed and one ``CdiWriteError`` says what is wrong,
  naming the directory: it does not exist, is not a directory, is
  read-only, or is full. The directory itself is never created (an engine
  reads a fixed list; a typo must not pass unseen).
- ``name`` is a plain file name ending in ``.json`` or ``.yaml`` (no ``/``,
  not hidden); anything else is refused before the filesystem is touched.
- ``remove_spec_file`` removes one file; a file already gone is not an
  error (True when it removed something).
- ``list_spec_files(directory, prefix)`` lists the spec files whose names
  start with ``prefix`` and the temporary files a crashed write of such a
  name left behind; nothing else in the directory is looked at.
- ``read_spec_files(directory, prefix)`` reads our spec files (not the
  temporaries) into name -> bytes; ``ensure_spec_file`` rewrites one file
  only when it is missing or its bytes differ, and says which.
- All of these block: callers run them through their executor, one job
  per container operation (``apply_spec_changes`` does a batch of writes
  and removals in one call).
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Iterable

from runtime import Failure

from .._durable import discard, write_all

__all__ = [
    "CdiWriteError", "write_spec_file", "remove_spec_file", "list_spec_files", "apply_spec_changes",
    "is_temporary_name", "read_spec_files", "ensure_spec_file",
]

_TMP_SUFFIX = ".tmp"


class CdiWriteError(Failure):
    """A CDI spec file could not be written or removed; the message says why."""


def _check_name(name: str) -> None:
    if (not isinstance(name, str) or not name or "/" in name or "\x00" in name or name.startswith(".")
            or not name.endswith((".json", ".yaml"))):
        raise CdiWriteError(f"Invalid CDI spec file name {name!r}: expected a plain name ending in .json or .yaml")


def _reason(directory: str, error: OSError) -> str:
    code = error.errno
    if code == errno.ENOENT and not os.path.isdir(directory):
        return (f"the CDI spec directory '{directory}' does not exist (create it first; container engines"
                " read /etc/cdi and /var/run/cdi)")
    if code == errno.ENOTDIR:
        return f"'{directory}' is not a directory"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the CDI spec directory '{directory}' is read-only ({os.strerror(code)})"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"the CDI spec directory '{directory}' is full ({os.strerror(code)})"
    return error.strerror or str(error)


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` is a temporary file ``write_spec_file`` makes."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_spec_file(directory: str, name: str, data: bytes) -> str:
    """Atomically write ``<directory>/<name>``; returns its path (see the module rules)."""
    _check_name(name)
    path = os.path.join(directory, name)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise CdiWriteError(f"Failed to write CDI spec '{path}': {_reason(directory, error)}") from error
    try:
        try:
            write_all(fd, data, mode=0o644)  # the umask must not hide the spec from the engine
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except OSError as error:
        discard(temporary)
        raise CdiWriteError(f"Failed to write CDI spec '{path}': {_reason(directory, error)}") from error
    try:
        _fsync_directory(directory)
    except OSError:
        pass  # the rename is done; durability of the entry is best effort here
    return path


def remove_spec_file(directory: str, name: str) -> bool:
    """Remove ``<directory>/<name>`` (or a temporary file of ours); False if it was not there."""
    if not is_temporary_name(name):
        _check_name(name)
    elif "/" in name or "\x00" in name:
        raise CdiWriteError(f"Invalid CDI spec file name {name!r}")
    path = os.path.join(directory, name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as error:
        raise CdiWriteError(f"Failed to remove CDI spec '{path}': {_reason(directory, error)}") from error
    return True


def list_spec_files(directory: str, prefix: str) -> list[str]:
    """Names of the spec files starting with ``prefix`` and of our leftover temporary files, sorted."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as error:
        raise CdiWriteError(f"Failed to list CDI specs in '{directory}': {_reason(directory, error)}") from error
    found = []
    for name in names:
        if name.startswith(prefix) and name.endswith((".json", ".yaml")):
            found.append(name)
        elif is_temporary_name(name) and name[1:].startswith(prefix):
            found.append(name)
    return sorted(found)


def apply_spec_changes(directory: str, writes: Iterable[tuple[str, bytes]], removals: Iterable[str]) -> None:
    """Write and remove several spec files in one blocking call (one executor job).

    Every change is attempted; the first failure is raised after the rest ran."""
    failure: CdiWriteError | None = None
    for name, data in writes:
        try:
            write_spec_file(directory, name, data)
        except CdiWriteError as error:
            failure = failure or error
    for name in removals:
        try:
            remove_spec_file(directory, name)
        except CdiWriteError as error:
            failure = failure or error
    if failure is not None:
        raise failure


def read_spec_files(directory: str, prefix: str) -> dict[str, bytes]:
    """The bytes of every spec file starting with ``prefix`` (temporaries left out)."""
    found: dict[str, bytes] = {}
    for name in list_spec_files(directory, prefix):
        if is_temporary_name(name):
            continue
        try:
            with open(os.path.join(directory, name), "rb") as handle:
                found[name] = handle.read()
        except FileNotFoundError:
            continue  # removed while listing
        except OSError as error:
            raise CdiWriteError(f"Failed to read CDI spec '{os.path.join(directory, name)}':"
                                f" {_reason(directory, error)}") from error
    return found


def ensure_spec_file(directory: str, name: str, data: bytes) -> str | None:
    """Make ``<directory>/<name>`` hold ``data``: None when it already did,
    ``"missing"`` or ``"differed"`` when it had to be (re)written."""
    _check_name(name)
    try:
        with open(os.path.join(directory, name), "rb") as handle:
            if handle.read() == data:
                return None
        state = "differed"
    except FileNotFoundError:
        state = "missing"
    except OSError:
        state = "differed"  # unreadable (a directory in the way, ...): the write says why it fails
    write_spec_file(directory, name, data)
    return state
