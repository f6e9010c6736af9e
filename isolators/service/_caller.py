"""Who is asking, and what they may touch: one place decides (SPEC R-SC-1, R-SC-3, R-SC-4).

Rules:
- A ``Caller`` is what the kernel says of the other end of a connection:
  ``SO_PEERCRED`` (uid, gid, pid at connect time) and ``SO_PEERGROUPS``
  (its supplementary groups) of a unix socket (``peer_caller``), never
  anything the client sends. A TCP peer whose message carried the
  service's bearer credential is ``Caller.agent(sender)``: an agent the
  operator trusts as root (SPEC R-SC-6); without the credential its
  message never gets here.
- ``authorize(caller, container_id, owner)`` is the one owner check, for
  every verb naming a container (``update``, ``usage``, ``cleanup``,
  cancelling a waiting request): root (and the user the service runs as,
  e.g. a demo on the in-memory backend) and agents may touch any; anyone
  else only what their own uid asked for, else "Container 'ID' belongs to
  another user". A container without a command (as an agent prepares it)
  and one found at start without a record belong to root.
- ``may_prepare(caller, body)``: only root and agents prepare a container
  without a command (it runs nothing, so nothing would ever release it);
  a command comes through the unix socket only (the service starts it
  there, as the caller).
- ``container_id(text)``: a top-level container id a request names,
  checked before anything is built from it: printable ASCII only (no
  spaces, control or bidirectional characters, nothing a terminal would
  show as something else), then the isolator's own rules (R-IS ids).
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import struct
from typing import Any

import msgspec

from runtime import Failure

from .._types import ContainerID

__all__ = ["Caller", "ServiceError", "authorize", "container_id", "may_prepare", "peer_caller", "user_name"]

ROOT = 0
_SERVICE_UID = os.geteuid()
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_UCRED = struct.Struct("3i")


class ServiceError(Failure):
    """A request the service refuses; the message says why."""


class Caller(msgspec.Struct, frozen=True, kw_only=True):
    uid: int
    gid: int
    pid: int | None = None
    groups: tuple[int, ...] = ()
    user: str = ""
    via: str = "unix"
    """``unix`` (the kernel's peer credentials) or ``tcp`` (an authenticated agent)."""
    peer: str = ""
    """How logs and root's view name it: ``pid 1234``, or the agent's PID."""

    @property
    def privileged(self) -> bool:
        """Root (or the user the service runs as), or an agent holding the
        credential: may touch any container."""
        return self.uid == ROOT or self.uid == _SERVICE_UID

    @classmethod
    def agent(cls, sender: Any) -> "Caller":
        return cls(uid=ROOT, gid=ROOT, user="root", via="tcp", peer=str(sender))

    def describe(self) -> str:
        return f"{self.user or self.uid} ({self.peer})" if self.peer else (self.user or str(self.uid))


def user_name(uid: int) -> str:
    """The login name of ``uid`` (its number as text when it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def peer_caller(sock: socket.socket, names: dict[int, str] | None = None) -> Caller:
    """The caller at the other end of a connected unix socket; its user's
    name looked up (blocking: NSS) unless ``names`` is given (then from it,
    empty when absent)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    groups: tuple[int, ...] = ()
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
            groups = tuple(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) - len(raw) % 4]))
            break
        except OSError as error:
            if error.errno == errno.ERANGE and size < (65536 * 4):
                size *= 4
                continue
            raise
    name = names.get(uid, "") if names is not None else user_name(uid)
    return Caller(uid=uid, gid=gid, pid=pid or None, groups=groups, user=name, peer=f"pid {pid}")


def authorize(caller: Caller, container_id: str, owner: int | None) -> None:
    """Refuse unless ``caller`` may touch a container of ``owner`` (see module rules)."""
    if caller.privileged:
        return
    if owner is None or owner != caller.uid:
        raise ServiceError(f"Container '{container_id}' belongs to another user")


def may_prepare(caller: Caller, command: list[str] | None) -> None:
    if command is None and not caller.privileged:
        raise ServiceError("Only root prepares a container without a command (as an agent does): run the command"
                           " with 'gpu-isolator exec', which holds its GPUs while it runs")
    if command is not None and caller.via != "unix":
        raise ServiceError("A command is run through the service's unix socket ('gpu-isolator exec'), where the"
                           " service starts it as the caller")


def container_id(text: Any) -> ContainerID:
    """A top-level container id from a request (see module rules)."""
    if not isinstance(text, str) or not text or not all("!" <= ch <= "~" for ch in text):
        shown = repr(text) if not isinstance(text, str) or len(text) <= 64 else f"{text[:40]!r}... ({len(text)} characters)"
        raise ServiceError(f"Invalid container id {shown}: only printable ASCII letters, digits and punctuation"
                           " (no spaces, control or bidirectional characters)")
    if "." in text:
        raise ServiceError(f"Invalid container id {text!r}: the service manages top-level containers only")
    try:
        return ContainerID(text)
    except ValueError as error:
        raise ServiceError(str(error)) from None
