"""The deviceplugin v1beta1 API's names and constants, as this plugin uses them.

Rules (SPEC section 18):
- ``VERSION`` is ``"v1beta1"``; health is ``HEALTHY`` / ``UNHEALTHY``;
  ``DEFAULT_DIR`` is ``/var/lib/kubelet/device-plugins``, where the
  kubelet serves ``KUBELET_SOCKET`` (``kubelet.sock``).
- A device ID is at most ``MAX_ID_LENGTH`` (63) characters.
- A resource ``vendor/name`` is served on ``gpu-isolator-<name>.sock``
  (``socket_name``): ``nvidia.com/gpu`` on ``gpu-isolator-gpu.sock``,
  ``nvidia.com/mig-1g.18gb`` on ``gpu-isolator-mig-1g.18gb.sock``.
- ``ALLOCATE_GRACE_S`` (10): how long the units an ``Allocate`` took in
  the node ledger wait for PodResources to name them before they go back
  (``PodLeases``; ``--allocate_grace``, hidden).
- No gRPC here: the CLI reads these names while parsing any command.
"""

from __future__ import annotations

__all__ = ["ALLOCATE_GRACE_S", "VERSION", "HEALTHY", "UNHEALTHY", "DEFAULT_DIR", "KUBELET_SOCKET", "MAX_ID_LENGTH", "SOCKET_PREFIX",
           "socket_name"]

VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
MAX_ID_LENGTH = 63
ALLOCATE_GRACE_S = 10.0
SOCKET_PREFIX = "gpu-isolator-"


def socket_name(resource: str) -> str:
    """The plugin's socket file name for ``resource`` (see module rules)."""
    return f"{SOCKET_PREFIX}{resource.rsplit('/', 1)[-1]}.sock"
