"""Device control: which devices each container's cgroup may use.

One actor (``DeviceControl`` / ``DeviceControlProcess``) owns every device
rule write, behind one port with three backends: cgroups v1 (files), cgroups
v2 (an eBPF program per cgroup, checkpointed) and in-memory. Shaped like
runc's ``libcontainer/cgroups/devices``: a pure rule model (``_rules``),
one interned policy value (``_policy``), a pure emulator of the v1
kernel's semantics (``_v1_emulator``), a compiler of policies to eBPF
(``_device_program``), and backends that only apply,
driven in line, in a thread or in a device worker process of their own
(``_drivers``, ``_worker``). Each module states its rules at the top.
``bpf`` offers the bpf(2) calls to tools that drive the kernel directly;
``testing`` the fault-injection doubles tests use.

Names are imported when first used, so that a device worker process can
import the backend modules alone (``_worker_child``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "._backend": ("DeviceBackend", "DeviceOperation", "validate_cgroup", "validate_cgroups_root"),
    "._cgroups_v1": ("CgroupsV1Backend",),
    "._cgroups_v2": ("PROGRAM_NAME", "CgroupsV2Backend", "checkpoint_file"),
    "._control": ("DeviceControl", "DeviceControlProcess"),
    "._detect": ("default_hierarchy", "detect_backend", "resolve_backend"),
    "._device_program": ("build_device_program", "program_instructions"),
    "._errors": ("CheckpointError", "DeviceControlError", "DeviceRuleError", "InvalidCgroupError",
                 "KernelOperationError", "WorkerError"),
    "._memory": ("MemoryBackend",),
    "._policy": ("STANDARD_CONTAINER_DEVICES", "Policy", "apply_diff", "container_policy"),
    "._rules": ("DeviceRule", "is_granted", "normalize"),
    "._v1_emulator": ("plan_writes", "v1_exceptions"),
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
    from ._backend import DeviceBackend, DeviceOperation, validate_cgroup, validate_cgroups_root
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
        WorkerError,
    )
    from ._memory import MemoryBackend
    from ._policy import STANDARD_CONTAINER_DEVICES, Policy, apply_diff, container_policy
    from ._rules import DeviceRule, is_granted, normalize
    from ._v1_emulator import plan_writes, v1_exceptions
