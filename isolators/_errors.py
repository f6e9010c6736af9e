"""Isolator errors.

Rules:
- Every failure an isolator reports is an ``IsolatorError`` (a
  ``runtime.Failure``), carrying Mesos' wording where Mesos has one
  ("Unknown container", "Container has already been prepared", ...).
- ``InvalidContainerID`` is raised before any path is built from a bad id;
  it is also a ``ValueError`` so msgspec reports it as a validation error when
  a script or message decodes one.
"""

from __future__ import annotations

from runtime import Failure


class IsolatorError(Failure):
    """A call to the isolator failed; the message says why (Mesos wording)."""


class InvalidContainerID(IsolatorError, ValueError):
    """A container id that must never become a path."""
