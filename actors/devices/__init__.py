"""Device control: which devices each container's cgroup may use.

One actor (``DeviceControl`` / ``DeviceControlProcess``) owns every device
rule write, behind one port with three backends: cgroups v1 (files), cgroups
v2 (an eBPF program per cgroup, read back from the kernel) and in-memory. Shaped like
runc's ``libcontainer/cgroups/devices``: a pure rule model (``_rules``),
one interned policy value (``_policy``), a pure emulator of the v1
kernel's semantics (``_v1_emulator``), a compiler of policies to eBPF
(``_device_program``), a judge of other agents' programs
(``_foreign_program``: runc's, systemd's), and backends that only apply, each syscall through
one seam (``_kernel``: ``KERNEL``, which pod repair's writes use too), driven in line, in a thread or in a device worker
process of their own (``_drivers``, ``_worker``), every one applying an
operation through the same function. Each module states its rules at the
top. ``bpf`` offers the bpf(2) calls to tools that drive the kernel
directly; ``testing`` the fault-injection doubles tests use (a kernel seam
that injects faults: the backends have one path).

Names are imported when first used, so that a device worker process can
import the backend modules alone (``_worker_child``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "._backend": ("DeviceBackend", "DeviceOperation", "validate_cgroup", "validate_cgroups_root"),
    "._cgroups_v1": ("CgroupsV1Backend",),
    "._cgroups_v2": ("PROGRAM_NAME", "CgroupsV2Backend"),
    "._control": ("DeviceControl", "DeviceControlProcess"),
    "._detect": ("default_hierarchy", "detect_backend", "resolve_backend"),
    "._device_program": ("build_device_program", "program_instructions", "read_policy"),
    "._foreign_program": ("allowing", "program_allows", "program_grants"),
    "._kernel": ("KERNEL", "Kernel", "kernel_error"),
    "._errors": ("AgentCrash", "DeviceControlError", "DeviceRuleError", "ForeignProgramsError",
                 "InvalidCgroupError", "KernelOperationError", "WorkerError"),
    "._memory": ("MemoryBackend",),
    "._policy": ("STANDARD_CONTAINER_DEVICES", "Policy", "apply_diff", "container_policy"),
    "._rules": ("DeviceRule", "is_granted", "normalize"),
    "._v1_emulator": ("listed_access", "plan_writes", "v1_exceptions"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._backend import DeviceBackend, DeviceOperation, validate_cgroup, validate_cgroups_root
    from ._cgroups_v1 import CgroupsV1Backend
    from ._cgroups_v2 import PROGRAM_NAME, CgroupsV2Backend
    from ._control import DeviceControl, DeviceControlProcess
    from ._detect import default_hierarchy, detect_backend, resolve_backend
    from ._device_program import build_device_program, program_instructions, read_policy
    from ._foreign_program import allowing, program_allows, program_grants
    from ._kernel import KERNEL, Kernel, kernel_error
    from ._errors import AgentCrash, DeviceControlError, DeviceRuleError, ForeignProgramsError
    from ._errors import InvalidCgroupError, KernelOperationError, WorkerError
    from ._memory import MemoryBackend
    from ._policy import STANDARD_CONTAINER_DEVICES, Policy, apply_diff, container_policy
    from ._rules import DeviceRule, is_granted, normalize
    from ._v1_emulator import listed_access, plan_writes, v1_exceptions
