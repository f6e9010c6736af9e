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

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    ".allocator._handle": ("NvidiaGpuAllocator",),
    ".gpu": ("NVIDIA_MAJOR", "Gpu", "GpuInfo"),
    ".volume._volume": ("NvidiaVolume",),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:  # a submodule, as after an eager import of the package
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .allocator._handle import NvidiaGpuAllocator
    from .gpu import NVIDIA_MAJOR, Gpu, GpuInfo
    from .volume._volume import NvidiaVolume
