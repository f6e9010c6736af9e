"""Registration with the kubelet, both ways it is done: on ``kubelet.sock``, and through the plugin watcher.

Rules (R-K8-1, R-K8-5; SPEC section 21):
- ``KubeletRegistration(socket, kubelet_socket, request, on_registered)``
  is a device plugin's way (deviceplugin v1beta1): ``run()`` loops until
  cancelled: wait for ``kubelet_socket`` (logged once per wait: "waiting
  for the kubelet"), serve ``socket`` (a ``GrpcSocket``), then call
  ``Registration/Register`` on ``kubelet_socket`` with ``request``. Serve
  first, then register: the kubelet dials the socket and asks
  ``GetDevicePluginOptions`` before it answers. A refused or failed
  registration is logged with the kubelet's error and tried again after
  a backoff (1 s doubling to 8 s); an accepted one is counted
  (``registrations``) and reported to ``on_registered``.
- While registered it checks every ``poll_s`` seconds (one ``stat`` of
  each file, one executor job) that its socket is still the file it bound
  and ``kubelet_socket`` the file it registered with. A kubelet (re)start
  deletes every socket in the directory and creates ``kubelet.sock``
  anew; so when either changed or vanished the server stops (its streams
  end) and the loop serves and registers again, in the same process:
  within ``poll_s`` plus one registration. Cancelled (SIGTERM), the
  socket stops and removes only its own file.
- ``PluginWatcherRegistration(plugin_type, name, endpoint, versions,
  on_status)`` is the other way (pluginregistration v1, what DRA drivers
  and CSI plugins use): the kubelet's plugin watcher finds
  ``<registry>/<name>-reg.sock`` and asks ``GetInfo`` (answered with the
  type, name, the endpoint's path and the supported versions) and
  ``NotifyRegistrationStatus`` (handed to ``on_status(ok, error)``).
- Lines name ``what`` (the resource or the driver).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import grpc

from ._api import pb, registration, registration_rpc, rpc
from ._sockets import GrpcSocket, Identity, check_socket_path, identities, identity, unix_target

__all__ = ["KubeletRegistration", "PluginWatcherRegistration"]

logger = logging.getLogger(__name__)


class KubeletRegistration:
    """A device plugin's socket, kept served and registered on ``kubelet.sock`` (see module rules)."""

    def __init__(self, socket: GrpcSocket, kubelet_socket: str, request: Any, on_registered: Callable[[], None], *,
                 option: str, poll_s: float = 1.0, register_timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.what = socket.what
        self.kubelet_socket = check_socket_path(kubelet_socket, option)
        check_socket_path(socket.path, option)
        self.request = request
        self.on_registered = on_registered
        self.executor = socket.executor
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.registrations = 0

    async def run(self) -> None:
        """Serve and stay registered until cancelled (see module rules)."""
        while True:
            await self._wait_for_kubelet()
            bound = await self.socket.serve()
            try:
                kubelet = await self._register(bound)
                if kubelet is not None:
                    await self._watch(bound, kubelet)
            finally:
                await self.socket.stop()

    async def _wait_for_kubelet(self) -> None:
        logged = False
        while await self.executor.run(identity, self.kubelet_socket) is None:
            if not logged:
                logger.info("%s: waiting for the kubelet: no %s yet", self.what, self.kubelet_socket)
                logged = True
            await anyio.sleep(self.poll_s)

    async def _register(self, bound: Identity | None) -> Identity | None:
        """Register until the kubelet accepts: the identity of the kubelet.sock
        it accepted on, or None when our socket went meanwhile (serve again)."""
        backoff = 1.0
        while True:
            kubelet = await self.executor.run(identity, self.kubelet_socket)
            if kubelet is not None:
                error = await self._register_once()
                if error is None:
                    self.registrations += 1
                    self.on_registered()
                    logger.info("%s: registered with the kubelet (%s, endpoint %s)", self.what,
                                self.kubelet_socket, self.request.endpoint)
                    return kubelet
                logger.warning("%s: registration with %s failed: %s; trying again in %gs", self.what,
                               self.kubelet_socket, error, backoff)
            await anyio.sleep(backoff)
            backoff = min(8.0, backoff * 2)
            if await self.executor.run(identity, self.socket.path) != bound:
                return None

    async def _register_once(self) -> str | None:
        try:
            async with grpc.aio.insecure_channel(unix_target(self.kubelet_socket)) as channel:
                await rpc.RegistrationStub(channel).Register(self.request, timeout=self.register_timeout_s)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        return None

    async def _watch(self, bound: Identity | None, kubelet: Identity) -> None:
        """Return once the kubelet restarted (our socket or kubelet.sock changed)."""
        while True:
            await anyio.sleep(self.poll_s)
            ours, theirs = await self.executor.run(identities, (self.socket.path, self.kubelet_socket))
            if ours != bound or theirs != kubelet:
                why = ("its socket was removed" if ours != bound
                       else f"{os.path.basename(self.kubelet_socket)} was replaced")
                logger.warning("%s: the kubelet restarted (%s): serving and registering again", self.what, why)
                return


class PluginWatcherRegistration(registration_rpc.RegistrationServicer):
    """pluginregistration's ``Registration``, served on ``<registry>/<name>-reg.sock`` (see module rules)."""

    def __init__(self, plugin_type: str, name: str, endpoint: str, versions: tuple[str, ...],
                 on_status: Callable[[bool, str], Awaitable[Any]], *, what: str) -> None:
        self.what = what
        self.plugin_type = plugin_type
        self.name = name
        self.endpoint = endpoint
        self.versions = list(versions)
        self.on_status = on_status

    async def GetInfo(self, request: Any, context: Any) -> Any:
        logger.info("The kubelet's plugin watcher asked GetInfo of %s", self.what)
        return registration.PluginInfo(type=self.plugin_type, name=self.name, endpoint=self.endpoint,
                                       supported_versions=self.versions)

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        await self.on_status(request.plugin_registered, request.error)
        return registration.RegistrationStatusResponse()
