"""The kubelet's PodResources API v1: which container holds which device IDs (R-PR-3).

Rules:
- ``PodResourcesClient(socket, timeout_s)`` calls ``List``
  (``/v1.PodResourcesLister/List``) on the kubelet's socket (default
  ``DEFAULT_POD_RESOURCES_SOCKET``) with a deadline; ``list()`` answers
  every container's devices as ``AssignedDevices`` (namespace, pod,
  container, resource, device IDs), one per resource a container holds.
  One call per repair pass: the kubelet rate-limits the socket (about 100
  requests a second).
- A socket that is not there, or a call that fails (refused, deadline,
  the kubelet's error), is a ``PodResourcesUnavailable`` naming the socket
  and the reason. The channel is kept between calls (gRPC reconnects);
  ``close()`` closes it. Blocking (gRPC's synchronous API): call it on an
  executor.
"""

from __future__ import annotations

import os

import msgspec

from runtime import Failure

from .._sockets import unix_target

__all__ = ["AssignedDevices", "DEFAULT_POD_RESOURCES_SOCKET", "PodResourcesClient", "PodResourcesUnavailable"]


DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""Where the kubelet serves its PodResources API v1."""


class PodResourcesUnavailable(Failure):
    """The kubelet's PodResources socket did not answer ``List``."""


class AssignedDevices(msgspec.Struct, frozen=True, kw_only=True):
    """Device IDs of one resource that the kubelet assigned to one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    ids: tuple[str, ...]


class PodResourcesClient:
    """``List`` on the kubelet's PodResources socket (see module rules)."""

    def __init__(self, socket: str = DEFAULT_POD_RESOURCES_SOCKET, timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._channel = None
        self._stub = None

    def list(self) -> list[AssignedDevices]:
        import grpc

        from .._api import pods_pb, pods_rpc

        if not os.path.exists(self.socket):
            raise PodResourcesUnavailable(f"no PodResources socket at {self.socket} (the kubelet serves it; is it"
                                          " running on this node, and is --pod_resources_socket its path?)")
        if self._stub is None:
            self._channel = grpc.insecure_channel(unix_target(self.socket))
            self._stub = pods_rpc.PodResourcesListerStub(self._channel)
        try:
            answer = self._stub.List(pods_pb.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as error:
            code = error.code().name if hasattr(error, "code") else "UNKNOWN"
            details = error.details() if hasattr(error, "details") else str(error)
            raise PodResourcesUnavailable(f"PodResources List on {self.socket} failed: {code}: {details}") from None
        return [
            AssignedDevices(namespace=pod.namespace, pod=pod.name, container=container.name,
                            resource=devices.resource_name, ids=tuple(devices.device_ids))
            for pod in answer.pod_resources for container in pod.containers for devices in container.devices
        ]

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None
