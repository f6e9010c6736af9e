"""Device control: which devices each container's cgroup may use.

One actor (``DeviceControl`` / ``DeviceControlProcess``) owns every device
rule write, behind one port with three backends: cgroups v1 (files), cgroups
v2 (an eBPF program per cgroup, checkpointed) and in-memory. Shaped like
runc's ``libcontainer/cgroups/devices``: a pure rule model (``_rules``), a
compiler of it to eBPF (``_device_program``), and backends that only apply,
in a thread or in a device worker process of their own (``_worker``).
Each module states its rules at the top.
"""

from ._backend import (
    DeviceBackend,
    DeviceOperation,
    FaultInjectingBackend,
    SimulatedCrash,
    validate_cgroup,
    validate_cgroups_root,
)
from ._cgroups_v1 import CgroupsV1Backend
from ._cgroups_v2 import PROGRAM_NAME, CgroupsV2Backend, checkpoint_file
from ._control import DeviceControl, DeviceControlProcess
from ._detect import default_hierarchy, detect_backend, resolve_backend
from ._device_program import build_device_program, program_instructions
from ._errors import (
    CheckpointError,
    DeviceControlError,
    DeviceRuleError,
    InvalidCgroupError,
    KernelOperationError,
)
from ._memory import MemoryBackend
from ._worker import WorkerBackend, WorkerError
from ._rules import (
    STANDARD_CONTAINER_DEVICES,
    CgroupDeviceAccess,
    DeviceRule,
    apply_diff,
    container_policy,
    is_granted,
    normalize,
)

__all__ = [
    "DeviceBackend", "DeviceOperation", "FaultInjectingBackend", "SimulatedCrash", "validate_cgroup",
    "validate_cgroups_root", "CgroupsV1Backend", "CgroupsV2Backend", "PROGRAM_NAME",
    "checkpoint_file", "DeviceControl", "DeviceControlProcess", "default_hierarchy", "detect_backend",
    "resolve_backend", "build_device_program", "program_instructions", "CheckpointError",
    "DeviceControlError", "DeviceRuleError", "InvalidCgroupError", "KernelOperationError",
    "MemoryBackend", "WorkerBackend", "WorkerError", "STANDARD_CONTAINER_DEVICES", "CgroupDeviceAccess", "DeviceRule",
    "apply_diff", "container_policy", "is_granted", "normalize",
]
