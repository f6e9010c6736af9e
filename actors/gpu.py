"""A GPU: its identity (`Gpu`) and the facts an inventory knows about it (`GpuInfo`).

Rules:
- A GPU *is* its character device number: ``Gpu(major, minor)``. NVIDIA's
  major is 195 (``NVIDIA_MAJOR``); the minor is what NVML reports as the
  device's minor number (``/dev/nvidia<minor>``). Two ``Gpu`` values are the
  same GPU exactly when both numbers match.
- ``Gpu`` is frozen, hashable and ordered by (major, minor), like Mesos'
  ``operator<``; ``str(gpu)`` is ``major:minor`` (the cgroup device-rule
  form) and ``Gpu.parse`` reverses it (``major.minor``, Mesos' stream form, is
  accepted too).
- Richer facts (NVML index, UUID, PCI bus id, memory, NUMA node, PCIe switch,
  NVLink peers, MIG mode) hang off an inventory record, ``GpuInfo``, never off
  the identity: the allocator and the isolator trade ``Gpu`` values only.
- ``GpuInfo.nvlink`` maps a peer's NVML index to the number of NVLink links
  between the two GPUs.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

__all__ = ["NVIDIA_MAJOR", "Gpu", "GpuInfo"]

NVIDIA_MAJOR = 195
"""The character-device major number of NVIDIA GPUs (``/dev/nvidia<minor>``)."""

_DEVICE_NUMBER = re.compile(r"^\s*(\d+)\s*[:.]\s*(\d+)\s*$")

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class Gpu(msgspec.Struct, frozen=True, order=True):
    """A GPU by its device number: ``Gpu(195, 0)`` is ``/dev/nvidia0``."""

    major: _NonNegative
    minor: _NonNegative

    def __str__(self) -> str:
        return f"{self.major}:{self.minor}"

    def __repr__(self) -> str:
        return f"Gpu({self.major}, {self.minor})"

    @classmethod
    def nvidia(cls, minor: int) -> "Gpu":
        """The NVIDIA GPU with this minor number (major 195)."""
        return cls(NVIDIA_MAJOR, minor)

    @classmethod
    def parse(cls, text: str) -> "Gpu":
        """Parse ``"195:3"`` (or Mesos' ``"195.3"``); raises ValueError otherwise."""
        match = _DEVICE_NUMBER.match(text)
        if match is None:
            raise ValueError(f"Invalid GPU {text!r}: expected 'major:minor', e.g. '195:0'")
        return cls(int(match.group(1)), int(match.group(2)))


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the inventory knows about one GPU (NVML or a simulated node)."""

    index: int
    """The NVML index (``nvmlDeviceGetHandleByIndex``), i.e. the position on the node."""
    gpu: Gpu
    uuid: str
    name: str
    pci_bus_id: str
    """As NVML prints it: ``00000000:3B:00.0``."""
    memory_total_mib: int
    numa_node: int | None = None
    pcie_switch: int | None = None
    """The lowest index of the GPUs sharing this GPU's PCIe switch (NVML topology
    level SINGLE or closer); None when it shares a switch with no other GPU."""
    nvlink: dict[int, int] = {}
    """Peer NVML index -> number of NVLink links to that peer."""
    mig: bool = False
    """Whether MIG mode is enabled."""

    @property
    def minor(self) -> int:
        return self.gpu.minor
