"""MPS errors: what a share or a daemon could not do, and why.

Rules:
- ``MpsError`` is a ``runtime.Failure``: it crosses an actor's Future as
  any failure does. Its message names the unit, the path or the command,
  and the next step.
- ``MpsDaemonFailed`` is a control daemon that did not start or run: its
  ``exit`` (the launcher's exit status, or what is known of a daemon that
  died: ``None``) and ``log_tail`` (the last lines of its ``control.log``)
  are in the message, so a refused share says why (R-MP-1), never a bare
  "error waiting for MPS daemon".
- ``UnequalShare`` is a share asking other limits than its unit's live
  shares have (MPS holds limits per server: the shares of one unit are
  equal). The unit's limits are free again once its last share is
  returned, so the same ask can succeed later.
"""

from __future__ import annotations

from runtime import Failure

__all__ = ["MpsError", "MpsDaemonFailed", "UnequalShare"]


class MpsError(Failure):
    """An MPS operation failed (see module rules)."""


class UnequalShare(MpsError):
    """A share asking other limits than its unit's live shares have (see module rules)."""


class MpsDaemonFailed(MpsError):
    """A unit's control daemon did not start or run (see module rules)."""

    def __init__(self, unit: str, what: str, exit: int | None, log_tail: str, log_path: str) -> None:
        self.unit = unit
        self.what = what
        self.exit = exit
        self.log_tail = log_tail
        self.log_path = log_path
        tail = log_tail.strip() or "(empty)"
        super().__init__(f"the MPS control daemon of {unit} {what}; the end of its log {log_path}:\n{tail}")

    def __reduce__(self):  # keep pickling lossless
        return (type(self), (self.unit, self.what, self.exit, self.log_tail, self.log_path))
