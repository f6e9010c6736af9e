"""The Kubernetes kubelet device plugin (deviceplugin v1beta1; SPEC section 18).

``gpu-isolator kubelet-plugin`` offers the node's GPUs (and MIG devices) to
the kubelet over gRPC on unix sockets: the isolator's inventory, the
allocator's health (which recovers) and topology, and the CDI node spec
the container runtime reads. ``DeviceCatalog`` is what it offers (a
``UnitCatalog``), ``plan_preferred`` / ``allocate_answer`` its answers,
``KubeletPluginProcess`` the actor that decides (``PodLeases``: its
units in the node ledger, taken at Allocate and returned when no pod
holds them), ``DevicePluginServicer``
the gRPC translation, ``resource_endpoint`` a resource's socket kept
served and registered (the shared ``KubeletRegistration``), ``run_plugin``
the command, with pod repair (``isolators.kubernetes.pod_repair``) on by
default. The API's names and constants are in ``_names``. Rules of each
piece are at the top of its module.

Names are imported when first used, so the CLI does not load gRPC for
other commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "._names": ("ALLOCATE_GRACE_S", "DEFAULT_DIR", "HEALTHY", "KUBELET_SOCKET", "MAX_ID_LENGTH", "UNHEALTHY",
                "VERSION", "socket_name"),
    "._allocate": ("ContainerAnswer", "DeviceSpecAnswer", "allocate_answer"),
    "._leases": ("PLUGIN_OWNER", "PodLeases", "allocation_holder"),
    "._catalog": ("DeviceCatalog", "OfferedDevice", "ResourceOffer", "resource_of_pool"),
    "._command": ("add_command",),
    "._endpoint": ("resource_endpoint",),
    "._plugin": ("KubeletPluginProcess", "NODE_SPEC_FILE", "PLUGIN_ID"),
    "._preferred": ("PreferredPlan", "plan_preferred"),
    "._run": ("PluginOptions", "PluginSummary", "run_plugin"),
    "._servicer": ("DevicePluginServicer",),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._allocate import ContainerAnswer, DeviceSpecAnswer, allocate_answer
    from ._catalog import DeviceCatalog, OfferedDevice, ResourceOffer, resource_of_pool
    from ._leases import PLUGIN_OWNER, PodLeases, allocation_holder
    from ._command import add_command
    from ._endpoint import resource_endpoint
    from ._names import (ALLOCATE_GRACE_S, DEFAULT_DIR, HEALTHY, KUBELET_SOCKET, MAX_ID_LENGTH, UNHEALTHY, VERSION,
                         socket_name)
    from ._plugin import NODE_SPEC_FILE, PLUGIN_ID, KubeletPluginProcess
    from ._preferred import PreferredPlan, plan_preferred
    from ._run import PluginOptions, PluginSummary, run_plugin
    from ._servicer import DevicePluginServicer
