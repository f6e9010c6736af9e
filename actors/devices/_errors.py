"""Errors of device control.

Rules:
- ``DeviceControlError`` (a ``runtime.Failure``) is the base of every error
  device control raises, so callers catch one type.
- ``DeviceRuleError`` is a malformed rule or an impossible rule list (also a
  ``ValueError``); ``InvalidCgroupError`` a cgroup path that would leave the
  managed root (also a ``ValueError``); both are raised before anything is
  written.
- ``KernelOperationError`` wraps the ``OSError`` of one kernel operation: its
  message names the operation and the file or cgroup, ``errno`` is the
  kernel's, ``__cause__`` the original error.
- ``ForeignProgramsError`` (v2 ``reconcile``): device programs that are not
  device control's are attached to the cgroup beside its own. Its own
  program is in place and recorded; the kernel runs the others too (they
  may deny devices the policy grants), so the drift is reported, not
  guessed away. ``program_ids`` names them.
- ``AgentCrash`` is not an ``Exception``: raised through device control
  where the agent ends, as if its process died there (nothing is rolled
  back, nothing of its batch runs after it). Production never raises one
  (a real crash ends the process); fault injection raises its
  ``SimulatedCrash`` (``actors.devices.testing``). ``kind`` names it in
  the isolator's error.
"""

from __future__ import annotations

from runtime import Failure


class DeviceControlError(Failure):
    """A device control operation failed; the message says which and why."""


class DeviceRuleError(DeviceControlError, ValueError):
    """A device rule, or a list of rules, is malformed or contradictory."""


class InvalidCgroupError(DeviceControlError, ValueError):
    """A cgroup path that is empty, absolute or climbs out of the managed root."""


class KernelOperationError(DeviceControlError):
    """One kernel operation (mkdir, a rule write, bpf(2), ...) failed."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class WorkerError(DeviceControlError):
    """The device worker process could not be started or went away (see module rules)."""


class ForeignProgramsError(DeviceControlError):
    """Programs of others are attached to a cgroup beside its own (see module rules)."""

    def __init__(self, message: str, program_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.program_ids = tuple(program_ids)

    def __reduce__(self) -> tuple:  # crosses the device worker's pipe
        return (type(self), (str(self), self.program_ids))


class AgentCrash(BaseException):
    """The agent ends here (see module rules): drop every actor and recover."""

    kind = "crash"
