"""Isolator errors.

Rules:
- Every failure an isolator reports is an ``IsolatorError`` (a
  ``runtime.Failure``), carrying Mesos' wording where Mesos has one
  ("Unknown container", "Container has already been prepared", ...).
- ``as_isolator_error(error)``: the ``IsolatorError`` an isolator method
  raises for a failure that came from elsewhere (the allocator, device
  control, NVML, the runtime): the same text, the original chained as
  ``__cause__``. An ``IsolatorError`` is kept as it is.
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


def as_isolator_error(error: BaseException) -> IsolatorError:
    """``error`` as an ``IsolatorError`` with its text, ``error`` as its cause."""
    if isinstance(error, IsolatorError):
        return error
    converted = IsolatorError(str(error) or type(error).__name__)
    converted.__cause__ = error
    return converted
