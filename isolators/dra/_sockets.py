"""SocketServer: one gRPC server on a unix socket, kept there.

Rules (issue 37 item 2):
- ``run(task_status)`` serves the given servicers on ``path`` (a stale file
  of that one name is removed first; its directory is created, mode 0750,
  when missing), reports ``started`` once it listens, then checks every
  ``poll_s`` seconds (one ``stat`` through the executor) that the socket
  is still the file it bound. When it vanished or was replaced (a kubelet
  restart cleans its plugins_registry) the server stops and serves again,
  in the same process: the plugin watcher then finds it anew.
- On cancellation the server stops and its socket is removed if it is
  still the file it bound (shielded); no other file is touched.
- A path longer than a unix socket address takes (107 bytes) is a
  ``DraSetupError`` at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import anyio
import grpc

from runtime import Executor

from ..kubelet._endpoint import MAX_SOCKET_PATH, _identity, _remove_if
from ..kubelet._names import unix_target
from ._kube import DraSetupError

__all__ = ["SocketServer"]

logger = logging.getLogger(__name__)


def _prepare_path(path: str) -> bool:
    """Create the socket's directory; remove a stale socket of this name (blocking). True when one was removed."""
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    return _remove_if(path, None)


class SocketServer:
    """A gRPC server kept on ``path`` (see module rules)."""

    def __init__(self, path: str, what: str, add_servicers: Callable[[Any], None], executor: Executor, *,
                 poll_s: float = 1.0) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise DraSetupError(f"Socket path {path!r} is longer than the {MAX_SOCKET_PATH} bytes a unix socket"
                                " address holds: use a shorter --plugins_dir / --plugins_registry_dir")
        self.path = path
        self.what = what
        self.add_servicers = add_servicers
        self.executor = executor
        self.poll_s = poll_s
        self.served = 0

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            server, bound = await self._serve()
            try:
                if not started:
                    task_status.started()
                    started = True
                while await self.executor.run(_identity, self.path) == bound:
                    await anyio.sleep(self.poll_s)
                logger.warning("%s: the socket %s vanished or was replaced: serving it again", self.what, self.path)
            finally:
                with anyio.CancelScope(shield=True):
                    await server.stop(0.5)
                    await self.executor.run(_remove_if, self.path, bound)

    async def _serve(self) -> tuple[Any, Any]:
        try:
            if await self.executor.run(_prepare_path, self.path):
                logger.info("%s: removed the stale socket %s", self.what, self.path)
        except OSError as error:
            raise DraSetupError(f"Cannot serve {self.what} on {self.path}: {error}") from error
        server = grpc.aio.server()
        self.add_servicers(server)
        try:
            server.add_insecure_port(unix_target(self.path))
        except RuntimeError as error:
            raise DraSetupError(f"Cannot serve {self.what} on {self.path}: {error}") from error
        await server.start()
        self.served += 1
        bound = await self.executor.run(_identity, self.path)
        logger.info("%s: serving on %s", self.what, self.path)
        return server, bound
