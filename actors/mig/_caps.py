"""MIG capability nodes: which device numbers a MIG device's holder needs.

Rules (SPEC R-MG-2; NVIDIA's ``nvidia-caps`` driver interface):
- Access to a MIG device needs its parent's ``/dev/nvidia<minor>``, and the
  capability nodes of its GPU instance and of its compute instance,
  ``/dev/nvidia-caps/nvidia-cap<minor>``.
- The capability minors come from ``<proc_dir>/driver/nvidia-caps/mig-minors``,
  one ``<path> <minor>`` a line: ``gpu<N>/gi<G>/access <minor>`` (a GPU
  instance) and ``gpu<N>/gi<G>/ci<C>/access <minor>`` (a compute instance),
  N being the parent GPU's minor number; other lines (``config``,
  ``monitor``, ``fabric-imex-mgmt`` …) are kept but not needed here. The
  major is the number of the ``nvidia-caps`` line of ``<proc_dir>/devices``
  (a dynamic major, different on every host). The simulated node reads the
  same files: tests and demos write their own ``proc_dir``.
- ``read_mig_capabilities(proc_dir)`` reads both files (blocking: run it in
  an executor). A missing file reads as "no facts" (checked later, against
  the MIG devices that need them); a file that exists but is malformed is
  one ``MigCapabilityError`` naming the file, the line and the form
  expected.
- ``MigCapabilities.require(devices)`` fails with ONE ``MigCapabilityError``
  listing every MIG device without its facts (no major, or a minor missing),
  naming the files and what to do next.
- The device rules of a MIG device (``mig_device_rules``): the parent node
  ``c 195:<minor> rwm`` (exactly a whole GPU's rule, so two holders of one
  GPU's MIG devices share it and nothing else), and ``c <caps major>:<minor>
  r`` for each capability node (real capability nodes are mode 0444: read is
  what a holder needs; mknod comes from the standard set's ``c *:* m``).
- ``proc_files(device)``: the capability proc files of a MIG device
  (``<proc_dir>/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/access`` and
  ``…/ci<C>/access``) that a container with its own rootfs gets read-only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import msgspec

from runtime import Failure

from actors.gpu import Gpu

from ._device import MigDevice, unit_sort_key

__all__ = [
    "MigCapabilities",
    "MigCapabilityError",
    "read_mig_capabilities",
    "MIG_MINORS_FILE",
    "CAPS_DEVICE_NAME",
    "CAPS_DEV_SUBDIR",
]

MIG_MINORS_FILE = os.path.join("driver", "nvidia-caps", "mig-minors")
"""Relative to ``proc_dir``."""
CAPS_DEVICE_NAME = "nvidia-caps"
"""The character device name in ``<proc_dir>/devices``."""
CAPS_DEV_SUBDIR = "nvidia-caps"
"""``<dev_dir>/nvidia-caps/nvidia-cap<minor>``."""
_CAPS_PROC_DIR = os.path.join("driver", "nvidia", "capabilities")

_MINOR_LINE = re.compile(r"^(\S+)\s+(\d{1,7})$")
_MIG_PATH = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access$")
_MAX_MINOR = (1 << 20) - 1
_MAX_MAJOR = (1 << 12) - 1
_MAX_FILE_BYTES = 1 << 20


class MigCapabilityError(Failure):
    """The capability facts of MIG devices are missing or malformed; the
    message names the files and the devices."""


class MigCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """The capability facts of a node (see module rules)."""

    proc_dir: str
    major: int | None
    """The ``nvidia-caps`` major, None when ``<proc_dir>/devices`` has no such line."""
    minors: dict[str, int]
    """``"gpu0/gi1/access"`` -> minor, every line of ``mig-minors``."""

    @property
    def minors_file(self) -> str:
        return os.path.join(self.proc_dir, MIG_MINORS_FILE)

    @property
    def devices_file(self) -> str:
        return os.path.join(self.proc_dir, "devices")

    def gpu_instance_minor(self, parent: Gpu, gi: int) -> int | None:
        return self.minors.get(f"gpu{parent.minor}/gi{gi}/access")

    def compute_instance_minor(self, parent: Gpu, gi: int, ci: int) -> int | None:
        return self.minors.get(f"gpu{parent.minor}/gi{gi}/ci{ci}/access")

    def cap_minors(self, device: MigDevice) -> tuple[int, int]:
        """``(GPU-instance minor, compute-instance minor)``; KeyError naming what is missing."""
        gi = self.gpu_instance_minor(device.parent, device.gi)
        ci = self.compute_instance_minor(device.parent, device.gi, device.ci)
        if self.major is None or gi is None or ci is None:
            raise KeyError(self._missing(device))
        return gi, ci

    def _missing(self, device: MigDevice) -> str:
        gone = []
        if self.major is None:
            gone.append(f"no '{CAPS_DEVICE_NAME}' line in '{self.devices_file}'")
        for path, minor in (
            (f"gpu{device.parent.minor}/gi{device.gi}/access", self.gpu_instance_minor(device.parent, device.gi)),
            (
                f"gpu{device.parent.minor}/gi{device.gi}/ci{device.ci}/access",
                self.compute_instance_minor(device.parent, device.gi, device.ci),
            ),
        ):
            if minor is None:
                gone.append(f"no line '{path}'")
        return f"MIG device {device}: " + ", ".join(gone)

    def require(self, devices: Iterable[MigDevice]) -> None:
        """One MigCapabilityError listing every device without its facts."""
        missing = []
        for device in sorted(set(devices), key=unit_sort_key):
            try:
                self.cap_minors(device)
            except KeyError as exc:
                missing.append(exc.args[0])
        if missing:
            raise MigCapabilityError(
                f"MIG devices without capability facts in '{self.minors_file}' and '{self.devices_file}'"
                f" ({len(missing)}): " + "; ".join(missing)
                + ". Each MIG device needs its GPU- and compute-instance capability minors and the"
                f" '{CAPS_DEVICE_NAME}' major (is the nvidia-caps driver loaded? on a test node, point"
                " '--proc_dir' at files of your own)"
            )

    def mig_device_rules(self, device: MigDevice) -> list:
        """The device rules that grant one MIG device (see module rules)."""
        from actors.devices import DeviceRule  # actors.devices is heavier; import on use

        gi_minor, ci_minor = self.cap_minors(device)
        return [
            DeviceRule("c", device.parent.major, device.parent.minor, "rwm"),
            DeviceRule("c", self.major, gi_minor, "r"),
            DeviceRule("c", self.major, ci_minor, "r"),
        ]

    def cap_node_paths(self, device: MigDevice, dev_dir: str) -> tuple[str, str]:
        """The two capability nodes under ``dev_dir``."""
        gi_minor, ci_minor = self.cap_minors(device)
        return (
            os.path.join(dev_dir, CAPS_DEV_SUBDIR, f"nvidia-cap{gi_minor}"),
            os.path.join(dev_dir, CAPS_DEV_SUBDIR, f"nvidia-cap{ci_minor}"),
        )

    def proc_files(self, device: MigDevice) -> tuple[str, str]:
        """The GPU- and compute-instance capability proc files (host paths)."""
        base = os.path.join(self.proc_dir, _CAPS_PROC_DIR, f"gpu{device.parent.minor}", "mig", f"gi{device.gi}")
        return os.path.join(base, "access"), os.path.join(base, f"ci{device.ci}", "access")


def read_mig_capabilities(proc_dir: str) -> MigCapabilities:
    """Read the capability facts under ``proc_dir`` (blocking; see module rules)."""
    major = _caps_major(os.path.join(proc_dir, "devices"))
    minors = _minors(os.path.join(proc_dir, MIG_MINORS_FILE))
    return MigCapabilities(proc_dir=proc_dir, major=major, minors=minors)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise MigCapabilityError(f"Cannot read '{path}': {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise MigCapabilityError(f"'{path}' is larger than {_MAX_FILE_BYTES} bytes: not a capability file")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise MigCapabilityError(f"'{path}' is not ASCII text: not a capability file") from None


def _caps_major(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("devices:"):
            section = stripped
            continue
        fields = stripped.split()
        if section == "Character devices:" and len(fields) == 2 and fields[1] == CAPS_DEVICE_NAME:
            if not fields[0].isdigit() or int(fields[0]) > _MAX_MAJOR:
                raise MigCapabilityError(
                    f"'{path}': the '{CAPS_DEVICE_NAME}' line has major {fields[0]!r}; expected 0..{_MAX_MAJOR}"
                )
            return int(fields[0])
    return None


def _minors(path: str) -> dict[str, int]:
    text = _read(path)
    if text is None:
        return {}
    minors: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _MINOR_LINE.match(line.strip())
        if match is None or int(match.group(2)) > _MAX_MINOR:
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise MigCapabilityError(
                f"'{path}' line {number}: {shown!r} is not '<path> <minor>'"
                f" (e.g. 'gpu0/gi1/access 12', minors 0..{_MAX_MINOR})"
            )
        name, minor = match.group(1), int(match.group(2))
        if name.startswith("gpu") and _MIG_PATH.match(name) is None:
            shown = name if len(name) <= 60 else name[:57] + "..."
            raise MigCapabilityError(
                f"'{path}' line {number}: {shown!r} is not 'gpu<N>/gi<G>/access' or 'gpu<N>/gi<G>/ci<C>/access'"
            )
        if name in minors and minors[name] != minor:
            raise MigCapabilityError(f"'{path}' line {number}: {name!r} is listed twice ({minors[name]} and {minor})")
        minors[name] = minor
    return minors
