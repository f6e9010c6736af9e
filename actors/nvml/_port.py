"""The NVML port: the questions the isolator asks a node's GPUs.

Rules:
- ``Nvml`` mirrors the NVML C API the isolator uses, one method per call:
  ``init``/``shutdown``, ``driver_version``, ``device_count``,
  ``handle(index)``, and per handle ``minor``, ``uuid``, ``name``,
  ``pci_bus_id``, ``memory``, ``utilization``, ``power_mw``,
  ``temperature_c``, ``numa_node``, ``mig_mode``, ``nvlink_remote_bus_ids``;
  ``topology_level(h1, h2)`` for a pair; ``control_devices()`` for the
  control device numbers; and health events as NVML gives them (R-HE-1,2):
  ``event_set_create``, ``supported_event_types(h)``,
  ``register_events(h, types, event_set)`` (refuses a type the GPU does not
  support), ``event_set_wait(event_set, timeout_s)`` (a ``HealthEvent``, or
  None at NVML_ERROR_TIMEOUT) and ``event_set_free``.
- ``interrupt_wait(event_set)`` is the one call that may come from any
  thread while another waits: it ends that wait early where the
  implementation can (the simulated node); NVML itself cannot, so there a
  wait ends at its timeout.
- MIG (R-MG-1): per GPU handle ``max_mig_device_count`` and
  ``mig_device_handle(handle, index)`` (NVML_ERROR_NOT_FOUND for an empty
  slot); per MIG device handle ``gpu_instance_id``, ``compute_instance_id``,
  ``mig_parent_handle``, ``mig_profile`` (e.g. ``1g.18gb``), and ``uuid``
  (``MIG-…``) and ``memory`` as for a GPU. As NVML does, utilization, power
  and temperature of a MIG device handle are NVML_ERROR_NOT_SUPPORTED, and a
  MIG handle given to any other per-GPU call is NVML_ERROR_INVALID_ARGUMENT.
- Compute mode (R-MP-1): ``compute_mode(handle)`` and
  ``set_compute_mode(handle, mode)`` (``nvmlDeviceGetComputeMode`` /
  ``nvmlDeviceSetComputeMode``) with NVML's values ``COMPUTE_MODE_DEFAULT``
  0, ``COMPUTE_MODE_PROHIBITED`` 2, ``COMPUTE_MODE_EXCLUSIVE_PROCESS`` 3
  (``COMPUTE_MODE_NAMES``); the mode is the driver's, so it outlives the
  process that set it. Whole GPUs only: a MIG device handle is
  NVML_ERROR_INVALID_ARGUMENT; setting another value (1, NVML's retired
  EXCLUSIVE_THREAD, or an unknown one) is NVML_ERROR_INVALID_ARGUMENT.
- Every method blocks (a real NVML call can take milliseconds): actors call
  them only through ``NvmlService``, which runs them on the runtime's
  Executor (R-NV-2).
- Failures raise ``NvmlError`` naming the NVML function; a question the
  device cannot answer raises ``NvmlNotSupported``.
- Two implementations: ``BindingsNvml`` (the ``pynvml`` module) and
  ``SimulatedNvml`` (a host file). For one host file both answer the same
  (R-NV-3), which the fake-NVML tests prove.
- Topology levels are NVML's ``NVML_TOPOLOGY_*`` values: the smaller the
  closer (INTERNAL 0: same board, SINGLE 10: one PCIe switch, MULTIPLE 20:
  several switches, HOSTBRIDGE 30, NODE 40: same NUMA node, SYSTEM 50:
  across sockets).
"""

from __future__ import annotations

import abc
from typing import Any

import msgspec

__all__ = [
    "Nvml",
    "DeviceHandle",
    "EventSet",
    "MemoryInfo",
    "Utilization",
    "HealthEvent",
    "TOPOLOGY_INTERNAL",
    "TOPOLOGY_SINGLE",
    "TOPOLOGY_MULTIPLE",
    "TOPOLOGY_HOSTBRIDGE",
    "TOPOLOGY_NODE",
    "TOPOLOGY_SYSTEM",
    "TOPOLOGY_NAMES",
    "EVENT_TYPE_XID",
    "EVENT_TYPE_DOUBLE_BIT_ECC",
    "HEALTH_EVENT_TYPES",
    "DEFAULT_CONTROL_DEVICES",
    "NVLINK_MAX_LINKS",
    "MAX_MIG_DEVICES",
    "COMPUTE_MODE_DEFAULT",
    "COMPUTE_MODE_PROHIBITED",
    "COMPUTE_MODE_EXCLUSIVE_PROCESS",
    "COMPUTE_MODE_NAMES",
]

COMPUTE_MODE_DEFAULT = 0
COMPUTE_MODE_PROHIBITED = 2
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3

COMPUTE_MODE_NAMES = {
    COMPUTE_MODE_DEFAULT: "DEFAULT",
    1: "EXCLUSIVE_THREAD",
    COMPUTE_MODE_PROHIBITED: "PROHIBITED",
    COMPUTE_MODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS",
}
"""NVML's ``nvmlComputeMode_t`` names (as ``nvidia-smi -c`` takes them)."""

TOPOLOGY_INTERNAL = 0
TOPOLOGY_SINGLE = 10
TOPOLOGY_MULTIPLE = 20
TOPOLOGY_HOSTBRIDGE = 30
TOPOLOGY_NODE = 40
TOPOLOGY_SYSTEM = 50

TOPOLOGY_NAMES = {
    TOPOLOGY_INTERNAL: "BRD",
    TOPOLOGY_SINGLE: "PIX",
    TOPOLOGY_MULTIPLE: "PXB",
    TOPOLOGY_HOSTBRIDGE: "PHB",
    TOPOLOGY_NODE: "NODE",
    TOPOLOGY_SYSTEM: "SYS",
}
"""Short names as ``nvidia-smi topo -m`` prints them (BRD: same board)."""

NVLINK_MAX_LINKS = 18
"""Links a GPU may have (NVML_NVLINK_MAX_LINKS on Hopper)."""

MAX_MIG_DEVICES = 7
"""MIG device slots of a MIG-enabled GPU (``nvmlDeviceGetMaxMigDeviceCount`` on
A100/H100/H200/B200: seven compute slices, at most one MIG device each)."""


EVENT_TYPE_DOUBLE_BIT_ECC = 0x0000000000000002
"""``nvmlEventTypeDoubleBitEccError``."""
EVENT_TYPE_XID = 0x0000000000000008
"""``nvmlEventTypeXidCriticalError``."""
HEALTH_EVENT_TYPES = {"xid": EVENT_TYPE_XID, "ecc": EVENT_TYPE_DOUBLE_BIT_ECC}
"""The event types health monitoring registers, by ``HealthEvent.kind``."""

DEFAULT_CONTROL_DEVICES = {
    "nvidiactl": "195:255",
    "nvidia-uvm": "235:0",
    "nvidia-uvm-tools": "235:1",
    "nvidia-modeset": "195:254",
}
"""Control device numbers of a simulated node unless its host file says otherwise."""

DeviceHandle = Any
"""An implementation's opaque device handle (from ``Nvml.handle``)."""

EventSet = Any
"""An implementation's opaque event set (from ``Nvml.event_set_create``)."""


class MemoryInfo(msgspec.Struct, frozen=True):
    """Device memory in bytes (``nvmlDeviceGetMemoryInfo``)."""

    total: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)


class Utilization(msgspec.Struct, frozen=True):
    """Percent of time busy over the last sample (``nvmlDeviceGetUtilizationRates``)."""

    gpu: int
    memory: int


class HealthEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A health event from NVML: an Xid, or an uncorrectable (double-bit) ECC error.
    Whether it matters is the allocator's call (``Flags.nvidia_ignored_xids``)."""

    index: int
    """The GPU's NVML index."""
    kind: str
    """``"xid"`` or ``"ecc"``."""
    code: int = 0
    """The Xid number (0 for ECC)."""
    gpu_instance: int | None = None
    """The MIG GPU instance the event is about; None for the whole GPU."""

    def describe(self) -> str:
        """``Xid 79`` / ``double-bit ECC error``: the reason a GPU is withheld."""
        if self.kind == "xid":
            return f"Xid {self.code}"
        return "double-bit ECC error"


class Nvml(abc.ABC):
    """The NVML port (see module rules). Every method blocks."""

    kind: str = "nvml"
    """``"nvml"`` (the bindings) or ``"simulated"``."""

    source: str = ""
    """Where the answers come from (a host file path, or ``libnvidia-ml.so.1``)."""

    @abc.abstractmethod
    def init(self) -> None:
        """``nvmlInit``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """``nvmlShutdown``."""

    @abc.abstractmethod
    def driver_version(self) -> str:
        """``nvmlSystemGetDriverVersion``."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """``nvmlDeviceGetCount_v2``."""

    @abc.abstractmethod
    def handle(self, index: int) -> DeviceHandle:
        """``nvmlDeviceGetHandleByIndex_v2``."""

    @abc.abstractmethod
    def minor(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetMinorNumber``."""

    @abc.abstractmethod
    def uuid(self, handle: DeviceHandle) -> str:
        """``nvmlDeviceGetUUID``."""

    @abc.abstractmethod
    def name(self, handle: DeviceHandle) -> str:
        """``nvmlDeviceGetName``."""

    @abc.abstractmethod
    def pci_bus_id(self, handle: DeviceHandle) -> str:
        """``nvmlDeviceGetPciInfo_v3().busId`` (``00000000:3B:00.0``)."""

    @abc.abstractmethod
    def memory(self, handle: DeviceHandle) -> MemoryInfo:
        """``nvmlDeviceGetMemoryInfo``."""

    @abc.abstractmethod
    def utilization(self, handle: DeviceHandle) -> Utilization:
        """``nvmlDeviceGetUtilizationRates``."""

    @abc.abstractmethod
    def power_mw(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetPowerUsage`` (milliwatts)."""

    @abc.abstractmethod
    def temperature_c(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``."""

    @abc.abstractmethod
    def numa_node(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetNumaNodeId``."""

    @abc.abstractmethod
    def mig_mode(self, handle: DeviceHandle) -> bool:
        """``nvmlDeviceGetMigMode`` (current mode enabled)."""

    @abc.abstractmethod
    def compute_mode(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetComputeMode``: a ``COMPUTE_MODE_*`` value."""

    @abc.abstractmethod
    def set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        """``nvmlDeviceSetComputeMode`` (root only on a real driver)."""

    # ------------------------------------------------------------ MIG

    @abc.abstractmethod
    def max_mig_device_count(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetMaxMigDeviceCount``: MIG device slots of a GPU."""

    @abc.abstractmethod
    def mig_device_handle(self, handle: DeviceHandle, index: int) -> DeviceHandle:
        """``nvmlDeviceGetMigDeviceHandleByIndex``; NVML_ERROR_NOT_FOUND when the
        slot ``index`` holds no MIG device."""

    @abc.abstractmethod
    def gpu_instance_id(self, mig_handle: DeviceHandle) -> int:
        """``nvmlDeviceGetGpuInstanceId`` of a MIG device handle."""

    @abc.abstractmethod
    def compute_instance_id(self, mig_handle: DeviceHandle) -> int:
        """``nvmlDeviceGetComputeInstanceId`` of a MIG device handle."""

    @abc.abstractmethod
    def mig_parent_handle(self, mig_handle: DeviceHandle) -> DeviceHandle:
        """``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``."""

    @abc.abstractmethod
    def mig_profile(self, mig_handle: DeviceHandle) -> str:
        """The MIG device's profile name, e.g. ``1g.18gb`` (see ``actors.mig``)."""

    @abc.abstractmethod
    def nvlink_remote_bus_ids(self, handle: DeviceHandle) -> list[str]:
        """Remote PCI bus id of every active NVLink link (``nvmlDeviceGetNvLinkState``
        and ``nvmlDeviceGetNvLinkRemotePciInfo_v2`` over links 0..N)."""

    @abc.abstractmethod
    def topology_level(self, first: DeviceHandle, second: DeviceHandle) -> int:
        """``nvmlDeviceGetTopologyCommonAncestor``: a ``TOPOLOGY_*`` level."""

    @abc.abstractmethod
    def control_devices(self) -> dict[str, str]:
        """Control device name -> ``"major:minor"`` as this node knows them
        (a real node: empty; the isolator stats ``/dev`` instead)."""

    @abc.abstractmethod
    def event_set_create(self) -> EventSet:
        """``nvmlEventSetCreate``."""

    @abc.abstractmethod
    def supported_event_types(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetSupportedEventTypes``: a mask of ``EVENT_TYPE_*`` bits."""

    @abc.abstractmethod
    def register_events(self, handle: DeviceHandle, types: int, event_set: EventSet) -> None:
        """``nvmlDeviceRegisterEvents``; a type the GPU does not support →
        ``NvmlNotSupported`` and nothing registered."""

    @abc.abstractmethod
    def event_set_wait(self, event_set: EventSet, timeout_s: float) -> HealthEvent | None:
        """``nvmlEventSetWait_v2``: block up to ``timeout_s`` for the next event
        registered on ``event_set``; None on NVML_ERROR_TIMEOUT, any other
        failure raises ``NvmlError``."""

    @abc.abstractmethod
    def event_set_free(self, event_set: EventSet) -> None:
        """``nvmlEventSetFree``."""

    def interrupt_wait(self, event_set: EventSet) -> None:
        """End a wait on ``event_set`` early where possible (any thread; see rules)."""

    def close(self) -> None:
        """Shut down, ignoring errors (idempotent)."""
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
