"""The Kubernetes kubelet device plugin (deviceplugin v1beta1; SPEC section 18).

``gpu-isolator kubelet-plugin`` offers the node's GPUs (and MIG devices) to
the kubelet over gRPC on unix sockets: the isolator's inventory, the
allocator's health (which recovers) and topology, and the CDI node spec
the container runtime reads. ``DeviceCatalog`` is what it offers,
``plan_preferred`` / ``allocate_answer`` its answers, ``KubeletPluginProcess``
the actor that decides, ``DevicePluginServicer`` the gRPC translation,
``ResourceEndpoint`` the socket kept served and registered, ``run_plugin``
the command. The API's messages and stubs are the committed modules
generated from ``_proto/deviceplugin.proto`` (``_api``); the API's names
and constants are in ``_names``. Rules of each piece
are at the top of its module.

Names are imported when first used, so the CLI does not load gRPC for
other commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime._lazy import lazy_exports

_EXPORTS = {
    "._names": ("DEFAULT_DIR", "HEALTHY", "KUBELET_SOCKET", "MAX_ID_LENGTH", "UNHEALTHY", "VERSION", "socket_name"),
    "._allocate": ("ContainerAnswer", "DeviceSpecAnswer", "allocate_answer"),
    "._catalog": ("DeviceCatalog", "OfferedDevice", "PluginSetupError", "ResourceOffer", "resource_of_pool"),
    "._endpoint": ("ResourceEndpoint",),
    "._errors": ("FAILED_PRECONDITION", "INVALID_ARGUMENT", "PluginRequestError"),
    "._plugin": ("KubeletPluginProcess", "NODE_SPEC_FILE", "PLUGIN_ID"),
    "._preferred": ("PreferredPlan", "plan_preferred"),
    "._run": ("DEFAULT_CDI_SPEC_DIR", "PluginOptions", "PluginSummary", "run_plugin"),
    "._servicer": ("DevicePluginServicer",),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._allocate import ContainerAnswer, DeviceSpecAnswer, allocate_answer
    from ._names import DEFAULT_DIR, HEALTHY, KUBELET_SOCKET, MAX_ID_LENGTH, UNHEALTHY, VERSION, socket_name
    from ._catalog import DeviceCatalog, OfferedDevice, PluginSetupError, ResourceOffer, resource_of_pool
    from ._endpoint import ResourceEndpoint
    from ._errors import FAILED_PRECONDITION, INVALID_ARGUMENT, PluginRequestError
    from ._plugin import NODE_SPEC_FILE, PLUGIN_ID, KubeletPluginProcess
    from ._preferred import PreferredPlan, plan_preferred
    from ._run import DEFAULT_CDI_SPEC_DIR, PluginOptions, PluginSummary, run_plugin
    from ._servicer import DevicePluginServicer
