"""Frames between an agent and its device worker process.

Rules:
- A frame is a 4-byte little-endian length, then a pickle of one value.
  Frames go over two private pipes between an agent and the child it
  started (never external input); one larger than ``MAX_FRAME`` is refused
  as a broken peer.
- Agent to worker: one frame per batch, a list of ``(kind, args)`` tuples
  (plain tuples: a NamedTuple pickles through Python, twice as slowly).
- A ``Policy`` (an argument, a result) crosses as ``(POLICY, its text)``
  and is interned again on arrival (``wire`` / ``unwire``): pickling one
  by reduction costs ~10 µs a frame, its text ~1 µs.
- Worker to agent: the first frame is ``("ready", (name, root), records)``
  or ``("error", exception, records)``; after ``ready``, every frame is
  ``("part" | "done", results, records)`` for the oldest batch not yet
  done, in order. ``records`` are the log records the worker collected,
  as ``(logger name, level, message)``.
- ``FrameReader`` takes bytes as they arrive and gives whole frames, one at
  a time, in order.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any, Sequence

from ._errors import WorkerError
from ._policy import Policy

_HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20
"""Frames larger than this are refused (a broken peer, not a batch)."""


READ_SIZE = 1 << 16
"""Bytes asked of one ``read(2)`` of a worker pipe: what a pipe holds by
default. CPython's ``os.read(fd, n)`` allocates ``n`` bytes and shrinks
them to what came: for 1 MiB that costs ~12 µs a read on these machines,
for 64 KiB ~0.6 µs (a round trip reads twice, once on each side)."""


POLICY = "\0policy"
"""Marks a policy's text in a frame."""


def wire(values: Sequence[Any]) -> tuple[Any, ...]:
    """``values`` with each ``Policy`` as ``(POLICY, text)`` (see module rules)."""
    return tuple([(POLICY, value.text) if type(value) is Policy else value for value in values])


def unwire(values: Sequence[Any]) -> list[Any]:
    """``wire``'s values back, each policy interned again."""
    return [
        Policy.from_text(value[1]) if type(value) is tuple and len(value) == 2 and value[0] == POLICY else value
        for value in values
    ]


def encode(value: Any) -> bytes:
    """One frame of ``value``."""
    out = io.BytesIO()
    out.write(b"\0\0\0\0")
    pickle.dump(value, out, protocol=pickle.HIGHEST_PROTOCOL)
    data = out.getbuffer()
    _HEADER.pack_into(data, 0, len(data) - 4)
    return bytes(data)


def write_frame(fd: int, value: Any) -> None:
    """Write one frame of ``value`` to a blocking ``fd``, all of it."""
    view = memoryview(encode(value))
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Whole frames out of bytes that arrive in pieces (see module rules)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next(self) -> Any | None:
        """The next whole frame's value, or None while it has not all arrived."""
        buffer = self.buffer
        if len(buffer) < 4:
            return None
        (size,) = _HEADER.unpack_from(buffer)
        if size > MAX_FRAME:
            raise WorkerError(f"Device worker frame of {size} bytes (at most {MAX_FRAME}): the peer is broken")
        if len(buffer) < 4 + size:
            return None
        with memoryview(buffer) as view:
            value = pickle.loads(view[4 : 4 + size])
        del buffer[: 4 + size]
        return value
