"""ResourceEndpoint: one resource's socket, kept served and registered with the kubelet.

Rules (R-K8-1, R-K8-5, R-K8-8; the kubelet's behaviour of SPEC section 18):
- ``run()`` loops until cancelled: wait for ``<dir>/kubelet.sock`` (logged
  once per wait: "waiting for the kubelet"), serve ``DevicePlugin`` on
  ``<dir>/<socket name>`` (a stale file of that one name is removed
  first; no other file in the directory is ever touched), then register:
  ``RegisterRequest{version v1beta1, endpoint <socket name>, resource,
  options{get_preferred_allocation_available}}`` on ``kubelet.sock``.
  Serve first, then register: the kubelet dials the socket and asks
  ``GetDevicePluginOptions`` before it answers. A refused or failed
  registration is logged with the kubelet's error and tried again after a
  backoff (1 s doubling to 8 s); an accepted one is counted
  (``KubeletPluginProcess.registered``).
- While registered it checks every ``poll_s`` seconds (one ``stat`` of each
  file through the endpoints' executor) that its socket is still the file it
  bound and ``kubelet.sock`` the file it registered with. A kubelet
  (re)start deletes every socket in the directory and creates
  ``kubelet.sock`` anew; so when either changed or vanished the server
  stops (its streams end) and the loop serves and registers again, in the
  same process: within ``poll_s`` plus one registration.
- On cancellation (SIGTERM) the server stops and its socket is removed if
  it is still the file it bound (shielded, so it happens even then).
- Paths longer than a unix socket address takes (107 bytes) are a
  ``PluginSetupError`` at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio
import grpc

from runtime import PID, Executor, dispatch

from ._api import pb, rpc
from ._names import KUBELET_SOCKET, VERSION, unix_target
from ._catalog import PluginSetupError, ResourceOffer
from ._plugin import KubeletPluginProcess
from ._servicer import DevicePluginServicer

__all__ = ["ResourceEndpoint", "MAX_SOCKET_PATH"]

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107
"""Bytes of a unix socket path (``sun_path`` is 108 with its NUL)."""

Identity = tuple[int, int]


def _identity(path: str) -> Identity | None:
    """(device, inode) of ``path``, None when it is not there (blocking)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _identities(paths: tuple[str, ...]) -> list[Identity | None]:
    """``_identity`` of several paths in one blocking call."""
    return [_identity(path) for path in paths]


def _remove_if(path: str, identity: Identity | None) -> bool:
    """Unlink ``path`` if it is (still) the file ``identity`` names, or any
    file when ``identity`` is None (a stale socket of our own name)."""
    current = _identity(path)
    if current is None or (identity is not None and current != identity):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class ResourceEndpoint:
    """Serves and registers one resource (see module rules)."""

    def __init__(self, directory: str, offer: ResourceOffer, plugin: PID, servicer: DevicePluginServicer,
                 executor: Executor, *, poll_s: float = 1.0, register_timeout_s: float = 5.0) -> None:
        self.directory = os.path.abspath(directory)
        self.offer = offer
        self.plugin = plugin
        self.servicer = servicer
        self.executor = executor
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.socket_path = os.path.join(self.directory, offer.socket_name)
        self.kubelet_socket = os.path.join(self.directory, KUBELET_SOCKET)
        for path in (self.socket_path, self.kubelet_socket):
            if len(os.fsencode(path)) > MAX_SOCKET_PATH:
                raise PluginSetupError(f"Socket path {path!r} is longer than the {MAX_SOCKET_PATH} bytes a unix"
                                       " socket address holds: use a shorter --device_plugin_dir")
        self.registrations = 0

    async def run(self) -> None:
        """Serve and stay registered until cancelled (see module rules)."""
        while True:
            await self._wait_for_kubelet()
            server, bound = await self._serve()
            try:
                kubelet = await self._register(bound)
                if kubelet is not None:
                    await self._watch(bound, kubelet)
            finally:
                with anyio.CancelScope(shield=True):
                    await server.stop(0.5)
                    await self.executor.run(_remove_if, self.socket_path, bound)

    async def _wait_for_kubelet(self) -> None:
        logged = False
        while await self.executor.run(_identity, self.kubelet_socket) is None:
            if not logged:
                logger.info("%s: waiting for the kubelet: no %s yet", self.offer.resource, self.kubelet_socket)
                logged = True
            await anyio.sleep(self.poll_s)

    async def _serve(self) -> tuple[Any, Identity | None]:
        if await self.executor.run(_remove_if, self.socket_path, None):
            logger.info("%s: removed the stale socket %s", self.offer.resource, self.socket_path)
        server = grpc.aio.server()
        rpc.add_DevicePluginServicer_to_server(self.servicer, server)
        try:
            server.add_insecure_port(unix_target(self.socket_path))
        except RuntimeError as error:
            raise PluginSetupError(f"Cannot serve on {self.socket_path}: {error}") from error
        await server.start()
        bound = await self.executor.run(_identity, self.socket_path)
        logger.info("%s: serving DevicePlugin on %s", self.offer.resource, self.socket_path)
        return server, bound

    async def _register(self, bound: Identity | None) -> Identity | None:
        """Register until the kubelet accepts: the identity of the kubelet.sock
        it accepted on, or None when our socket went meanwhile (serve again)."""
        backoff = 1.0
        while True:
            kubelet = await self.executor.run(_identity, self.kubelet_socket)
            if kubelet is not None:
                error = await self._register_once()
                if error is None:
                    self.registrations += 1
                    dispatch(self.plugin, KubeletPluginProcess.registered, self.offer.resource)
                    logger.info("%s: registered with the kubelet (%s, endpoint %s)", self.offer.resource,
                                self.kubelet_socket, self.offer.socket_name)
                    return kubelet
                logger.warning("%s: registration with %s failed: %s; trying again in %gs", self.offer.resource,
                               self.kubelet_socket, error, backoff)
            await anyio.sleep(backoff)
            backoff = min(8.0, backoff * 2)
            if await self.executor.run(_identity, self.socket_path) != bound:
                return None

    async def _register_once(self) -> str | None:
        request = pb.RegisterRequest(
            version=VERSION, endpoint=self.offer.socket_name, resource_name=self.offer.resource,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
        )
        try:
            async with grpc.aio.insecure_channel(unix_target(self.kubelet_socket)) as channel:
                await rpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout_s)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        return None

    async def _watch(self, bound: Identity | None, kubelet: Identity) -> None:
        """Return once the kubelet restarted (our socket or kubelet.sock changed)."""
        while True:
            await anyio.sleep(self.poll_s)
            ours, theirs = await self.executor.run(_identities, (self.socket_path, self.kubelet_socket))
            if ours != bound or theirs != kubelet:
                why = "its socket was removed" if ours != bound else f"{KUBELET_SOCKET} was replaced"
                logger.warning("%s: the kubelet restarted (%s): serving and registering again",
                               self.offer.resource, why)
                return
