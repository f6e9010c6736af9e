"""PluginRequestError: a kubelet request the plugin refuses, with its gRPC status.

Rules:
- ``code`` is the name of a gRPC status code (``INVALID_ARGUMENT`` for IDs
  or sizes that are not this resource's, ``FAILED_PRECONDITION`` for IDs
  that exist but cannot be handed out now); the servicer aborts the call
  with it and the message. The message names every offending ID and what
  to do next. Nothing was handed out or changed.
- Kept free of gRPC so the pure parts (catalog, choices, answers) can
  raise it.
"""

from __future__ import annotations

from runtime import Failure

__all__ = ["PluginRequestError", "INVALID_ARGUMENT", "FAILED_PRECONDITION"]

INVALID_ARGUMENT = "INVALID_ARGUMENT"
FAILED_PRECONDITION = "FAILED_PRECONDITION"


class PluginRequestError(Failure):
    """A refused request: ``code`` (a gRPC status name) and the reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
