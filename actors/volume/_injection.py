"""Whether a container gets the NVIDIA volume, and the env it then needs.

Rules (Mesos ``NvidiaVolume::shouldInject`` / ``ENV``):
- R-VO-2 ``should_inject(manifest)``: when the image env sets
  ``NVIDIA_VISIBLE_DEVICES`` (nvidia-container-runtime's variable), the
  answer is whether its value is neither empty nor ``void`` -- the variable
  wins over the label; otherwise whether the label
  ``com.nvidia.volumes.needed`` (nvidia-docker 1.0) exists, whatever its
  value.
- R-VO-3 ``volume_env(manifest)``: starting from the image's own ``PATH``
  and ``LD_LIBRARY_PATH`` (split at ``:``, empty items dropped), PATH gains
  ``/usr/local/nvidia/bin`` and LD_LIBRARY_PATH gains
  ``/usr/local/cuda/compat``, ``/usr/local/nvidia/lib`` and
  ``/usr/local/nvidia/lib64``, in that order (CUDA's forward-compatibility
  libraries shipped in the image go before the host's), each only when not
  already present. Only these two variables are returned; the image's other
  variables are the caller's, untouched.
- Both are pure functions of the manifest.
"""

from __future__ import annotations

import posixpath

from ..manifest import ImageManifest

__all__ = ["CONTAINER_PATH", "CUDA_COMPAT_PATH", "should_inject", "volume_env"]

CONTAINER_PATH = "/usr/local/nvidia"
CUDA_COMPAT_PATH = "/usr/local/cuda/compat"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VOLUMES_NEEDED_LABEL = "com.nvidia.volumes.needed"


def should_inject(manifest: ImageManifest) -> bool:
    """Whether a container of this image should get the volume (R-VO-2)."""
    environment = manifest.environment()
    if VISIBLE_DEVICES in environment:
        return environment[VISIBLE_DEVICES] not in ("", "void")
    return VOLUMES_NEEDED_LABEL in manifest.labels


def _extend(value: str, additions: list[str]) -> str:
    items = [item for item in value.split(":") if item]
    for addition in additions:
        if addition not in items:
            items.append(addition)
    return ":".join(items)


def volume_env(manifest: ImageManifest, container_path: str = CONTAINER_PATH) -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH for a container that gets the volume (R-VO-3)."""
    environment = manifest.environment()
    return {
        "PATH": _extend(environment.get("PATH", ""),
                        [posixpath.join(container_path, "bin")]),
        "LD_LIBRARY_PATH": _extend(environment.get("LD_LIBRARY_PATH", ""), [
            CUDA_COMPAT_PATH,
            posixpath.join(container_path, "lib"),
            posixpath.join(container_path, "lib64"),
        ]),
    }
