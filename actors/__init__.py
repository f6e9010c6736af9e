"""The domain actors and their ports: NVML (real bindings or a simulated
node), the GPU allocator, device control (cgroups v1, cgroups v2 eBPF,
in-memory) and the NVIDIA volume. Value types the isolator shares (``Gpu``,
``Resources``, ``Flags``, ``ImageManifest``) live here too.

Imports point one way: ``isolators`` -> ``actors`` -> ``runtime``.
"""

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

__all__ = [
    "AllocatorError", "AllocatorState", "GpuAllocatorProcess", "GpuHealth", "NvidiaGpuAllocator",
    "CgroupDeviceAccess", "DeviceControl", "DeviceControlError", "DeviceControlProcess", "DeviceRule",
    "FaultInjectingBackend", "KernelOperationError", "container_policy", "detect_backend", "is_granted",
    "Flags", "FlagsError", "NVIDIA_MAJOR", "Gpu", "GpuInfo", "render_inventory", "ImageManifest",
    "ManifestError", "MigCapabilities", "MigCapabilityError", "MigDevice", "MigDeviceInfo",
    "read_mig_capabilities", "BindingsNvml", "GpuUsage", "HealthEvent", "HostFileError", "NodeInventory",
    "Nvml", "NvmlError", "NvmlNotSupported", "NvmlService", "SimulatedNvml", "load_host_file",
    "open_nvml", "Resources", "ResourcesError", "DeviceNode",
    "DeviceNodeError", "NvidiaVolume", "NvidiaVolumeProcess", "VolumeError", "copy_device_nodes",
    "nvidia_device_nodes",
]
