"""Frames on the service's unix socket: length-prefixed JSON, with file descriptors.

Rules (SPEC R-SC-1; the wire form users' clients speak):
- A frame is a 4-byte big-endian length ``N`` (1 to ``MAX_FRAME``) and
  ``N`` bytes of UTF-8 JSON: an object ``{"verb": NAME, "body": {...}}``.
  The verbs and their bodies are the service's messages (``_messages``):
  requests ``prepare``, ``update``, ``usage``, ``cleanup``, ``state`` and
  ``signal``; answers ``queued``, ``prepared``, ``started``, ``exited``,
  ``updated``, ``statistics``, ``cleaned_up``, ``state`` and ``error``
  (a refusal that closes the connection).
- File descriptors (exec's stdin, stdout and stderr) travel as
  ``SCM_RIGHTS`` with the first bytes of the frame they belong to, at
  most ``MAX_FDS`` at a time; more, or truncated ancillary data, is a bad
  frame.
- ``FrameReader`` takes bytes (and descriptors) as they arrive and gives
  whole frames in order; anything that is not a frame -- a length out of
  range, bytes that are not a JSON object with a string ``verb`` and an
  object ``body`` -- raises ``FrameError``: the connection cannot be
  trusted to line up any more and is closed.
- ``send_frame`` / ``recv_frame`` are the blocking forms for a client and
  the command's supervisor. Nothing here names who is asking: the service
  learns that from the kernel (``_caller``).
- Standard library only (the supervisor imports it before it runs).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from typing import Any, NamedTuple

__all__ = ["MAX_FRAME", "MAX_FDS", "Frame", "FrameError", "FrameReader", "encode", "send_frame", "recv_frame"]

MAX_FRAME = 1 << 20
"""The largest frame (a request with its command's environment)."""
MAX_FDS = 3
_HEADER = struct.Struct(">I")
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class FrameError(Exception):
    """Bytes that are not a frame; the message says why."""


class Frame(NamedTuple):
    verb: str
    body: dict[str, Any]
    fds: tuple[int, ...] = ()


def encode(verb: str, body: Any) -> bytes:
    """One frame: ``body`` is a dict, or JSON text/bytes of one (a Struct encoded by the caller)."""
    if isinstance(body, (bytes, bytearray)):
        payload = b'{"verb":' + json.dumps(verb).encode() + b',"body":' + bytes(body) + b"}"
    else:
        payload = json.dumps({"verb": verb, "body": body}, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME:
        raise FrameError(f"a {verb!r} frame of {len(payload)} bytes is over the limit of {MAX_FRAME}")
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes, fds: tuple[int, ...] = ()) -> Frame:
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as error:
        raise FrameError(f"a frame that is not JSON ({error})") from None
    if not isinstance(value, dict) or not isinstance(value.get("verb"), str) or not isinstance(
            value.get("body", {}), dict):
        raise FrameError('a frame that is not {"verb": NAME, "body": {...}}')
    return Frame(value["verb"], value.get("body", {}), fds)


class FrameReader:
    """Whole frames out of bytes and descriptors that arrive in pieces (see module rules)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.fds: list[int] = []

    def feed(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        self.buffer += data
        self.fds.extend(fds)

    @property
    def partial(self) -> bool:
        """Some bytes of a frame have come, not all of it."""
        return bool(self.buffer)

    def next(self) -> Frame | None:
        """The next whole frame, or None while it has not all arrived."""
        buffer = self.buffer
        if len(buffer) < 4:
            return None
        (size,) = _HEADER.unpack_from(buffer)
        if not 0 < size <= MAX_FRAME:
            raise FrameError(f"a frame length of {size} bytes (1 to {MAX_FRAME})")
        if len(buffer) < 4 + size:
            return None
        payload = bytes(buffer[4:4 + size])
        del buffer[:4 + size]
        fds, self.fds = tuple(self.fds), []
        return decode(payload, fds)

    def close(self) -> None:
        """Close descriptors received but not handed on."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def send_frame(sock: socket.socket, verb: str, body: Any, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send one frame (blocking), ``fds`` with its first bytes."""
    data = encode(verb, body)
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(sock: socket.socket, reader: FrameReader) -> Frame | None:
    """The next frame (blocking; with the socket's timeout), None at the end of the stream."""
    while True:
        frame = reader.next()
        if frame is not None:
            return frame
        data, ancillary, flags, _address = sock.recvmsg(65536, _FD_SPACE)
        fds = received_fds(ancillary, flags)
        if not data:
            for fd in fds:
                os.close(fd)
            if reader.partial:
                raise FrameError("the stream ended inside a frame")
            return None
        reader.feed(data, fds)


def received_fds(ancillary: list[tuple[int, int, bytes]], flags: int) -> list[int]:
    """The descriptors of ``recvmsg``'s ancillary data; FrameError (they are
    closed) when it was truncated or holds anything else."""
    fds: list[int] = []
    other = False
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[:len(data) - len(data) % got.itemsize])
            fds.extend(got)
        else:
            other = True
    if other or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise FrameError(f"more than {MAX_FDS} descriptors, or ancillary data that is not SCM_RIGHTS")
    return fds
