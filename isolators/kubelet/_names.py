"""The deviceplugin v1beta1 API's names and constants, as this plugin uses them.

Rules (SPEC section 18):
- ``VERSION`` is ``"v1beta1"``; health is ``HEALTHY`` / ``UNHEALTHY``;
  ``DEFAULT_DIR`` is ``/var/lib/kubelet/device-plugins``, where the
  kubelet serves ``KUBELET_SOCKET`` (``kubelet.sock``).
- A device ID is at most ``MAX_ID_LENGTH`` (63) characters.
- A resource ``vendor/name`` is served on ``gpu-isolator-<name>.sock``
  (``socket_name``): ``nvidia.com/gpu`` on ``gpu-isolator-gpu.sock``,
  ``nvidia.com/mig-1g.18gb`` on ``gpu-isolator-mig-1g.18gb.sock``.
- ``DEFAULT_POD_RESOURCES_SOCKET`` is where the kubelet serves its
  PodResources API v1 (``/var/lib/kubelet/pod-resources/kubelet.sock``).
- ``unix_target(path)`` is the gRPC address of a unix socket path (absolute).
- No gRPC here: the CLI reads these names while parsing any command.
"""

from __future__ import annotations

import os

__all__ = [
    "VERSION", "HEALTHY", "UNHEALTHY", "DEFAULT_DIR", "KUBELET_SOCKET", "MAX_ID_LENGTH", "SOCKET_PREFIX",
    "socket_name", "unix_target", "DEFAULT_POD_RESOURCES_SOCKET",
]

VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
MAX_ID_LENGTH = 63
SOCKET_PREFIX = "gpu-isolator-"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def socket_name(resource: str) -> str:
    """The plugin's socket file name for ``resource`` (see module rules)."""
    return f"{SOCKET_PREFIX}{resource.rsplit('/', 1)[-1]}.sock"


def unix_target(path: str) -> str:
    """``unix:///abs/path``: gRPC's name for a unix socket."""
    return "unix://" + os.path.abspath(path)
