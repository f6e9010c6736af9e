"""A fake kubelet for the DRA driver (plugin watcher and DRA client), and the driver as a process.

Rules:
- ``FakeDraKubelet(registry_dir)`` is the kubelet's side: ``register()``
  waits (bounded) for a ``*-reg.sock`` in the plugins_registry directory
  (the real kubelet watches it with inotify), asks ``GetInfo``, checks
  what the kubelet checks (type ``DRAPlugin``, a supported version
  ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin``, an endpoint that can be
  dialled), then calls ``NotifyRegistrationStatus`` with the verdict; it
  returns the ``PluginInfo`` as a dict. ``prepare(claims, version)`` /
  ``unprepare`` call the driver over the endpoint (``claims``: (namespace,
  name, uid) triples) and return the response as a dict by uid.
  ``restart(api, node)`` is what a kubelet restart does to a driver: its
  connections close, the kubelet's DRA plugin manager deletes every
  ResourceSlice of the node (``FakeApiServer.delete_slices``), and the
  plugin watcher registers the driver again.
  ``watch_health(version)`` opens ``NodeWatchResources`` (``v1`` or
  ``v1alpha1``) on a thread; each list is kept by version;
  ``wait_health(predicate, version=...)`` waits (bounded, on a condition).
- ``messages`` records each message in order as ``(seq, who, rpc, dict)``
  (``who``: ``kubelet->plugin`` / ``plugin->kubelet``); ``transcript()``
  renders them.
- ``DraPluginCommand(args, directory)`` is ``python -m isolators
  dra-plugin ARGS`` (``tests.support.kubelet.PluginCommand``'s process
  handling: first line, log, metrics, HTTP).
- ``catalog_of(host_file, sharing, **flags)`` is the ``DraCatalog`` the
  driver would publish for a host file's node (in this process, no actor).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf.json_format import MessageToDict

from isolators.kubernetes import unix_target
from isolators.kubernetes._api import DRA_VERSIONS, HEALTH_VERSIONS, registration, registration_rpc

from .kubelet import MessageRecord, PluginCommand

KUBELET_TO_PLUGIN = "kubelet->plugin"
PLUGIN_TO_KUBELET = "plugin->kubelet"
WAIT = 20.0


def _as_dict(message: Any) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True)


def catalog_of(host_file: str | os.PathLike[str], sharing: str = "none", mps_replicas: int = 1, **flags: Any) -> Any:
    """The devices the driver publishes for ``host_file`` under ``flags`` (and ``--sharing``, ``--mps_replicas``)."""
    from actors import NvidiaGpuAllocator
    from actors.allocator import managed_units
    from actors.flags import Flags
    from actors.nvml import SimulatedNvml, read_inventory
    from isolators.kubernetes.dra import DraCatalog

    values = Flags(host_file=str(host_file), **flags)
    nvml = SimulatedNvml.from_file(str(host_file))
    nvml.init()
    inventory = read_inventory(nvml)
    return DraCatalog.build(managed_units(values, NvidiaGpuAllocator.resources(values), inventory), inventory,
                            sharing, mps_replicas)


class DraPluginCommand(PluginCommand):
    """``gpu-isolator dra-plugin`` as a real process."""

    COMMAND = "dra-plugin"
    READY = " serving "


class FakeDraKubelet(MessageRecord):
    """The kubelet's side of DRA (see module rules)."""

    as_record = staticmethod(_as_dict)  # defaults left out

    def __init__(self, registry_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.registry_dir = Path(registry_dir)
        self.info: dict | None = None
        self.endpoint: str | None = None
        self.health_lists: dict[str, list[list[tuple[str, str, str]]]] = {}
        self._channel: grpc.Channel | None = None
        self._health_calls: list[Any] = []

    def close(self) -> None:
        for call in self._health_calls:
            call.cancel()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- the plugin watcher --------------------------------------------------------------
    def find_socket(self, timeout: float = WAIT) -> Path:
        deadline = time.monotonic() + timeout
        while True:
            found = sorted(self.registry_dir.glob("*-reg.sock")) if self.registry_dir.is_dir() else []
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no *-reg.sock in {self.registry_dir} within {timeout}s")
            time.sleep(0.05)

    def register(self, timeout: float = WAIT, refuse: str | None = None) -> dict:
        socket = self.find_socket(timeout)
        with grpc.insecure_channel(unix_target(str(socket))) as channel:
            stub = registration_rpc.RegistrationStub(channel)
            request = registration.InfoRequest()
            self.record(KUBELET_TO_PLUGIN, "GetInfo", request)
            info = stub.GetInfo(request, timeout=WAIT)
            self.record(PLUGIN_TO_KUBELET, "GetInfo", info)
            error = ""
            if info.type != "DRAPlugin":
                error = f"unsupported plugin type {info.type!r}"
            elif not set(info.supported_versions) & set(DRA_VERSIONS):
                error = f"none of the supported versions {list(info.supported_versions)} is v1.DRAPlugin or v1beta1"
            else:
                try:
                    probe = grpc.insecure_channel(unix_target(info.endpoint))
                    grpc.channel_ready_future(probe).result(timeout=5)
                    probe.close()
                except grpc.FutureTimeoutError:
                    error = f"cannot dial the DRA endpoint {info.endpoint}"
            error = error or refuse or ""
            status = registration.RegistrationStatus(plugin_registered=not error, error=error)
            self.record(KUBELET_TO_PLUGIN, "NotifyRegistrationStatus", status)
            stub.NotifyRegistrationStatus(status, timeout=WAIT)
        self.info = _as_dict(info)
        if refuse is not None:
            return self.info
        if error:
            raise AssertionError(f"the kubelet refused the registration: {error}")
        if self._channel is not None:
            self._channel.close()
        self.endpoint = info.endpoint
        self._channel = grpc.insecure_channel(unix_target(info.endpoint))
        return self.info

    def restart(self, api: Any, node: str) -> dict:
        """A kubelet restart (see module rules); the registration's ``PluginInfo``."""
        self.close()
        api.delete_slices(node)
        return self.register()

    # -- the DRA calls -------------------------------------------------------------------
    def _stub(self, version: str) -> Any:
        assert self._channel is not None, "register() first"
        return DRA_VERSIONS[version][1].DRAPluginStub(self._channel)

    def _call(self, method: str, claims: list[tuple[str, str, str]], version: str, timeout: float) -> Any:
        """``method`` (NodePrepareResources or NodeUnprepareResources) for ``claims``, both ways recorded."""
        pb = DRA_VERSIONS[version][0]
        request = getattr(pb, f"{method}Request")(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims])
        self.record(KUBELET_TO_PLUGIN, f"{method} ({version})", request)
        response = getattr(self._stub(version), method)(request, timeout=timeout)
        self.record(PLUGIN_TO_KUBELET, f"{method} ({version})", response)
        return response

    def prepare(self, claims: list[tuple[str, str, str]], version: str = "v1.DRAPlugin",
                timeout: float = 60.0) -> dict[str, dict]:
        return _as_dict(self._call("NodePrepareResources", claims, version, timeout)).get("claims", {})

    def unprepare(self, claims: list[tuple[str, str, str]], version: str = "v1.DRAPlugin") -> dict[str, dict]:
        response = self._call("NodeUnprepareResources", claims, version, WAIT)
        return {uid: _as_dict(answer) for uid, answer in response.claims.items()}

    # -- health ----------------------------------------------------------------------------
    def watch_health(self, version: str = "v1") -> None:
        """Open ``NodeWatchResources`` of ``version`` (``v1`` / ``v1alpha1``); lists go to ``health_lists[version]``."""
        assert self._channel is not None, "register() first"
        pb, rpc = HEALTH_VERSIONS[version]
        request = pb.NodeWatchResourcesRequest()
        self.record(KUBELET_TO_PLUGIN, f"NodeWatchResources ({version})", request)
        call = rpc.DRAResourceHealthStub(self._channel).NodeWatchResources(request)
        self._health_calls.append(call)
        with self._changed:
            self.health_lists[version] = []
        threading.Thread(target=self._consume, args=(version, pb, call), daemon=True,
                         name=f"fake-kubelet-health-{version}").start()

    def _consume(self, version: str, pb: Any, call: Any) -> None:
        try:
            for response in call:
                self.record(PLUGIN_TO_KUBELET, f"NodeWatchResources ({version})", response)
                listing = [(d.device.device_name, pb.HealthStatus.Name(d.health), d.message) for d in response.devices]
                with self._changed:
                    self.health_lists[version].append(listing)
                    self._changed.notify_all()
        except grpc.RpcError:
            pass

    def wait_health(self, predicate: Callable[[list], bool], after: int = 0, timeout: float = WAIT,
                    version: str = "v1") -> tuple[int, list]:
        def found() -> tuple[int, list] | None:
            lists = self.health_lists.get(version, [])
            for index in range(after, len(lists)):
                if predicate(lists[index]):
                    return index, lists[index]
            return None

        return self._wait(found, f"a matching {version} health list (after {after})", timeout)
