"""The isolator layer: Mesos' data types, flags, the NVIDIA GPU isolator
actor and its handle, message scripts and the CLI.

Value types the actors need too (``Gpu``, ``Resources``, ``Flags``,
``ImageManifest``) live in ``actors`` and are re-exported here.
"""

from actors import Flags, Gpu, ImageManifest, NvidiaGpuAllocator, NvidiaVolume, Resources

from ._components import NvidiaComponents
from ._errors import InvalidContainerID, IsolatorError
from ._isolator import MesosIsolator, NvidiaGpuIsolatorProcess
from .script import (
    Script,
    ScriptError,
    ScriptReport,
    ScriptRunner,
    StepResult,
    load_script,
    load_script_file,
    run_script,
)
from ._types import (
    ContainerClass,
    ContainerConfig,
    ContainerID,
    ContainerLaunchInfo,
    ContainerLimitation,
    ContainerMountInfo,
    ContainerState,
    GpuStatistics,
    Repair,
    ResourceStatistics,
)

__all__ = [
    "Flags", "Gpu", "ImageManifest", "NvidiaGpuAllocator", "NvidiaVolume", "Resources",
    "NvidiaComponents", "InvalidContainerID", "IsolatorError", "MesosIsolator",
    "NvidiaGpuIsolatorProcess", "Script", "ScriptError", "ScriptReport", "ScriptRunner", "StepResult", "load_script",
    "load_script_file", "run_script", "ContainerClass", "ContainerConfig", "ContainerID",
    "ContainerLaunchInfo", "ContainerLimitation", "ContainerMountInfo", "ContainerState",
    "GpuStatistics", "Repair", "ResourceStatistics",
]
