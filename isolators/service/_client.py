"""SocketClient: one connection to the service's unix socket (blocking).

Rules:
- ``socket_path(option)``: ``--socket``, else ``$GPU_ISOLATOR_SOCKET``,
  else ``DEFAULT_SOCKET``.
- ``SocketClient.connect(path, timeout)`` connects (a service that cannot
  be reached is one ``LostService`` saying so); the kernel tells the
  service who is asking, nothing the client sends does.
- ``ask(verb, body, fds=())`` sends one request and returns the next
  frame that is not ``queued`` (``queued`` frames go to ``on_queued``);
  ``send`` and ``receive`` are the two halves. Each waits at most
  ``timeout`` seconds (None: as long as it takes); an ``error`` frame (the
  service refused the frame and closed) raises ``Refused`` with its text,
  the connection closing raises ``LostService``.
- Requests carry their own ``request`` string (``request_id``), which
  each answer echoes.
"""

from __future__ import annotations

import itertools
import os
import socket
from typing import Any, Callable

from runtime import Failure

from ._frames import Frame, FrameError, FrameReader, recv_frame, send_frame

__all__ = ["DEFAULT_SOCKET", "LostService", "Refused", "SocketClient", "socket_path"]

DEFAULT_SOCKET = "/run/gpu-isolator/gpu-isolator.sock"
_requests = itertools.count(1)


class LostService(Failure):
    """The service cannot be reached, or closed the connection."""


class Refused(Failure):
    """The service refused a frame (``error``) and closed the connection."""


def socket_path(option: str | None) -> str:
    return option or os.environ.get("GPU_ISOLATOR_SOCKET") or DEFAULT_SOCKET


def request_id(kind: str) -> str:
    return f"{kind}-{os.getpid()}-{next(_requests)}"


class SocketClient:
    """One connection to the service (see module rules)."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.reader = FrameReader()
        self.on_queued: Callable[[dict[str, Any]], None] | None = None

    @classmethod
    def connect(cls, path: str, timeout: float | None = 30.0) -> "SocketClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as error:
            sock.close()
            raise LostService(f"cannot reach the gpu-isolator service at {path}: {error.strerror or error}"
                              " (is 'gpu-isolator serve' running? --socket or $GPU_ISOLATOR_SOCKET name"
                              " another socket)") from None
        return cls(sock, path)

    def send(self, verb: str, body: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        try:
            send_frame(self.sock, verb, body, fds)
        except OSError as error:
            raise LostService(f"lost the gpu-isolator service at {self.path}: {error.strerror or error}") from None

    def receive(self, timeout: float | None = None) -> Frame:
        """The next frame (``queued`` ones handed to ``on_queued`` first)."""
        self.sock.settimeout(timeout)
        while True:
            try:
                frame = recv_frame(self.sock, self.reader)
            except TimeoutError:
                raise
            except (OSError, FrameError) as error:
                raise LostService(f"lost the gpu-isolator service at {self.path}: {error}") from None
            if frame is None:
                raise LostService(f"the gpu-isolator service at {self.path} closed the connection")
            if frame.verb == "error":
                raise Refused(str(frame.body.get("error")))
            if frame.verb == "queued" and self.on_queued is not None:
                self.on_queued(frame.body)
                continue
            return frame

    def ask(self, verb: str, body: dict[str, Any], fds: tuple[int, ...] = (), timeout: float | None = 30.0) -> Frame:
        body = {"request": request_id(verb), **body}
        self.send(verb, body, fds)
        return self.receive(timeout)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "SocketClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
