"""The device backend port: what cgroups v1, cgroups v2 and in-memory share.

Rules:
- A backend only applies: it is synchronous, blocking, and called from one
  thread at a time (the device control actor's executor job). It holds no
  event-loop objects.
- A backend manages the cgroups below one root, ``<hierarchy>/<cgroups_root>``.
  Every method takes a cgroup as a relative path under that root, checked by
  ``validate_cgroup``; nothing is ever written outside the root.
- Every kernel operation (mkdir, open, each rule write, a read, each bpf(2)
  command, a checkpoint write, rmdir ...) goes through ``_kernel_op``, which
  first calls ``kernel_hook(op, target)`` when one is set. An ``OSError``
  from the hook or the operation becomes a ``KernelOperationError`` naming
  the operation and the target, with the kernel's errno.
- A failed ``configure`` / ``reconfigure`` rolls the cgroup back to what it
  was before (a new cgroup is removed again), then raises the original
  error; a rollback that fails too is logged and named in the error.
- ``apply_batch(ops)`` applies a drained batch of operations in order and
  returns one result per operation: its value, or the exception it raised
  (one failure never stops the others). The default runs the methods one by
  one; cgroups v2 overrides it to write its checkpoint once per batch.
- ``FaultInjectingBackend(inner, fail_at=k)`` sits in front of any backend
  and fails exactly its k-th kernel operation (1-based) with ``errno``;
  ``operations`` counts them and ``log`` lists them. ``crash_at=k`` instead
  raises ``SimulatedCrash`` before the k-th operation: nothing is rolled
  back and the rest of the batch is not applied, as if the process died
  after operation k-1 (drop every actor, then recover).
"""

from __future__ import annotations

import errno as errno_module
import logging
import os
import re
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, TypeVar, runtime_checkable

from ._errors import InvalidCgroupError, KernelOperationError
from ._rules import CgroupDeviceAccess, DeviceRule

logger = logging.getLogger(__name__)

T = TypeVar("T")

KernelHook = Callable[[str, str], None]


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


class SimulatedCrash(BaseException):
    """Raised by ``FaultInjectingBackend(crash_at=k)``: the agent "dies" here.

    A ``BaseException`` so that no rollback or per-operation handler catches
    it; the device control actor fails the callers of its batch with it."""


class DeviceOperation(NamedTuple):
    """One queued call of a backend method: ``kind`` is the method's name."""

    kind: str
    args: tuple = ()

    @property
    def cgroup(self) -> str | None:
        """The cgroup the operation is about (None for ``list_cgroups``)."""
        return self.args[0] if self.args else None


OPERATION_KINDS = frozenset(
    {"configure", "reconfigure", "remove", "state", "exists", "list_cgroups", "reconcile", "remove_root"}
)


def apply_one(backend: Any, op: DeviceOperation) -> Any:
    """Run one operation; return its value or the exception it raised."""
    if op.kind not in OPERATION_KINDS:
        return ValueError(f"Unknown device operation {op.kind!r}")
    try:
        return getattr(backend, op.kind)(*op.args)
    except Exception as error:
        return error


@runtime_checkable
class DeviceBackend(Protocol):
    """What every device backend offers (see module rules)."""

    name: str
    root: str
    kernel_hook: KernelHook | None
    blocking: bool
    """False for a backend that never blocks (in memory): applied in line."""

    def path(self, cgroup: str) -> str:
        """The absolute path of ``cgroup``."""

    def configure(
        self, cgroup: str, allow: Iterable[DeviceRule], deny: Iterable[DeviceRule]
    ) -> CgroupDeviceAccess:
        """Create ``cgroup`` if missing and make its policy exactly ``(allow, deny)``."""

    def reconfigure(
        self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]
    ) -> CgroupDeviceAccess:
        """Grant ``add`` and revoke ``remove`` (exact rules) on an existing cgroup."""

    def remove(self, cgroup: str) -> bool:
        """Delete ``cgroup``; False (and a warning) when processes are still in it."""

    def state(self, cgroup: str) -> CgroupDeviceAccess | None:
        """The cgroup's policy, or None when the backend has no record of it."""

    def exists(self, cgroup: str) -> bool:
        """Whether the cgroup exists."""

    def list_cgroups(self) -> list[str]:
        """Every cgroup below the root, as relative paths, sorted."""

    def reconcile(self, cgroup: str, desired: CgroupDeviceAccess) -> list[str]:
        """Make the kernel enforce ``desired``; describe each repair made."""

    def remove_root(self) -> bool:
        """Delete the root itself once no cgroup is left below it; False if some are."""

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        """Apply ``ops`` in order; one value or exception per operation."""


class BackendBase:
    """Shared plumbing: the root, cgroup paths, and the one kernel-op hook."""

    name = "base"
    blocking = True

    def __init__(self, root: str) -> None:
        self.root = root
        self.kernel_hook: KernelHook | None = None
        self.fence: Callable[[], None] | None = None
        """Called before each operation of a batch (a device worker checks
        that its agent is still there; see ``_worker_child``)."""

    def path(self, cgroup: str) -> str:
        return os.path.join(self.root, validate_cgroup(cgroup))

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        fence = self.fence
        if fence is None:
            return [apply_one(self, op) for op in ops]
        results = []
        for op in ops:
            fence()
            results.append(apply_one(self, op))
        return results

    def remove_root(self) -> bool:
        if not os.path.isdir(self.root):
            return True
        if self.list_cgroups():
            logger.warning("Device root %s still has cgroups below it; it stays", self.root)
            return False
        self._kernel_op("rmdir", self.root, os.rmdir, self.root)
        return True

    def _kernel_op(self, op: str, target: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one kernel operation through the hook (see module rules)."""
        try:
            hook = self.kernel_hook
            if hook is not None:
                hook(op, target)
            return fn(*args)
        except OSError as error:
            reason = error.strerror or os.strerror(error.errno or 0)
            code = errno_module.errorcode.get(error.errno or 0, str(error.errno))
            raise KernelOperationError(
                f"Failed to {op} {target}: {reason} ({code})", error.errno
            ) from error


class FaultInjectingBackend:
    """Wraps a backend and fails its ``fail_at``-th kernel operation (1-based).

    ``fail_at=None`` only counts. ``errno`` is the injected error (EIO by
    default; ENOSPC and EBUSY are other useful ones). ``crash_at=k`` raises
    ``SimulatedCrash`` before the k-th operation (it is not performed).
    ``operations`` is the number of kernel operations seen, ``log`` their
    ``(op, target)``, ``injected`` whether the fault fired. ``arm(k)``
    resets the count.
    """

    def __init__(
        self,
        inner: DeviceBackend,
        fail_at: int | None = None,
        errno: int = errno_module.EIO,
        crash_at: int | None = None,
    ) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.crash_at = crash_at
        self.errno = errno
        self.operations = 0
        self.log: list[tuple[str, str]] = []
        self.injected = False
        inner.kernel_hook = self._hook

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def root(self) -> str:
        return self.inner.root

    @property
    def blocking(self) -> bool:
        return self.inner.blocking

    def arm(self, fail_at: int | None, errno: int | None = None, crash_at: int | None = None) -> None:
        """Start counting again from zero; fail the ``fail_at``-th operation
        (or crash before the ``crash_at``-th)."""
        self.fail_at = fail_at
        self.crash_at = crash_at
        if errno is not None:
            self.errno = errno
        self.operations = 0
        self.log = []
        self.injected = False

    def _hook(self, op: str, target: str) -> None:
        if self.crash_at is not None and self.operations + 1 == self.crash_at:
            self.injected = True
            raise SimulatedCrash(f"simulated crash before kernel operation #{self.crash_at}: {op} {target}")
        self.operations += 1
        self.log.append((op, target))
        if self.fail_at is not None and self.operations == self.fail_at:
            self.injected = True
            raise OSError(
                self.errno,
                f"{os.strerror(self.errno)} (injected at kernel operation #{self.operations}: {op})",
            )

    def path(self, cgroup: str) -> str:
        return self.inner.path(cgroup)

    def configure(self, cgroup: str, allow: Iterable[DeviceRule], deny: Iterable[DeviceRule]) -> CgroupDeviceAccess:
        return self.inner.configure(cgroup, allow, deny)

    def reconfigure(self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]) -> CgroupDeviceAccess:
        return self.inner.reconfigure(cgroup, add, remove)

    def remove(self, cgroup: str) -> bool:
        return self.inner.remove(cgroup)

    def state(self, cgroup: str) -> CgroupDeviceAccess | None:
        return self.inner.state(cgroup)

    def exists(self, cgroup: str) -> bool:
        return self.inner.exists(cgroup)

    def list_cgroups(self) -> list[str]:
        return self.inner.list_cgroups()

    def reconcile(self, cgroup: str, desired: CgroupDeviceAccess) -> list[str]:
        return self.inner.reconcile(cgroup, desired)

    def remove_root(self) -> bool:
        return self.inner.remove_root()

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        return self.inner.apply_batch(ops)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def list_cgroup_dirs(root: str) -> list[str]:
    """Every directory below ``root`` as a relative path, sorted ([] when absent)."""
    found: list[str] = []
    for directory, subdirs, _files in os.walk(root):
        for name in subdirs:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)
