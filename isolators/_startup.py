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
- A control device node that is not a character device (a regular file, a
  directory, a block device), or whose major is wrong (``nvidiactl`` and
  ``nvidia-modeset`` are NVIDIA's major 195; ``nvidia-uvm`` and
  ``nvidia-uvm-tools`` never are, and have the major the kernel registered
  for ``nvidia-uvm`` in ``<proc_dir>/devices`` when it lists one), is one
  clear error naming the path: such a node would become a meaningless rule.
  The node's kernel facts come from ``--proc_dir`` alone (``/proc`` on a
  real node; a simulated node's own directory, whose ``devices`` may be
  absent: then only "not 195" is checked), never from the host's ``/proc``
  behind a node's back.
- ``probe_host(flags, host_numbers)`` does both: every call here blocks (reads
  ``/proc/cgroups`` and ``<proc_dir>/devices``, stats nodes, may run a program), so
  ``create`` runs it as ONE executor job, never on the event loop.
"""

from __future__ import annotations

import os
import stat
import subprocess

from actors import NVIDIA_MAJOR
from actors.devices import DeviceRule
from actors.flags import Flags

from ._errors import IsolatorError

REQUIRED_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_CONTROL_DEVICES = ("nvidia-uvm-tools", "nvidia-modeset")
NVIDIA_MAJOR_DEVICES = ("nvidiactl", "nvidia-modeset")
"""Control devices of the NVIDIA driver's own major (195)."""
UVM_DEVICES = ("nvidia-uvm", "nvidia-uvm-tools")
"""Control devices of the ``nvidia-uvm`` module's major (registered when it loads)."""


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


def registered_major(name: str, proc_devices: str = "/proc/devices") -> int | None:
    """The major the kernel registered for character driver ``name``, if listed."""
    try:
        with open(proc_devices) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    in_char = False
    for line in lines:
        if line.strip() == "Character devices:":
            in_char = True
            continue
        if line.strip() == "Block devices:":
            in_char = False
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[1] == name and fields[0].isdigit():
            return int(fields[0])
    return None


def find_control_devices(flags: Flags, host_numbers: dict[str, str] | None,
                         kernel_facts: bool = True) -> dict[str, DeviceRule]:
    """R-IS-1: the control devices by number, from ``dev_dir`` or the host file;
    ``kernel_facts=False`` reads nothing from ``proc_dir`` (a simulated node
    not pointed at any: only "not 195" is checked for ``nvidia-uvm``).

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
    uvm_major = registered_major("nvidia-uvm", os.path.join(flags.proc_dir, "devices")) if kernel_facts else None
    rules = {}
    for name in REQUIRED_CONTROL_DEVICES + OPTIONAL_CONTROL_DEVICES:
        path = os.path.join(dev_dir, name)
        try:
            st = os.stat(path)
        except OSError as e:
            if name in REQUIRED_CONTROL_DEVICES:
                raise IsolatorError(f"Failed to obtain device ID for '{path}': {e.strerror}") from None
            continue
        rules[path] = _control_rule(path, name, st, uvm_major)
    return rules


def _control_rule(path: str, name: str, st: os.stat_result, uvm_major: int | None) -> DeviceRule:
    """The rule of one control device node, or a clear error for a node that is not one."""
    if not stat.S_ISCHR(st.st_mode):
        raise IsolatorError(
            f"'{path}' is not a character device ({_file_kind(st.st_mode)}): the NVIDIA control device"
            f" '{name}' must be the driver's device node; recreate it (nvidia-modprobe) or fix --dev_dir"
        )
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    if name in NVIDIA_MAJOR_DEVICES and major != NVIDIA_MAJOR:
        raise IsolatorError(
            f"'{path}' is the character device {major}:{minor}, not of the NVIDIA major {NVIDIA_MAJOR}:"
            f" it is not the control device '{name}'; recreate it (nvidia-modprobe) or fix --dev_dir"
        )
    if name in UVM_DEVICES and (major == NVIDIA_MAJOR or (uvm_major is not None and major != uvm_major)):
        expected = (f"the major {uvm_major} the kernel registered for nvidia-uvm" if uvm_major is not None
                    else f"a major other than {NVIDIA_MAJOR} (the nvidia-uvm module's own)")
        raise IsolatorError(
            f"'{path}' is the character device {major}:{minor}, not of {expected}: it is not the"
            f" control device '{name}'; recreate it (nvidia-modprobe -u -c 0) or fix --dev_dir"
        )
    return DeviceRule("c", major, minor, "rwm")


def _file_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a device"
