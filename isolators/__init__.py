"""The isolator layer: Mesos' data types, flags, the NVIDIA GPU isolator
actor and its handle, message scripts, the service and the CLI.

Each name has one home. This package exports the isolator and its data
types, the value types an agent configures it with (``Flags``,
``Resources``, ``ImageManifest`` and their errors; they live in modules of
``actors``, which the actors use too) and the message-script entry points;
``isolators.script`` adds what extends scripts (actions, the format),
``isolators.cdi`` the CDI and OCI renderings, ``isolators.service`` the
isolator as a service (``serve``, ``exec``, ``status``),
``isolators.simulated_node`` the simulated node. The GPU identity and the
allocator and volume handles are exported by ``actors``.

Names are imported when first used (as in ``runtime`` and ``actors``): a
command that needs little (``gpu-isolator exec``, ``status``) does not
import the whole agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "actors.flags": ("Flags", "FlagsError"),
    "actors.manifest": ("ImageManifest", "ManifestError"),
    "actors.resources": ("Resources", "ResourcesError"),
    "._components": ("NvidiaComponents",),
    "._errors": ("InvalidContainerID", "IsolatorError"),
    "._handle": ("NvidiaGpuIsolator",),
    "._process": ("NvidiaGpuIsolatorProcess",),
    "._types": ("ContainerClass", "ContainerConfig", "ContainerID", "ContainerLaunchInfo", "ContainerLimitation",
                "ContainerMountInfo", "ContainerState", "GpuStatistics", "Repair", "ResourceStatistics",
                "ContainerGrant", "ContainerDevice", "ContainerBindMount"),
    ".script._action": ("ScriptError",),
    ".script._format": ("Script",),
    ".script._loading": ("load_script", "load_script_file"),
    ".script._report": ("ScriptReport", "StepResult"),
    ".script._runner": ("ScriptRunner", "run_script"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from actors.flags import Flags, FlagsError
    from actors.manifest import ImageManifest, ManifestError
    from actors.resources import Resources, ResourcesError

    from ._components import NvidiaComponents
    from ._errors import InvalidContainerID, IsolatorError
    from ._handle import NvidiaGpuIsolator
    from ._process import NvidiaGpuIsolatorProcess
    from ._types import ContainerBindMount, ContainerClass, ContainerConfig, ContainerDevice, ContainerGrant
    from ._types import ContainerID, ContainerLaunchInfo, ContainerLimitation, ContainerMountInfo
    from ._types import ContainerState, GpuStatistics, Repair, ResourceStatistics
    from .script._action import ScriptError
    from .script._format import Script
    from .script._loading import load_script, load_script_file
    from .script._report import ScriptReport, StepResult
    from .script._runner import ScriptRunner, run_script
