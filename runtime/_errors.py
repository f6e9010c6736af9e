"""Failures of the runtime.

Rules:
- ``Failure`` is the base of every error the runtime reports; domain errors
  (an isolator's, an allocator's) subclass it so callers can catch one type.
- ``ProcessTerminated`` fails every Future whose process is unknown, has
  terminated, or terminated before the event ran. Nothing is silently lost.
- ``Discarded`` is raised when awaiting a Future that was discarded.
"""

from __future__ import annotations


class Failure(Exception):
    """A failed operation; the message says what happened and what to do."""


class ProcessTerminated(Failure):
    """The target process is unknown or terminated before the event ran."""


class Discarded(Failure):
    """The Future was discarded before it got a value."""
