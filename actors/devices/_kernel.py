"""The kernel seam: the one place where a device backend's syscalls go.

Rules:
- Every kernel operation of a backend (mkdir, open, a rule write, a read,
  each bpf(2) command, rmdir ...) is a call on its ``Kernel``:
  ``run(op, target, fn, *args)`` runs ``fn(*args)``, ``op`` and ``target``
  saying what it is in words ("mkdir", the path); a run of rule writes to
  one open file is ``write_lines(fd, file, lines)``, one ``write(2)`` per
  line through ``write``; ``mkdir(path)`` makes a directory and says
  whether it made it (False: it existed, an answer rather than an error:
  a configure tries mkdir first). An ``OSError`` becomes a ``KernelOperationError``
  naming the operation and the target, with the kernel's errno
  (``kernel_error``).
- One path: the backends have no other way to the kernel and no test
  switch. Faults enter here and only here (as runc's
  ``testingSkipFinalCheck`` is its one named seam):
  ``actors.devices.testing.FaultInjectingKernel`` is a ``Kernel`` that
  tells a hook before each operation, each mkdir and each rule write, so a
  fault-injection test runs exactly the code users run.
- Production's ``KERNEL`` adds nothing to the syscalls: ``run`` is a call
  and a ``try``; ``write_lines`` writes its lines in one loop with no call
  per line but ``os.write``.
"""

from __future__ import annotations

import errno as errno_module
import os
from collections.abc import Iterable
from typing import Any, Callable, TypeVar

from ._errors import KernelOperationError

__all__ = ["Kernel", "KERNEL", "kernel_error", "write_op"]

T = TypeVar("T")


def kernel_error(op: str, target: str, error: OSError) -> KernelOperationError:
    """The error of kernel operation ``op`` on ``target`` that failed with ``error``."""
    reason = error.strerror or os.strerror(error.errno or 0)
    code = errno_module.errorcode.get(error.errno or 0, str(error.errno))
    return KernelOperationError(f"Failed to {op} {target}: {reason} ({code})", error.errno)


def write_op(line: bytes) -> str:
    """How a rule write is named in errors: ``write 'c 195:0 rwm' to``."""
    return f"write '{line.decode()}' to"


class Kernel:
    """A backend's way to the kernel (see the module rules)."""

    __slots__ = ()

    write: Callable[[int, bytes], int] = staticmethod(os.write)
    """The ``write(2)`` of ``write_lines``."""

    def run(self, op: str, target: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, one kernel operation (see the module rules)."""
        try:
            return fn(*args)
        except OSError as error:
            raise kernel_error(op, target, error) from error

    def mkdir(self, path: str) -> bool:
        """mkdir ``path``; False when it exists already (see the module rules)."""
        try:
            os.mkdir(path)
            return True
        except FileExistsError:
            return False
        except OSError as error:
            raise kernel_error("mkdir", path, error) from error

    def write_lines(self, fd: int, file: str, lines: Iterable[bytes]) -> None:
        """Write each of ``lines`` to ``fd`` (open on ``file``) with its own
        ``write(2)``, in order; the first that fails is raised."""
        write = self.write
        data = b""
        try:
            for data in lines:
                write(fd, data)
        except OSError as error:
            raise kernel_error(write_op(data), file, error) from error


KERNEL = Kernel()
"""The kernel every backend uses unless a test hands it a fault-injecting one."""
