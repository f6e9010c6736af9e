"""PID: the address of a process.

Rules (libprocess ``process/pid.hpp``):
- A PID is an ``id`` unique within its runtime and, for a remote process, an
  address ``host:port``. ``str(pid)`` is ``id@host:port``, or just ``id`` for a
  local process; ``PID.parse`` reverses ``str``.
- PIDs are frozen, hashable, totally ordered by (id, host, port) with a local
  PID (no address) before a remote one of the same id, and encode with
  msgspec like any Struct.
- Generated ids read ``name(N)`` with N counting up per runtime process-wide.
"""

from __future__ import annotations

import itertools

import msgspec

_counter = itertools.count(1)


def generate_id(name: str) -> str:
    """Return a fresh id ``name(N)``, unique within this OS process."""
    return f"{name}({next(_counter)})"


class PID(msgspec.Struct, frozen=True):
    """The address of a process: ``id`` and, when remote, ``host``/``port``."""

    id: str
    host: str | None = None
    port: int | None = None

    def _key(self) -> tuple[str, bool, str, int]:
        # msgspec's order=True would compare None with str and raise.
        return (self.id, self.host is not None, self.host or "", self.port or 0)

    def __lt__(self, other: object) -> bool:
        return self._key() < other._key() if isinstance(other, PID) else NotImplemented

    def __le__(self, other: object) -> bool:
        return self._key() <= other._key() if isinstance(other, PID) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return self._key() > other._key() if isinstance(other, PID) else NotImplemented

    def __ge__(self, other: object) -> bool:
        return self._key() >= other._key() if isinstance(other, PID) else NotImplemented

    def __str__(self) -> str:
        if self.host is None:
            return self.id
        return f"{self.id}@{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> "PID":
        """Parse ``id`` or ``id@host:port``; raises ValueError on bad input."""
        if not text:
            raise ValueError("PID must not be empty")
        ident, sep, address = text.rpartition("@")
        if not sep:
            return cls(text)
        host, colon, port = address.rpartition(":")
        if not ident or not colon or not host or not port.isdigit():
            raise ValueError(f"Invalid PID {text!r}: expected 'id' or 'id@host:port'")
        return cls(ident, host, int(port))
