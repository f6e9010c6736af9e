"""Unix sockets of the Kubernetes front doors: gRPC served on a path, told apart by the file's identity.

Rules (R-K8-1, R-K8-5, R-K8-8; SPEC section 21):
- A socket file is known by its identity, (device, inode) of ``stat``
  (``identity``; None when it is not there): a kubelet restart deletes the
  sockets of its directories and creates its own anew, so a path that
  holds another file than the one bound is a socket gone.
- ``remove_if(path, identity)`` unlinks ``path`` only while it is the file
  ``identity`` names (or any file when ``identity`` is None: a stale
  socket of our own name). No other file is ever touched.
- ``check_socket_path(path, option)``: a path longer than a unix socket
  address takes (``MAX_SOCKET_PATH``, 107 bytes) is a ``PluginSetupError``
  at once, naming the option that shortens it.
- ``GrpcSocket(path, what, add_servicers, executor, service=)``: ``serve()`` creates
  the socket's directory (0750) when missing, removes a stale file of that
  one name, starts a gRPC server with the servicers on it and returns the
  identity it bound; ``stop()`` stops the server and removes the file if
  it is still the one bound (shielded: it happens on cancellation too).
  A path that cannot be served is a ``PluginSetupError``. Blocking file
  work runs on ``executor``. Its lines start with ``what``: "<what>:
  serving [<service>] on <path>".
- ``SocketServer``: a ``GrpcSocket`` kept there. ``run(task_status)``
  serves, reports ``started`` once it listens, then checks every
  ``poll_s`` seconds (one ``stat``) that the socket is still the file it
  bound; when it vanished or was replaced (a kubelet restart cleans its
  plugins_registry) it serves again, in the same process, so the kubelet
  finds it anew. Cancelled, it stops as ``GrpcSocket.stop``.
- ``unix_target(path)`` is gRPC's name of a unix socket path (absolute).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import anyio

from runtime import Executor

from ._errors import PluginSetupError

__all__ = ["MAX_SOCKET_PATH", "Identity", "identity", "identities", "remove_if", "check_socket_path",
           "unix_target", "GrpcSocket", "SocketServer"]

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107
"""Bytes of a unix socket path (``sun_path`` is 108 with its NUL)."""

Identity = tuple[int, int]


def identity(path: str) -> Identity | None:
    """(device, inode) of ``path``, None when it is not there (blocking)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def identities(paths: tuple[str, ...]) -> list[Identity | None]:
    """``identity`` of several paths in one blocking call."""
    return [identity(path) for path in paths]


def remove_if(path: str, bound: Identity | None) -> bool:
    """Unlink ``path`` if it is (still) the file ``bound`` names, or any file when ``bound`` is None."""
    current = identity(path)
    if current is None or (bound is not None and current != bound):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def check_socket_path(path: str, option: str) -> str:
    """``path`` when a unix socket address holds it, else ``PluginSetupError`` naming ``option``."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise PluginSetupError(f"Socket path {path!r} is longer than the {MAX_SOCKET_PATH} bytes a unix socket"
                               f" address holds: use a shorter {option}")
    return path


def unix_target(path: str) -> str:
    """``unix:///abs/path``: gRPC's name for a unix socket."""
    return "unix://" + os.path.abspath(path)


def _prepare_path(path: str) -> bool:
    """Create the socket's directory; remove a stale socket of this name (blocking). True when one was removed."""
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    return remove_if(path, None)


class GrpcSocket:
    """One gRPC server on a unix socket path (see module rules)."""

    def __init__(self, path: str, what: str, add_servicers: Callable[[Any], None], executor: Executor, *,
                 service: str = "") -> None:
        self.path = path
        self.what = what
        self.service = service
        self.add_servicers = add_servicers
        self.executor = executor
        self.served = 0
        self._server: Any = None
        self._bound: Identity | None = None

    async def serve(self) -> Identity | None:
        """Serve on the path; the identity of the file bound (see module rules)."""
        import grpc

        try:
            if await self.executor.run(_prepare_path, self.path):
                logger.info("%s: removed the stale socket %s", self.what, self.path)
        except OSError as error:
            raise PluginSetupError(f"Cannot serve {self.what} on {self.path}: {error}") from error
        server = grpc.aio.server()
        self.add_servicers(server)
        try:
            server.add_insecure_port(unix_target(self.path))
        except RuntimeError as error:
            raise PluginSetupError(f"Cannot serve {self.what} on {self.path}: {error}") from error
        await server.start()
        self._server = server
        self.served += 1
        self._bound = await self.executor.run(identity, self.path)
        logger.info("%s: serving %son %s", self.what, f"{self.service} " if self.service else "", self.path)
        return self._bound

    async def stop(self) -> None:
        """Stop serving and remove the socket if it is still ours (shielded)."""
        server, self._server = self._server, None
        if server is None:
            return
        with anyio.CancelScope(shield=True):
            await server.stop(0.5)
            await self.executor.run(remove_if, self.path, self._bound)


class SocketServer(GrpcSocket):
    """A gRPC server kept on its path (see module rules)."""

    def __init__(self, path: str, what: str, add_servicers: Callable[[Any], None], executor: Executor, *,
                 poll_s: float = 1.0) -> None:
        super().__init__(path, what, add_servicers, executor)
        self.poll_s = poll_s

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            bound = await self.serve()
            try:
                if not started:
                    task_status.started()
                    started = True
                while await self.executor.run(identity, self.path) == bound:
                    await anyio.sleep(self.poll_s)
                logger.warning("%s: the socket %s vanished or was replaced: serving it again", self.what, self.path)
            finally:
                await self.stop()
