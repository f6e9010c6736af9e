"""The NVIDIA volume: the host driver's user-space files for containers that
bring their own root filesystem (SPEC section 7, R-VO-1..3), and the
``/dev/nvidia*`` nodes such containers get (R-IS-3).

- ``NvidiaVolume`` (the handle, exported by ``actors``) / ``NvidiaVolumeProcess``
  (the actor): build and grow
  ``<volume_dir>/nvidia_<version>`` from the loader cache and the search path;
  ``should_inject`` / ``env`` decide and describe the injection.
- ``read_ld_cache`` / ``parse_ld_cache``: ``/etc/ld.so.cache`` (new, compat and
  old formats). ``read_elf``: class, NEEDED and ABI note of a library.
- ``nvidia_device_nodes`` / ``copy_device_nodes``: the device nodes, listed
  and mknod'ed into a container's devices directory (blocking; run them
  through an executor).
"""

from ._build import BINARIES, LIBRARIES, VolumeReport, build_volume, library_skip_reason, volume_host_path
from ._device_nodes import DeviceNode, copy_device_nodes, nvidia_device_nodes
from ._elf import ElfInfo, read_elf
from ._errors import DeviceNodeError, ElfError, LdCacheError, VolumeError
from ._injection import CONTAINER_PATH, should_inject, volume_env
from ._ldcache import DEFAULT_LD_CACHE, LdCacheEntry, parse_ld_cache, read_ld_cache
from ._volume import NvidiaVolumeProcess

__all__ = [
    "BINARIES", "LIBRARIES", "CONTAINER_PATH", "DEFAULT_LD_CACHE",
    "NvidiaVolumeProcess", "VolumeReport", "build_volume",
    "volume_host_path", "library_skip_reason", "should_inject", "volume_env",
    "LdCacheEntry", "parse_ld_cache", "read_ld_cache", "ElfInfo", "read_elf",
    "DeviceNode", "nvidia_device_nodes", "copy_device_nodes",
    "VolumeError", "LdCacheError", "ElfError", "DeviceNodeError",
]
