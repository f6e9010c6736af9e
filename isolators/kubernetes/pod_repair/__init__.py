"""Pods keep their GPUs: ``/dev/char`` links and repair after a systemd reload (SPEC sections 20, 23).

Pod repair is its own part of the Kubernetes home: the device plugin
runs it today (``--repair_pods``), and any front door that hands out
these units can (it reads a ``UnitCatalog``). ``PodRepair`` is one pass
(PodResources, the ``/dev/char`` links, the join, the kernel's answer,
the access given back) over a ``PodHost`` (``KernelPodHost``;
``testing.MemoryPodHost``); ``node_repair`` builds it for this node from
``RepairOptions``. Its pieces: ``_cgroups`` (kubepods names of both
drivers, the runtime's record), ``_access`` (v1 lists, v2 programs:
judged and widened), ``_systemd`` (the scope's ``DeviceAllow=`` and
systemd's reloads, over the system bus with ``dbus-fast``),
``_dev_char`` and ``_pod_resources`` (the kubelet's PodResources v1).
Rules of each piece are at the top of its module.

Names are imported when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "._access": ("AccessError", "CgroupGone", "give_access", "missing_access"),
    "._cgroups": ("DEFAULT_CONFIG_TEMPLATES", "DEFAULT_KUBEPODS_ROOTS", "ContainerCgroup", "PodIdentity",
                  "parse_container_cgroup", "read_identity", "scan_kubepods"),
    "._dev_char": ("CharLinks", "ensure_char_links"),
    "._host": ("KernelPodHost",),
    "._node": ("RepairOptions", "node_repair"),
    "._pod_resources": ("DEFAULT_POD_RESOURCES_SOCKET", "AssignedDevices", "PodResourcesClient",
                        "PodResourcesUnavailable"),
    "._repair": ("ContainerCheck", "FailedContainer", "ObservedContainer", "PodHost", "PodRepair", "RepairPass",
                 "RepairedContainer"),
    "._systemd": ("SYSTEMD_BUS_NAME", "SystemdRefused", "SystemdScopes", "device_allow_entries"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._access import AccessError, CgroupGone, give_access, missing_access
    from ._cgroups import DEFAULT_CONFIG_TEMPLATES, DEFAULT_KUBEPODS_ROOTS, ContainerCgroup, PodIdentity
    from ._cgroups import parse_container_cgroup, read_identity, scan_kubepods
    from ._dev_char import CharLinks, ensure_char_links
    from ._host import KernelPodHost
    from ._node import RepairOptions, node_repair
    from ._pod_resources import DEFAULT_POD_RESOURCES_SOCKET, AssignedDevices, PodResourcesClient
    from ._pod_resources import PodResourcesUnavailable
    from ._repair import ContainerCheck, FailedContainer, ObservedContainer, PodHost, PodRepair, RepairPass
    from ._repair import RepairedContainer
    from ._systemd import SYSTEMD_BUS_NAME, SystemdRefused, SystemdScopes, device_allow_entries
