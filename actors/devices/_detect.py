"""Which device backend a machine supports, and where its hierarchy is.

Rules:
- ``auto``: not root -> ``memory`` (with a warning: nothing is isolated);
  ``/sys/fs/cgroup`` is a pure cgroup2 mount (it has ``cgroup.controllers``)
  -> ``cgroups_v2`` there; ``/sys/fs/cgroup/devices`` is a v1 devices
  hierarchy -> ``cgroups_v1`` (a hybrid machine keeps device rules in v1);
  otherwise ``memory`` with a warning.
- ``auto`` with a hierarchy: v1 if it has ``devices.allow``, v2 if it has
  ``cgroup.controllers`` (memory when not root), else an error.
- An explicit backend without a hierarchy uses ``/sys/fs/cgroup/devices``
  (v1), or ``/sys/fs/cgroup`` when it is cgroup2, else
  ``/sys/fs/cgroup/unified`` (v2).
"""

from __future__ import annotations

import logging
import os

from actors.flags import DEVICE_BACKENDS

from ._errors import DeviceControlError

logger = logging.getLogger(__name__)

CGROUP_MOUNT = "/sys/fs/cgroup"


def detect_backend(cgroup_mount: str = CGROUP_MOUNT) -> tuple[str, str | None]:
    """``(backend, hierarchy)`` for this machine (see module rules)."""
    if os.geteuid() != 0:
        logger.warning("Not running as root: device control is in memory only, nothing is isolated")
        return "memory", None
    if os.path.isfile(os.path.join(cgroup_mount, "cgroup.controllers")):
        return "cgroups_v2", cgroup_mount
    devices = os.path.join(cgroup_mount, "devices")
    if os.path.isfile(os.path.join(devices, "devices.allow")):
        return "cgroups_v1", devices
    logger.warning(
        "No cgroup devices hierarchy at %s (neither cgroup2 nor a v1 devices controller):"
        " device control is in memory only, nothing is isolated",
        cgroup_mount,
    )
    return "memory", None


def default_hierarchy(backend: str, cgroup_mount: str = CGROUP_MOUNT) -> str | None:
    """The hierarchy an explicitly chosen backend uses when none is given."""
    if backend == "cgroups_v1":
        return os.path.join(cgroup_mount, "devices")
    if backend == "cgroups_v2":
        if os.path.isfile(os.path.join(cgroup_mount, "cgroup.controllers")):
            return cgroup_mount
        return os.path.join(cgroup_mount, "unified")
    return None


def resolve_backend(backend: str, hierarchy: str | None) -> tuple[str, str | None]:
    """``(backend, hierarchy)`` from a ``device_backend`` flag value and an optional hierarchy."""
    if backend not in DEVICE_BACKENDS:
        raise DeviceControlError(
            f"Unknown device backend {backend!r}: expected one of {', '.join(DEVICE_BACKENDS)}"
        )
    if backend == "auto":
        if hierarchy is None:
            return detect_backend()
        if os.geteuid() != 0:
            logger.warning("Not running as root: device control is in memory only, nothing is isolated")
            return "memory", None
        if os.path.isfile(os.path.join(hierarchy, "devices.allow")):
            return "cgroups_v1", hierarchy
        if os.path.isfile(os.path.join(hierarchy, "cgroup.controllers")):
            return "cgroups_v2", hierarchy
        raise DeviceControlError(
            f"'{hierarchy}' is neither a cgroups v1 devices hierarchy nor a cgroup2 mount"
        )
    return backend, hierarchy if hierarchy is not None else default_hierarchy(backend)
