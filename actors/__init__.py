"""The domain actors and their ports: NVML (real bindings or a simulated
node), the GPU allocator, device control (cgroups v1, cgroups v2 eBPF,
in-memory) and the NVIDIA volume. Value types the isolator shares (``Gpu``,
``Resources``, ``Flags``, ``ImageManifest``) live here too.

Imports point one way: ``isolators`` -> ``actors`` -> ``runtime``.

Names are imported when first used: importing one module of a subpackage
(the device worker process imports only the device backends) does not
import the whole agent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    ".allocator": ("AllocatorError", "AllocatorState", "GpuAllocatorProcess", "GpuHealth", "NvidiaGpuAllocator"),
    ".devices": ("CgroupDeviceAccess", "DeviceControl", "DeviceControlError", "DeviceControlProcess", "DeviceRule",
                 "FaultInjectingBackend", "KernelOperationError", "container_policy", "detect_backend", "is_granted"),
    ".flags": ("Flags", "FlagsError"),
    ".gpu": ("NVIDIA_MAJOR", "Gpu", "GpuInfo"),
    ".inventory_table": ("render_inventory",),
    ".manifest": ("ImageManifest", "ManifestError"),
    ".mig": ("MigCapabilities", "MigCapabilityError", "MigDevice", "MigDeviceInfo", "read_mig_capabilities"),
    ".nvml": ("BindingsNvml", "GpuUsage", "HealthEvent", "HostFileError", "NodeInventory", "Nvml", "NvmlError",
              "NvmlNotSupported", "NvmlService", "SimulatedNvml", "load_host_file", "open_nvml"),
    ".resources": ("Resources", "ResourcesError"),
    ".volume": ("DeviceNode", "DeviceNodeError", "NvidiaVolume", "NvidiaVolumeProcess", "VolumeError",
                "copy_device_nodes", "nvidia_device_nodes"),
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
    from .allocator import AllocatorError, AllocatorState, GpuAllocatorProcess, GpuHealth, NvidiaGpuAllocator
    from .devices import (
        CgroupDeviceAccess,
        DeviceControl,
        DeviceControlError,
        DeviceControlProcess,
        DeviceRule,
        FaultInjectingBackend,
        KernelOperationError,
        container_policy,
        detect_backend,
        is_granted,
    )
    from .flags import Flags, FlagsError
    from .gpu import NVIDIA_MAJOR, Gpu, GpuInfo
    from .inventory_table import render_inventory
    from .manifest import ImageManifest, ManifestError
    from .mig import MigCapabilities, MigCapabilityError, MigDevice, MigDeviceInfo, read_mig_capabilities
    from .nvml import (
        BindingsNvml,
        GpuUsage,
        HealthEvent,
        HostFileError,
        NodeInventory,
        Nvml,
        NvmlError,
        NvmlNotSupported,
        NvmlService,
        SimulatedNvml,
        load_host_file,
        open_nvml,
    )
    from .resources import Resources, ResourcesError
    from .volume import (
        DeviceNode,
        DeviceNodeError,
        NvidiaVolume,
        NvidiaVolumeProcess,
        VolumeError,
        copy_device_nodes,
        nvidia_device_nodes,
    )
