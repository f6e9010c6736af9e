"""Test doubles for device control (as ``trio.testing``): fault injection.

Rules:
- Faults enter at the kernel seam only (``_kernel``): the backend under
  test runs its one code path, the one users run.
  ``FaultInjectingKernel(tell)`` is a ``Kernel`` that calls ``tell(op,
  target)`` before each kernel operation (a mkdir too) and before each rule write
  (``write 'c 195:0 rwm' to``, the file), then makes the syscall; an
  ``OSError`` from ``tell`` is reported as the syscall's would be.
- ``FaultInjectingBackend(inner, fail_at=k)`` gives ``inner`` such a kernel
  and fails exactly its k-th kernel operation (1-based) with ``errno``;
  ``operations`` counts them and ``log`` lists them. ``crash_at=k`` instead
  raises ``SimulatedCrash`` before the k-th operation: nothing is rolled
  back and the rest of the batch is not applied, as if the process died
  after operation k-1 (drop every actor, then recover). ``detach()`` gives
  ``inner`` production's kernel back (a "restart" without the injector).
- Hand one to ``DeviceControl.create(backend_impl=...)``: it runs in a
  thread (or in line when its inner backend never blocks), never in a
  device worker process.
- ``SimulatedCrash`` is an ``AgentCrash`` (a ``BaseException``): no rollback and no
  per-operation handler catches it; device control fails every caller of
  its batch with it, and the isolator takes it as the agent's death.
"""

from __future__ import annotations

import errno as errno_module
import os
from typing import Any, Callable, TypeVar

from ._backend import DeviceBackend
from ._errors import AgentCrash
from ._kernel import KERNEL, Kernel, kernel_error, write_op

__all__ = ["FaultInjectingBackend", "FaultInjectingKernel", "SimulatedCrash"]

T = TypeVar("T")


class SimulatedCrash(AgentCrash):
    """Raised by ``FaultInjectingBackend(crash_at=k)``: the agent "dies" here (see module rules)."""

    kind = "simulated crash"


class FaultInjectingKernel(Kernel):
    """The kernel seam, telling ``tell(op, target)`` before each kernel
    operation and each rule write (see module rules)."""

    __slots__ = ("_tell", "_files")

    def __init__(self, tell: Callable[[str, str], None]) -> None:
        self._tell = tell
        self._files: dict[int, str] = {}
        """The file each descriptor opened through ``run("open", ...)`` is on."""

    def run(self, op: str, target: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            self._tell(op, target)
        except OSError as error:
            raise kernel_error(op, target, error) from error
        result = Kernel.run(self, op, target, fn, *args)
        if op == "open":
            self._files[result] = target  # type: ignore[index]
        return result

    def mkdir(self, path: str) -> bool:
        try:
            self._tell("mkdir", path)
        except OSError as error:
            raise kernel_error("mkdir", path, error) from error
        return Kernel.mkdir(self, path)

    def write(self, fd: int, data: bytes) -> int:  # type: ignore[override]
        self._tell(write_op(data), self._files.get(fd, f"descriptor {fd}"))  # an OSError: write_lines reports it
        return os.write(fd, data)


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
        inner.kernel = FaultInjectingKernel(self._hook)

    def __getattr__(self, name: str) -> Any:
        """Everything else is the inner backend's (its methods, ``name``,
        ``root``, ``blocking``, ``close``): only its kernel changed."""
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def detach(self) -> None:
        """``inner`` goes back to production's kernel (no more counting or faults)."""
        self.inner.kernel = KERNEL

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
