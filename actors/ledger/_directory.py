"""The node ledger's directory: lease files, owner locks, one mutex. Every call blocks.

Layout (SPEC R-NL-1..3)::

    <node_ledger>/           0700, owned by the user running the front doors (root)
      lock                   the mutex: flock LOCK_EX to change leases, LOCK_SH to read them
      units/<uuid>.lease     one file per leased unit (``Lease`` as JSON); none: the unit is free
      owners/<sha>.owner     one per owner: {"version": 1, "owner": ...}; its process holds an OFD
                             write lock on it while it runs (the kernel drops it when the process dies)
      owners/<sha>.health    the units that owner holds unhealthy, and why (for ``ledger``)

Format versions (SPEC R-SH-3, ``actors.file_format``): every file names
its format as ``"version"`` (lease files, owner files and health files:
version 1 now; release 0.1.0 wrote none, version 0, the same fields).
Files are read through ``decode_versioned`` (versions ``READ_VERSIONS``);
a reader passes over fields it does not know, so a release still running
during a rolling update reads what the next one wrote.

Rules:
- ``LedgerDirectory.open(path)`` makes the directory (0700) and its two
  subdirectories if missing (``create=False``: a missing directory is a
  ``LedgerError``, for readers such as the operator's command) and opens them once: every later file is
  reached through those descriptors with ``O_NOFOLLOW``, never through a
  path again. A directory (or subdirectory, or the lock file) that is a
  symbolic link, not owned by this user, or writable by group or others is
  refused with a ``LedgerError`` naming it (sshd's StrictModes; SPEC
  R-SC-7): whoever may write there could hand out GPUs. ``path`` must be
  absolute.
- Changes run under the mutex (``flock`` on ``lock``, exclusive); reads
  under it shared, so nobody reads a half-made change. The mutex is held
  for one batch's reads and writes only. A wait for it is bounded
  (``timeout``, 10 s): a holder stopped in the middle (SIGSTOP) makes the
  call fail with a ``LedgerError`` saying so, never hang.
- ``apply(owner, batch)`` reads every lease, decides (``_batch.decide``),
  writes what changed and answers a ``BatchResult`` (every lease after it,
  and whether each other owner runs). A lease is written to a new
  temporary file (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600), ``fsync``\\ ed
  and renamed over the unit's file: a reader sees the old lease or the new
  one, never part of one. A return unlinks the file. The directory itself
  is not synced: a change lost with the power is harmless, since every
  container of the node went with it (an owner finding its own stale
  leases at its next start reconciles them away).
- A lease file that cannot be read or decoded (truncated, garbage, a
  format version this release does not read, or naming another unit than
  its file name) holds its unit for the owner ``unreadable:<file>``
  (``unreadable`` says why, by UUID): nobody takes the unit -- it may be
  in use by a front door that cannot say so now -- until the front door
  whose own truth shows it using the unit re-takes it (a ``proven`` take:
  ``_batch``), or an operator removes the file. A re-take moves the file
  aside first (``set_aside``: ``<file>.unreadable-<time>``, which no reader
  lists) and then renames the new lease into its place, under the mutex;
  the batch's result names both. A name that is not a regular file (a
  directory, a symbolic link) is never re-taken: nothing could be renamed
  over it; the operator removes it.
- An owner file is never moved aside, whatever it holds: its inode is the
  owner's lock. ``hold_owner`` rewrites it whole at every start (its
  content is for people). A health file nobody can read is passed over by
  ``view``; its owner moves it aside when it joins
  (``set_aside_own_health``) and writes what it reports next.
- Liveness (``owner_alive``) is the kernel's: an owner runs while a process
  holds the OFD write lock on its ``.owner`` file (``F_OFD_GETLK``; no pid,
  no time). ``hold_owner(owner)`` takes that lock (refused with a
  ``LedgerError`` when another process holds it: the owner already runs);
  the descriptor is close-on-exec, so commands a front door starts never
  keep it. Owner files are never removed: a name's lock file must stay the
  same inode while anyone may lock it.
- ``release_owner(owner)`` (the operator's ``ledger release``) removes every
  lease of an owner that does not run, and refuses while it does.
- ``view()`` is every lease, each owner's liveness and the health the
  owners reported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
import struct
import time
import urllib.parse
from collections.abc import Callable, Iterator

import msgspec

from actors.file_format import UnreadableFile, decode_versioned, set_aside

from ._batch import BatchResult, LeaseBatch, decide
from ._errors import LedgerError
from ._lease import UNREADABLE, Lease
from ._names import LEASE_SUFFIX, check_owner, lease_file_name, owner_file_name

__all__ = ["LedgerDirectory", "LedgerView", "OwnerLock", "LOCK_TIMEOUT", "FORMAT_VERSION", "READ_VERSIONS"]

FORMAT_VERSION = 1
"""The format version this release writes into lease, owner and health files."""
READ_VERSIONS = (0, 1)
"""The versions it reads (0: release 0.1.0's files, which named none)."""

LOCK_TIMEOUT = 10.0
"""Seconds a call waits for the ledger's mutex before it fails."""
_POLL = 0.001
_MAX_FILE = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_FLOCK = struct.Struct("hhqqi4x")
"""``struct flock`` (x86-64 and aarch64 layout): type, whence, start, len, pid."""

_encode = msgspec.json.Encoder().encode
_VERSION_PREFIX = b'{"version":%d,' % FORMAT_VERSION


def _encode_lease(lease: Lease) -> bytes:
    """A lease file's bytes: the lease with its format version first."""
    return _VERSION_PREFIX + _encode(lease)[1:]


class OwnerRecord(msgspec.Struct, frozen=True, kw_only=True):
    owner: str
    version: int = 0


class HealthReport(msgspec.Struct, frozen=True, kw_only=True):
    owner: str
    unhealthy: dict[str, str] = {}
    version: int = 0


class LedgerView(msgspec.Struct, frozen=True, kw_only=True):
    """The whole ledger at one moment (``LedgerDirectory.view``)."""

    directory: str
    leases: dict[str, Lease]
    """UUID -> lease."""
    alive: dict[str, bool]
    """Every owner with a lease or a health report -> whether it runs."""
    health: dict[str, dict[str, str]] = {}
    """Owner -> the units it reported unhealthy (UUID -> reason)."""


class OwnerLock:
    """The lock an owner holds on its file while it runs (``LedgerDirectory.hold_owner``)."""

    def __init__(self, owner: str, file: str, fd: int) -> None:
        self.owner = owner
        self.file = file
        self.fd = fd

    def release(self) -> None:
        """Close the descriptor (the kernel drops the lock); the owner is then not running."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LedgerDirectory:
    """One node ledger directory, opened once (see module rules)."""

    def __init__(self, path: str, fd: int, units: int, owners: int, lock: int, timeout: float) -> None:
        self.path = path
        self._fd = fd
        self._units = units
        self._owners = owners
        self._lock = lock
        self.timeout = timeout
        self._owner_fds: dict[str, int] = {}
        """Owner -> a read-only descriptor of its lock file (for liveness checks)."""
        self.unreadable: dict[str, str] = {}
        """UUID -> why its lease file could not be read (as of the last read)."""

    # -- opening -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, timeout: float = LOCK_TIMEOUT, create: bool = True) -> "LedgerDirectory":
        """Make (if missing and ``create``) and open the directory at ``path`` (see module rules)."""
        if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
            raise LedgerError(f"Invalid node ledger directory {path!r}: expected an absolute path")
        path = os.path.normpath(path)
        if not create and not os.path.lexists(path):
            raise LedgerError(f"There is no node ledger at {path}: no front door has run with it (--node_ledger"
                              " names another?)")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as error:
            raise LedgerError(f"Cannot make the node ledger directory {path}: {error.strerror}") from error
        opened: list[int] = []
        try:
            fd = _open_dir(path, None, path)
            opened.append(fd)
            units = _open_dir("units", fd, os.path.join(path, "units"), make=True)
            opened.append(units)
            owners = _open_dir("owners", fd, os.path.join(path, "owners"), make=True)
            opened.append(owners)
            lock = _open_file("lock", fd, os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT)
            opened.append(lock)
        except BaseException:
            for descriptor in opened:
                os.close(descriptor)
            raise
        return cls(path, fd, units, owners, lock, timeout)

    def close(self) -> None:
        """Close every descriptor (an owner lock taken with ``hold_owner`` is the caller's)."""
        for fd in (*self._owner_fds.values(), self._lock, self._owners, self._units, self._fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._owner_fds.clear()
        self._fd = self._units = self._owners = self._lock = -1

    # -- the mutex -----------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self._lock, operation)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LedgerError(
                        f"The node ledger {self.path} stayed locked by another process for {self.timeout:g} s"
                        " (a front door stopped while changing it?); try again once it runs"
                    ) from None
                time.sleep(_POLL)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    # -- owners --------------------------------------------------------------------
    def hold_owner(self, owner: str) -> OwnerLock:
        """Take ``owner``'s lock for as long as this process runs (see module rules)."""
        name = owner_file_name(owner)
        file = os.path.join(self.path, "owners", name)
        fd = _open_file(name, self._owners, file, os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise LedgerError(f"Cannot lock {file} for the node ledger owner {owner}: {error.strerror}")
                raise LedgerError(
                    f"The node ledger owner {owner} is already running on this node: another process holds"
                    f" its lock {file}. Stop that front door first, or give this one a name of its own"
                    " (another work directory or socket)"
                ) from None
            data = _encode(OwnerRecord(owner=owner, version=FORMAT_VERSION))
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)
            raise
        return OwnerLock(owner, file, fd)

    def owner_alive(self, owner: str) -> bool:
        """Whether a process holds ``owner``'s lock (the kernel's answer)."""
        fd = self._owner_fds.get(owner)
        if fd is None:
            try:
                check_owner(owner)
            except LedgerError:
                return False  # not a name any front door runs under (an unreadable lease)
            name = owner_file_name(owner)
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=self._owners)
            except FileNotFoundError:
                return False
            except OSError as error:
                raise LedgerError(f"Cannot read {os.path.join(self.path, 'owners', name)}: {error.strerror}")
            self._owner_fds[owner] = fd
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK

    # -- leases ----------------------------------------------------------------------
    def apply(self, owner: str, batch: LeaseBatch) -> BatchResult:
        """Carry out one owner's batch under the mutex (see module rules)."""
        with self._locked(exclusive=True):
            before = self._read_leases()
            irregular = {uuid for uuid, why in self.unreadable.items() if why == NOT_REGULAR}
            if irregular and any(set(take.proven) & irregular for take in batch.takes):
                batch = msgspec.structs.replace(batch, takes=tuple(
                    msgspec.structs.replace(take, proven=tuple(u for u in take.proven if u not in irregular))
                    for take in batch.takes))
            after, results = decide(before, owner, batch)
            for uuid, lease in before.items():
                if uuid not in after:
                    self._unlink(lease_file_name(uuid))
            moved: dict[str, tuple[str, str, str]] = {}
            for uuid, lease in after.items():
                old = before.get(uuid)
                if old != lease:
                    name = lease_file_name(uuid)
                    aside = None
                    if old is not None and old.owner.startswith(UNREADABLE):  # a proven re-take (_batch)
                        aside = functools.partial(self._set_aside_lease, uuid, name, moved)
                    self._write(self._units, name, _encode_lease(lease), aside)
            if batch.health is not None:
                self._write_health(owner, batch.health)
            others = {lease.owner for lease in after.values()} - {owner}
            alive = {name: self.owner_alive(name) for name in others}
        if any(result.conflicts for result in results):
            results = [
                msgspec.structs.replace(result, conflicts=tuple(
                    msgspec.structs.replace(conflict, alive=alive.get(conflict.lease.owner))
                    for conflict in result.conflicts))
                for result in results
            ]
        return BatchResult(takes=tuple(results), leases=after, alive=alive, set_aside=moved)

    def read(self) -> dict[str, Lease]:
        """Every lease now (UUID -> lease)."""
        with self._locked(exclusive=False):
            return self._read_leases()

    def view(self) -> LedgerView:
        """Every lease, each owner's liveness and the health reports (see module rules)."""
        with self._locked(exclusive=False):
            leases = self._read_leases()
            health = self._read_health()
        owners = {lease.owner for lease in leases.values()} | health.keys()
        return LedgerView(directory=self.path, leases=leases,
                          alive={owner: self.owner_alive(owner) for owner in sorted(owners)}, health=health)

    def release_owner(self, owner: str) -> list[Lease]:
        """Remove every lease of ``owner``, which must not be running (see module rules)."""
        check_owner(owner)
        with self._locked(exclusive=True):
            if self.owner_alive(owner):
                raise LedgerError(
                    f"The node ledger owner {owner} is running (a process holds its lock"
                    f" {os.path.join(self.path, 'owners', owner_file_name(owner))}): it returns its units itself."
                    " Release only the units of a front door that will not come back"
                )
            leases = self._read_leases()
            released = [lease for lease in leases.values() if lease.owner == owner]
            for lease in released:
                self._unlink(lease_file_name(lease.unit))
            try:
                os.unlink(_health_name(owner), dir_fd=self._owners)
            except FileNotFoundError:
                pass
        return sorted(released, key=lambda lease: lease.unit)

    # -- files -------------------------------------------------------------------------
    def _read_leases(self) -> dict[str, Lease]:
        leases: dict[str, Lease] = {}
        unreadable: dict[str, str] = {}
        for name in os.listdir(self._units):
            if name.startswith(".") or not name.endswith(LEASE_SUFFIX):
                continue
            uuid = _uuid_of(name)
            file = os.path.join(self.path, "units", name)
            data = _read(self._units, name)
            lease = None
            if data is None:
                if _regular(self._units, name):
                    unreadable[uuid] = "it is larger than 1 MiB"
                else:
                    unreadable[uuid] = NOT_REGULAR
            else:
                try:
                    lease = decode_versioned(data, Lease, file, READ_VERSIONS)
                except UnreadableFile as error:
                    unreadable[uuid] = error.reason
                else:
                    if lease.unit != uuid:
                        unreadable[uuid] = f"it names the unit {lease.unit}, not the {uuid} of its name"
                        lease = None
            if lease is None:
                lease = Lease(unit=uuid, owner=UNREADABLE + file)
            leases[uuid] = lease
        self.unreadable = unreadable
        return leases

    def set_aside_own_health(self, owner: str) -> tuple[str, str, str] | None:
        """``owner``'s health file, if nobody can read it, moved aside (see module
        rules): (the file, where it went, why), else None."""
        name = _health_name(owner)
        file = os.path.join(self.path, "owners", name)
        with self._locked(exclusive=True):
            data = _read(self._owners, name)
            if data is None:
                return None
            try:
                report = decode_versioned(data, HealthReport, file, READ_VERSIONS)
            except UnreadableFile as error:
                why = error.reason
            else:
                if _health_name(report.owner) == name:
                    return None
                why = f"it names the owner {report.owner}, not this one"
            return file, set_aside(file), why

    def _set_aside_lease(self, uuid: str, name: str, moved: dict[str, tuple[str, str, str]]) -> None:
        """Move the unreadable lease file ``name`` aside; say so in ``moved`` (see module rules)."""
        file = os.path.join(self.path, "units", name)
        moved[uuid] = (file, set_aside(file), self.unreadable.get(uuid, ""))

    def _read_health(self) -> dict[str, dict[str, str]]:
        reports: dict[str, dict[str, str]] = {}
        for name in os.listdir(self._owners):
            if name.startswith(".") or not name.endswith(".health"):
                continue
            data = _read(self._owners, name)
            try:
                report = (decode_versioned(data, HealthReport, os.path.join(self.path, "owners", name), READ_VERSIONS)
                          if data is not None else None)
            except UnreadableFile:
                report = None  # its owner moves it aside when it joins (see module rules)
            if report is not None and _health_name(report.owner) == name:
                reports[report.owner] = dict(report.unhealthy)
        return reports

    def _write_health(self, owner: str, unhealthy: dict[str, str]) -> None:
        name = _health_name(owner)
        if unhealthy:
            self._write(self._owners, name, _encode(HealthReport(owner=owner, unhealthy=dict(sorted(unhealthy.items())),
                                                                 version=FORMAT_VERSION)))
        else:
            try:
                os.unlink(name, dir_fd=self._owners)
            except FileNotFoundError:
                pass

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._units)
        except FileNotFoundError:
            pass

    def _write(self, directory: int, name: str, data: bytes, before_rename: Callable[[], None] | None = None) -> None:
        """``data`` into ``name`` atomically (see module rules); ``before_rename``
        runs once the new bytes are synced, just before they replace ``name``."""
        temporary = f".{name}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(temporary, flags, 0o600, dir_fd=directory)
        except FileExistsError:  # left by a crash: the mutex says nobody else writes it now
            os.unlink(temporary, dir_fd=directory)
            fd = os.open(temporary, flags, 0o600, dir_fd=directory)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=directory)
            raise
        os.close(fd)
        if before_rename is not None:
            try:
                before_rename()
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=directory)
                raise
        os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)


def _health_name(owner: str) -> str:
    return owner_file_name(owner)[: -len(".owner")] + ".health"


def _uuid_of(name: str) -> str:
    """The UUID a lease file name encodes (``lease_file_name`` reversed)."""
    return urllib.parse.unquote(name[: -len(LEASE_SUFFIX)], encoding="ascii", errors="replace")


NOT_REGULAR = "it is not a regular file (a directory or a symbolic link?)"
"""Why a lease name that is no regular file cannot be read (it is never re-taken)."""


def _regular(directory: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _read(directory: int, name: str) -> bytes | None:
    """A regular file's bytes (None: not a regular file, gone, or too big)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=directory)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_FILE:
            return None
        return os.read(fd, _MAX_FILE)
    finally:
        os.close(fd)


def _open_dir(name: str, parent: int | None, shown: str, make: bool = False) -> int:
    """Open a directory of the ledger without following a link; check who may write it."""
    if make:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        except OSError as error:
            raise LedgerError(f"Cannot make {shown} for the node ledger: {error.strerror}") from error
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as error:
        hint = " (a symbolic link: the ledger never follows one)" if error.errno in (errno.ELOOP, errno.ENOTDIR) else ""
        raise LedgerError(f"Cannot open the node ledger directory {shown}: {error.strerror}{hint}") from error
    try:
        _check_trusted(fd, shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file(name: str, parent: int, shown: str, flags: int) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK, 0o600, dir_fd=parent)
    except OSError as error:
        hint = " (a symbolic link: the ledger never follows one)" if error.errno == errno.ELOOP else ""
        raise LedgerError(f"Cannot open {shown} of the node ledger: {error.strerror}{hint}") from error
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LedgerError(f"{shown} of the node ledger is not a regular file; remove it")
        _check_trusted(fd, shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_trusted(fd: int, shown: str) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise LedgerError(f"The node ledger's {shown} is owned by uid {info.st_uid}, not by this user"
                          f" (uid {os.geteuid()}): whoever owns it could hand out GPUs. Remove it or fix its owner")
    if info.st_mode & 0o022:
        raise LedgerError(f"The node ledger's {shown} is writable by group or others (mode"
                          f" {info.st_mode & 0o7777:04o}): whoever may write it could hand out GPUs. chmod go-w it")
