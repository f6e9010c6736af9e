"""Pod repair on this node: its options, and the ``PodRepair`` over the kernel's hierarchies.

Rules (R-PR-1):
- ``RepairOptions``: ``interval_s`` (``--repair_interval``, 5),
  ``pod_resources_socket`` (``--pod_resources_socket``),
  ``kubepods_root`` (``--kubepods_root``, relative to each hierarchy's
  mount; None tries ``kubepods.slice`` and ``kubepods``) and
  ``container_configs`` (``--container_config``: where the runtime keeps a
  container's OCI config, ``{id}`` its id).
- ``node_repair(options, catalog, facts, dev_dir, lister=None)``
  (blocking: it stats the mounts; run it on an executor) is a
  ``PodRepair`` of ``catalog``'s units over the kubelet's PodResources
  socket (``lister``: the front door's own client of it, else one made
  here), a ``KernelPodHost`` of
  the v1 devices hierarchy and the cgroup2 mount that exist, and
  ``SystemdScopes`` on the system bus (connected by ``PodRepair.start``).
  It logs at INFO where it looks, or warns when no hierarchy is there (it
  will check and repair no pod; mount /sys/fs/cgroup from the host); and
  the runtime state directories it reads the containers' records from
  (each template's directory above ``{id}``), saying which exist and
  which do not (a WARNING when none does: no container can be joined;
  mount the runtime's state directory or name it with
  ``--container_config``) (R-PR-6).
"""

from __future__ import annotations

import logging
import os

import msgspec

from ...cdi import NodeFacts
from .._catalog import UnitCatalog
from ._cgroups import DEFAULT_CONFIG_TEMPLATES, DEFAULT_KUBEPODS_ROOTS
from ._host import KernelPodHost
from ._pod_resources import DEFAULT_POD_RESOURCES_SOCKET, PodResourcesClient
from ._repair import PodRepair
from ._systemd import SystemdScopes

__all__ = ["RepairOptions", "node_repair"]

logger = logging.getLogger(__name__)


class RepairOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Pod repair's options (see module rules)."""

    interval_s: float = 5.0
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    kubepods_root: str | None = None
    """Relative to each hierarchy's mount; None: ``kubepods.slice`` and ``kubepods``."""
    container_configs: tuple[str, ...] = DEFAULT_CONFIG_TEMPLATES
    """Where the runtime keeps a container's OCI config, ``{id}`` its id."""


def node_repair(options: RepairOptions, catalog: UnitCatalog, facts: NodeFacts, dev_dir: str,
                lister: PodResourcesClient | None = None) -> PodRepair:
    """The pod repair over this node's hierarchies (see module rules)."""
    from actors.devices import default_hierarchy

    hierarchies = []
    v1 = default_hierarchy("cgroups_v1")
    if v1 is not None and os.path.isfile(os.path.join(v1, "devices.list")):
        hierarchies.append((v1, 1))
    v2 = default_hierarchy("cgroups_v2")
    if v2 is not None and os.path.isfile(os.path.join(v2, "cgroup.procs")):
        hierarchies.append((v2, 2))
    roots = (options.kubepods_root.strip("/"),) if options.kubepods_root else DEFAULT_KUBEPODS_ROOTS
    host = KernelPodHost(hierarchies, roots, options.container_configs, dev_dir=dev_dir)
    if hierarchies:
        logger.info("Pod repair every %gs: PodResources at %s, pods' cgroups under %s in %s",
                    options.interval_s, options.pod_resources_socket, " or ".join(roots),
                    ", ".join(f"{mount} (v{version})" for mount, version in hierarchies))
    else:
        logger.warning("Pod repair finds no cgroup hierarchy to look in (neither a v1 devices hierarchy nor a"
                       " cgroup2 mount under /sys/fs/cgroup): it will check and repair no pod; mount them in the"
                       " plugin's container (/sys/fs/cgroup from the host)")
    state_dirs = list(dict.fromkeys(os.path.dirname(template.split("{id}", 1)[0])
                                    for template in options.container_configs))
    there = [directory for directory in state_dirs if os.path.isdir(directory)]
    listed = ", ".join(f"{directory} ({'exists' if directory in there else 'absent'})" for directory in state_dirs)
    if there:
        logger.info("Pod repair reads the containers' runtime records (OCI configs) in: %s", listed)
    else:
        logger.warning("Pod repair finds none of the runtime state directories it reads the containers' records in:"
                       " %s; no container can be joined to its pod, so none is repaired: mount the runtime's state"
                       " directory in the plugin's container, or name it with --container_config", listed)
    return PodRepair(catalog, lister or PodResourcesClient(options.pod_resources_socket), host,
                     control_devices=facts.control_devices, dev_dir=dev_dir, caps=facts.caps,
                     systemd=SystemdScopes())
