"""The Kubernetes front doors' refusals: a request refused with its gRPC status, a start that cannot be.

Rules:
- ``PluginRequestError``: ``code`` is the name of a gRPC status code
  (``INVALID_ARGUMENT`` for IDs or sizes that are not this resource's,
  ``FAILED_PRECONDITION`` for IDs that exist but cannot be handed out now);
  the servicer aborts the call with it and the message. The message names
  every offending ID and what to do next. Nothing was handed out or
  changed.
- ``PluginSetupError``: a front door that cannot start as configured
  (nothing to offer, an ID too long, a socket path too long or not
  servable); the command exits 2 with its one line. Each front door may
  subclass it for its own setup (the DRA driver's ``DraSetupError``).
- Kept free of gRPC so the pure parts (catalogs, choices, answers) can
  raise them.
"""

from __future__ import annotations

from runtime import Failure

__all__ = ["PluginRequestError", "PluginSetupError", "INVALID_ARGUMENT", "FAILED_PRECONDITION"]

INVALID_ARGUMENT = "INVALID_ARGUMENT"
FAILED_PRECONDITION = "FAILED_PRECONDITION"


class PluginRequestError(Failure):
    """A refused request: ``code`` (a gRPC status name) and the reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PluginSetupError(Failure):
    """The front door cannot start as configured (nothing to offer, an ID or a socket path too long, ...)."""
