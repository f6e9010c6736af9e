"""The Kubernetes kubelet device plugin (deviceplugin v1beta1; SPEC section 18).

``gpu-isolator kubelet-plugin`` offers the node's GPUs (and MIG devices) to
the kubelet over gRPC on unix sockets: the isolator's inventory, the
allocator's health (which recovers) and topology, and the CDI node spec
the container runtime reads. ``DeviceCatalog`` is what it offers,
``plan_preferred`` / ``allocate_answer`` its answers, ``KubeletPluginProcess``
the actor that decides, ``DevicePluginServicer`` the gRPC translation,
``ResourceEndpoint`` the socket kept served and registered, ``run_plugin``
the command. Pod repair (SPEC section 20, reusable by any plugin that
hands out these devices): ``PodRepair`` (one pass: PodResources, the
``/dev/char`` links, the join, the kernel's answer, the access given back)
over a ``PodHost`` (``KernelPodHost``; ``testing.MemoryPodHost``), with
``_pod_cgroups`` (kubepods names of both drivers, the runtime's record),
``_pod_access`` (v1 lists, v2 programs: judged and widened), ``_dev_char``
and ``_pod_resources``. The API's messages and stubs are the committed modules
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
    "._names": ("DEFAULT_DIR", "DEFAULT_POD_RESOURCES_SOCKET", "HEALTHY", "KUBELET_SOCKET", "MAX_ID_LENGTH",
                "UNHEALTHY", "VERSION", "socket_name"),
    "._allocate": ("ContainerAnswer", "DeviceSpecAnswer", "allocate_answer"),
    "._catalog": ("DeviceCatalog", "OfferedDevice", "PluginSetupError", "ResourceOffer", "resource_of_pool"),
    "._endpoint": ("ResourceEndpoint",),
    "._errors": ("FAILED_PRECONDITION", "INVALID_ARGUMENT", "PluginRequestError"),
    "._plugin": ("KubeletPluginProcess", "NODE_SPEC_FILE", "PLUGIN_ID"),
    "._preferred": ("PreferredPlan", "plan_preferred"),
    "._dev_char": ("CharLinks", "ensure_char_links"),
    "._pod_access": ("AccessError", "CgroupGone", "give_access", "missing_access"),
    "._pod_cgroups": ("ContainerCgroup", "PodIdentity", "parse_container_cgroup", "read_identity", "scan_kubepods"),
    "._pod_host": ("KernelPodHost",),
    "._pod_repair": ("ContainerCheck", "FailedContainer", "ObservedContainer", "PodHost", "PodRepair", "RepairPass",
                     "RepairedContainer"),
    "._pod_resources": ("AssignedDevices", "PodResourcesClient", "PodResourcesUnavailable"),
    "._run": ("DEFAULT_CDI_SPEC_DIR", "PluginOptions", "PluginSummary", "run_plugin"),
    "._servicer": ("DevicePluginServicer",),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._allocate import ContainerAnswer, DeviceSpecAnswer, allocate_answer
    from ._names import DEFAULT_POD_RESOURCES_SOCKET
    from ._names import DEFAULT_DIR, HEALTHY, KUBELET_SOCKET, MAX_ID_LENGTH, UNHEALTHY, VERSION, socket_name
    from ._catalog import DeviceCatalog, OfferedDevice, PluginSetupError, ResourceOffer, resource_of_pool
    from ._endpoint import ResourceEndpoint
    from ._errors import FAILED_PRECONDITION, INVALID_ARGUMENT, PluginRequestError
    from ._plugin import NODE_SPEC_FILE, PLUGIN_ID, KubeletPluginProcess
    from ._preferred import PreferredPlan, plan_preferred
    from ._dev_char import CharLinks, ensure_char_links
    from ._pod_access import AccessError, CgroupGone, give_access, missing_access
    from ._pod_cgroups import ContainerCgroup, PodIdentity, parse_container_cgroup, read_identity, scan_kubepods
    from ._pod_host import KernelPodHost
    from ._pod_repair import ContainerCheck, FailedContainer, ObservedContainer, PodHost, PodRepair, RepairPass
    from ._pod_repair import RepairedContainer
    from ._pod_resources import AssignedDevices, PodResourcesClient, PodResourcesUnavailable
    from ._run import DEFAULT_CDI_SPEC_DIR, PluginOptions, PluginSummary, run_plugin
    from ._servicer import DevicePluginServicer
