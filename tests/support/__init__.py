"""What tests share, imported (never copied into a conftest, never handed
out by a fixture): ``kernel`` (hierarchies, skip reasons, cgroup and eBPF
teardown), ``probes`` (a child that opens device nodes from inside a
cgroup, mknod'ed nodes), ``nodes`` (a simulated node for one test and the
kernel as judge of it), ``containers`` (container ids and configs, the
usual two-container start, free GPUs, bounded cleanup, a test's end),
``engines`` (podman and runc on a busybox rootfs, for the CDI tests),
``cdi`` (``cdi generate`` run in-process with a node's own host facts),
``fake_driver`` (a fake NVIDIA driver built with
gcc, loader caches), ``fake_nvml`` (the fake NVML library and ``NvmlProbe``,
which runs the real pynvml against it in a child: ``nvml_probe.py``,
``health_probe.py``).

The names below are re-exported for the ``kit`` fixture that older
reliability tests use; new tests import from the modules.
"""

from .kernel import BACKENDS, KERNEL_BACKENDS, NVIDIA, SEEN_PROGRAMS, V1_HIERARCHY, V2_HIERARCHY
from .kernel import available_backends, hierarchy_of, members, remove_test_cgroups, skip_reason
from .nodes import Node, judge, usage_host
from .probes import DeviceProbe

__all__ = [
    "BACKENDS", "KERNEL_BACKENDS", "NVIDIA", "SEEN_PROGRAMS", "V1_HIERARCHY", "V2_HIERARCHY",
    "available_backends", "hierarchy_of", "members", "remove_test_cgroups", "skip_reason",
    "Node", "judge", "usage_host", "DeviceProbe",
]
