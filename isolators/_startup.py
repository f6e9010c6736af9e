"""Start-up host probing: what the isolator needs before it can start.

Rules (Mesos ``NvidiaGpuIsolatorProcess::create``):
- ``check_isolation(flags)`` (R-FL-2): ``cgroups/devices`` (or ``cgroups/all``
  with the kernel's devices subsystem) and ``filesystem/linux`` must be in
  ``flags.isolation``; Mesos' messages otherwise.
- ``find_control_devices(flags, host_numbers)`` (R-IS-1) records the control
  devices by number: ``nvidiactl`` and ``nvidia-uvm`` are required (missing
  ``nvidia-uvm`` runs ``nvidia-modprobe -u -c 0`` once), ``nvidia-uvm-tools``
  and ``nvidia-modeset`` are taken when present. A simulated node whose
  ``dev_dir`` has no ``nvidiactl`` takes the numbers from its host file.
- ``probe_host(flags, host_numbers)`` does both: every call here blocks (reads
  ``/proc/cgroups``, stats nodes, may run a program), so
  ``create`` runs it as ONE executor job, never on the event loop.
"""

from __future__ import annotations

import os
import subprocess

from actors.devices import DeviceRule
from actors.flags import Flags

from ._errors import IsolatorError

REQUIRED_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_CONTROL_DEVICES = ("nvidia-uvm-tools", "nvidia-modeset")


def probe_host(flags: Flags, host_numbers: dict[str, str] | None) -> dict[str, DeviceRule]:
    """``check_isolation`` then ``find_control_devices`` (blocking: run it in an executor)."""
    check_isolation(flags)
    return find_control_devices(flags, host_numbers)


def check_isolation(flags: Flags) -> None:
    """R-FL-2: the isolators the GPU isolator needs, with Mesos' messages (blocking)."""
    tokens = [t.strip() for t in flags.isolation.split(",") if t.strip()]
    if "cgroups/all" in tokens:
        if not devices_subsystem_enabled():
            raise IsolatorError("The `devices` cgroups subsystem is not enabled by the kernel")
    elif "cgroups/devices" not in tokens:
        raise IsolatorError(
            "The 'cgroups/devices' or 'cgroups/all' isolator must be enabled in order to use the 'gpu/nvidia' isolator"
        )
    if "filesystem/linux" not in tokens:
        raise IsolatorError("The 'filesystem/linux' isolator must be enabled in order to use the 'gpu/nvidia' isolator")


def devices_subsystem_enabled() -> bool:
    """Whether the kernel has the devices cgroup subsystem (blocking: reads /proc)."""
    try:
        with open("/proc/cgroups") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == "devices":
                    return fields[-1] == "1"
    except OSError:
        pass
    # cgroup2 controls devices through eBPF, always available there.
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def find_control_devices(flags: Flags, host_numbers: dict[str, str] | None) -> dict[str, DeviceRule]:
    """R-IS-1: the control devices by number, from ``dev_dir`` or the host file.

    Blocking (stat, maybe ``nvidia-modprobe``): run it through an executor."""
    dev_dir = flags.dev_dir
    present = os.path.exists(os.path.join(dev_dir, "nvidiactl"))
    if not present and host_numbers is not None:
        rules = {}
        for name, numbers in host_numbers.items():
            major, minor = (int(x) for x in str(numbers).split(":"))
            rules[os.path.join(dev_dir, name)] = DeviceRule("c", major, minor, "rwm")
        return rules
    uvm = os.path.join(dev_dir, "nvidia-uvm")
    if present and not os.path.exists(uvm):
        try:
            subprocess.run(["nvidia-modprobe", "-u", "-c", "0"], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise IsolatorError(f"Failed to load '{uvm}': {e}") from None
    rules = {}
    for name in REQUIRED_CONTROL_DEVICES + OPTIONAL_CONTROL_DEVICES:
        path = os.path.join(dev_dir, name)
        try:
            st = os.stat(path)
        except OSError as e:
            if name in REQUIRED_CONTROL_DEVICES:
                raise IsolatorError(f"Failed to obtain device ID for '{path}': {e.strerror}") from None
            continue
        rules[path] = DeviceRule("c", os.major(st.st_rdev), os.minor(st.st_rdev), "rwm")
    return rules
