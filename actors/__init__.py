"""The domain actors and their ports: NVML (real bindings or a simulated
node), the GPU allocator, device control (cgroups v1, cgroups v2 eBPF,
in-memory), MIG devices and the NVIDIA volume.

Each name has one home: the subpackages export their own pieces
(``actors.devices``, ``actors.nvml``, ``actors.allocator``, ``actors.mig``,
``actors.volume``); this package exports the GPU identity (``Gpu``,
``GpuInfo``, ``NVIDIA_MAJOR``) and the two handles an agent builds
(``NvidiaGpuAllocator``, ``NvidiaVolume``). The value types the isolator
layer is configured with (``Flags``, ``Resources``, ``ImageManifest``) live
in modules here and are exported by ``isolators``.

Imports point one way: ``isolators`` -> ``actors`` -> ``runtime``.

Names are imported when first used: importing one module of a subpackage
(the device worker process imports only the device backends) does not
import the whole agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    ".allocator._handle": ("NvidiaGpuAllocator",),
    ".gpu": ("NVIDIA_MAJOR", "Gpu", "GpuInfo"),
    ".volume._volume": ("NvidiaVolume",),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from .allocator._handle import NvidiaGpuAllocator
    from .gpu import NVIDIA_MAJOR, Gpu, GpuInfo
    from .volume._volume import NvidiaVolume
