"""The device backend port: what cgroups v1, cgroups v2 and in-memory share.

Rules:
- A backend only applies: it is synchronous, blocking, and called from one
  thread at a time (the device control actor's executor job). It holds no
  event-loop objects.
- A backend manages the cgroups below one root, ``<hierarchy>/<cgroups_root>``.
  Every method takes a cgroup as a relative path under that root, checked by
  ``validate_cgroup``; nothing is ever written outside the root -- except by
  ``confine(path, access)`` (SPEC R-SC-8), which only ever takes devices
  away: it denies ``access.deny`` to an existing cgroup ``path`` named from
  the hierarchy's root (``validate_confined``: never the root, an ancestor
  of it or a cgroup inside it) and so to every cgroup below it. Applying
  it again is cheap and changes nothing that holds.
- Every kernel operation (mkdir, open, each rule write, a read, each bpf(2)
  command, rmdir ...) goes through the backend's ``kernel`` (``_kernel``:
  the one seam, production's ``KERNEL`` unless a test gives it a
  fault-injecting one): one code path, whoever runs it. An ``OSError``
  becomes a ``KernelOperationError`` naming the operation and the target,
  with the kernel's errno.
- A failed ``configure`` / ``reconfigure`` rolls the cgroup back to what it
  was before (a new cgroup is removed again), then raises the original
  error; a rollback that fails too is logged and named in the error.
- An operation is applied through ``applier(backend)``, the one function
  every driver (in line, a thread, a device worker process) uses: its
  method's value, or the exception it raised (one failure never stops the
  others); an unknown kind is its own error (``unknown_operation``).
  ``apply_batch(ops)`` applies a batch with it, in order.
- An exception that is not an ``Exception`` (an ``AgentCrash``, see
  ``actors.devices.testing``) is never rolled back nor caught per
  operation: nothing runs after it, as if the process had died there.
- ``blocking = False`` marks a backend that never blocks (in memory):
  device control applies it in line (``_drivers``).
"""

from __future__ import annotations

import errno as errno_module
import logging
import os
import re
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

from ._errors import InvalidCgroupError, KernelOperationError
from ._kernel import KERNEL, Kernel, kernel_error
from ._policy import Policy
from ._rules import DeviceRule

logger = logging.getLogger(__name__)


def _show(value: object) -> str:
    """``repr(value)``, cut short so that a hostile path cannot make a huge message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _check_relative(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidCgroupError(f"Invalid {what} {_show(value)}: must be a non-empty relative path")
    if value.startswith("/"):
        raise InvalidCgroupError(f"Invalid {what} {_show(value)}: must be relative, not absolute")
    for component in value.split("/"):
        if component in ("", ".", ".."):
            raise InvalidCgroupError(
                f"Invalid {what} {_show(value)}: every component must be a plain name (no '', '.' or '..')"
            )
        if (
            "\\" in component
            or not component.strip()
            or any(ord(ch) < 32 or ord(ch) == 127 for ch in component)
            or len(component.encode()) > 255
        ):
            raise InvalidCgroupError(
                f"Invalid {what} {_show(value)}: component {_show(component)} is not a valid directory name"
                " (no control characters, backslashes or blank names; at most 255 bytes)"
            )
    return value


_PLAIN_PATH = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}(?:/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254})*")
"""Paths every check below accepts (ASCII names, no '.'/'..'): the common case,
recognised in one match (this runs several times per container operation)."""


def validate_cgroup(cgroup: object) -> str:
    """Return ``cgroup`` if it is a plain relative path (``"c1"``, ``"parent/child"``), else raise."""
    if type(cgroup) is str and _PLAIN_PATH.fullmatch(cgroup):
        return cgroup
    return _check_relative(cgroup, "cgroup")


def validate_cgroups_root(cgroups_root: object) -> str:
    """Return ``cgroups_root`` if it is a plain relative path, else raise (SPEC section 4)."""
    return _check_relative(cgroups_root, "cgroups_root")


class DeviceOperation(NamedTuple):
    """One queued call of a backend method: ``kind`` is the method's name."""

    kind: str
    args: tuple = ()

    @property
    def cgroup(self) -> str | None:
        """The cgroup the operation is about (None for ``list_cgroups``)."""
        return self.args[0] if self.args else None


OPERATION_KINDS = frozenset(
    {"configure", "reconfigure", "remove", "state", "exists", "list_cgroups", "reconcile", "remove_root", "confine"}
)


def validate_confined(path: object, root: str, inside: str) -> str:
    """``path`` (a cgroup from the hierarchy's root, e.g. ``user.slice``) if
    it is a plain relative path that neither holds nor lies inside the
    backend's own root ``root``, which is ``inside`` from the hierarchy's
    root (confining it would deny the containers' GPUs too)."""
    _check_relative(path, "confined cgroup")
    assert isinstance(path, str)
    if inside == path or inside.startswith(path + "/") or path.startswith(inside + "/"):
        raise InvalidCgroupError(
            f"Cannot confine cgroup {_show(path)}: it holds or lies inside device control's own root {root}"
            " (whose containers must keep their GPUs); confine the users' cgroups, e.g. user.slice"
        )
    return path


def unknown_operation(kind: str) -> ValueError:
    """The result of an operation whose kind no backend has."""
    return ValueError(f"Unknown device operation {kind!r}")


Applier = Callable[[str, tuple], Any]


def applier(backend: Any) -> Applier:
    """``apply(kind, args)``: one operation on ``backend``, its value or the
    exception it raised (see module rules); each method looked up once."""
    methods = {kind: getattr(backend, kind) for kind in OPERATION_KINDS}
    get = methods.get

    def apply(kind: str, args: tuple) -> Any:
        method = get(kind)
        if method is None:
            return unknown_operation(kind)
        try:
            return method(*args)
        except Exception as error:
            return error

    return apply


@runtime_checkable
class DeviceBackend(Protocol):
    """What every device backend offers (see module rules)."""

    name: str
    root: str
    kernel: Kernel
    """Where its syscalls go (the one seam; see module rules)."""
    blocking: bool
    """False for a backend that never blocks (in memory): applied in line."""

    def path(self, cgroup: str) -> str:
        """The absolute path of ``cgroup``."""

    def configure(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule], deny: Iterable[DeviceRule] = ()
    ) -> Policy:
        """Create ``cgroup`` if missing and make its policy exactly ``(allow, deny)`` (or the Policy given)."""

    def reconfigure(
        self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]
    ) -> Policy:
        """Grant ``add`` and revoke ``remove`` (exact rules) on an existing cgroup."""

    def remove(self, cgroup: str) -> bool:
        """Delete ``cgroup``; False (and a warning) when processes are still in it."""

    def state(self, cgroup: str) -> Policy | None:
        """The cgroup's policy, or None when the backend has no record of it."""

    def exists(self, cgroup: str) -> bool:
        """Whether the cgroup exists."""

    def list_cgroups(self) -> list[str]:
        """Every cgroup below the root, as relative paths, sorted."""

    def reconcile(self, cgroup: str, desired: Policy) -> list[str]:
        """Make the kernel enforce ``desired``; describe each repair made."""

    def remove_root(self) -> bool:
        """Delete the root itself once no cgroup is left below it; False if some are."""

    def confine(self, path: str, access: Policy) -> list[str]:
        """Deny ``access.deny`` to the existing cgroup ``path`` (from the
        hierarchy's root, outside the root) and every cgroup below it,
        leaving the rest as it is; what it changed, in words."""

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        """Apply ``ops`` in order; one value or exception per operation."""


class BackendBase:
    """Shared plumbing: the root, cgroup paths, the kernel seam, the applier."""

    name = "base"
    blocking = True

    def __init__(self, root: str) -> None:
        self.root = root
        self.kernel: Kernel = KERNEL
        self._applier: Applier | None = None

    def path(self, cgroup: str) -> str:
        return os.path.join(self.root, validate_cgroup(cgroup))

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        apply = self._applier
        if apply is None:
            apply = self._applier = applier(self)
        return [apply(op.kind, op.args) for op in ops]

    def remove_root(self) -> bool:
        if not os.path.isdir(self.root):
            return True
        if self.list_cgroups():
            logger.warning("Device root %s still has cgroups below it; it stays", self.root)
            return False
        self.kernel.run("rmdir", self.root, os.rmdir, self.root)
        return True

    # -- making and removing cgroups (the kernel backends) ------------------------------------
    def _rmdir_unless_busy(self, path: str, keeping: str, log: logging.Logger) -> bool:
        """rmdir ``path``: True once it is gone (or was already); False, with a
        warning on ``log`` (the backend's), while processes or child cgroups keep it (EBUSY)."""
        try:
            self.kernel.run("rmdir", path, os.rmdir, path)
        except KernelOperationError as error:
            if error.errno == errno_module.EBUSY:
                log.warning("Cgroup %s still has processes or child cgroups; keeping %s", path, keeping)
                return False
            if error.errno != errno_module.ENOENT:
                raise
        return True

    def _mkdir(self, path: str) -> None:
        """mkdir ``path``, which must not exist (EEXIST is the error it is)."""
        if not self.kernel.mkdir(path):
            raise kernel_error("mkdir", path, FileExistsError(errno_module.EEXIST, os.strerror(errno_module.EEXIST)))

    def _ensure_root(self) -> None:
        """mkdir the root unless it exists (another agent may make it meanwhile)."""
        if not os.path.isdir(self.root):
            self.kernel.mkdir(self.root)

    def _create(self, path: str) -> bool:
        """mkdir ``path`` (and the root when missing); False if it already
        exists. The common case is one mkdir (no stat first)."""
        try:
            return self.kernel.mkdir(path)
        except KernelOperationError as error:
            if error.errno != errno_module.ENOENT:
                raise
        self._ensure_root()
        return self.kernel.mkdir(path)


def list_cgroup_dirs(root: str) -> list[str]:
    """Every directory below ``root`` as a relative path, sorted ([] when absent)."""
    found: list[str] = []
    for directory, subdirs, _files in os.walk(root):
        for name in subdirs:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)
