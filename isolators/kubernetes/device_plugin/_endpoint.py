"""resource_endpoint: one resource's ``DevicePlugin`` socket, kept served and registered with the kubelet.

Rules (R-K8-1, R-K8-5, R-K8-8):
- ``resource_endpoint(directory, offer, plugin, servicer, executor)`` is
  the shared ``KubeletRegistration`` for one ``ResourceOffer``: its
  servicer on ``<directory>/<socket name>`` (``gpu-isolator-gpu.sock``),
  registered on ``<directory>/kubelet.sock`` with
  ``RegisterRequest{version v1beta1, endpoint <socket name>, resource,
  options{get_preferred_allocation_available}}``; each accepted
  registration is told to the plugin actor
  (``KubeletPluginProcess.registered``). Serving, registering, noticing
  a kubelet restart and removing only its own socket at the end are the
  shared registration's rules.
- Paths longer than a unix socket address takes are a
  ``PluginSetupError`` at once (use a shorter ``--device_plugin_dir``).
"""

from __future__ import annotations

import os

from runtime import PID, Executor, dispatch

from .._api import pb, rpc
from .._registration import KubeletRegistration
from .._sockets import GrpcSocket
from ._catalog import ResourceOffer
from ._names import KUBELET_SOCKET, VERSION
from ._plugin import KubeletPluginProcess
from ._servicer import DevicePluginServicer

__all__ = ["resource_endpoint"]


def resource_endpoint(directory: str, offer: ResourceOffer, plugin: PID, servicer: DevicePluginServicer,
                      executor: Executor, *, poll_s: float = 1.0) -> KubeletRegistration:
    """Serve and register ``offer`` (see module rules)."""
    directory = os.path.abspath(directory)
    socket = GrpcSocket(os.path.join(directory, offer.socket_name), offer.resource,
                        lambda server: rpc.add_DevicePluginServicer_to_server(servicer, server), executor,
                        service="DevicePlugin")
    request = pb.RegisterRequest(
        version=VERSION, endpoint=offer.socket_name, resource_name=offer.resource,
        options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
    )
    return KubeletRegistration(socket, os.path.join(directory, KUBELET_SOCKET), request,
                               lambda: dispatch(plugin, KubeletPluginProcess.registered, offer.resource),
                               option="--device_plugin_dir", poll_s=poll_s)
