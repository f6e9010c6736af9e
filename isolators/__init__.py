"""The isolator layer: Mesos' data types, flags, the NVIDIA GPU isolator
actor and its handle, message scripts and the CLI.

Each name has one home. This package exports the isolator and its data
types, the value types an agent configures it with (``Flags``,
``Resources``, ``ImageManifest`` and their errors; they live in modules of
``actors``, which the actors use too) and the message-script entry points;
``isolators.script`` adds what extends scripts (actions, the format),
``isolators.cdi`` the CDI and OCI renderings, ``isolators.testing`` the
simulated node. The GPU identity and the allocator and volume handles are
exported by ``actors``.
"""

from actors.flags import Flags, FlagsError
from actors.manifest import ImageManifest, ManifestError
from actors.resources import Resources, ResourcesError

from ._components import NvidiaComponents
from ._errors import InvalidContainerID, IsolatorError
from ._isolator import MesosIsolator, NvidiaGpuIsolatorProcess
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
from .script._action import ScriptError
from .script._format import Script
from .script._loading import load_script, load_script_file
from .script._report import ScriptReport, StepResult
from .script._runner import ScriptRunner, run_script

__all__ = [
    "Flags", "FlagsError", "ImageManifest", "ManifestError", "Resources", "ResourcesError",
    "NvidiaComponents", "InvalidContainerID", "IsolatorError", "MesosIsolator",
    "NvidiaGpuIsolatorProcess", "Script", "ScriptError", "ScriptReport", "ScriptRunner", "StepResult", "load_script",
    "load_script_file", "run_script", "ContainerClass", "ContainerConfig", "ContainerID",
    "ContainerLaunchInfo", "ContainerLimitation", "ContainerMountInfo", "ContainerState",
    "GpuStatistics", "Repair", "ResourceStatistics",
]
