"""Errors of the node ledger.

Rules:
- ``LedgerError`` (a ``runtime.Failure``) is every failure of the node
  ledger's files (a directory that cannot be trusted or made, an owner
  already running, a lock held too long, an owner that may not be
  released); its message names the path or the owner and says what to do.
"""

from __future__ import annotations

from runtime import Failure

__all__ = ["LedgerError"]


class LedgerError(Failure):
    """The node ledger cannot do what was asked; the message says why and what next."""
