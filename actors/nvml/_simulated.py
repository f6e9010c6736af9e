"""SimulatedNvml: the NVML port served from a host file.

Rules:
- Answers exactly what the resolved host file (``HostSpec``) says; a handle is
  the GPU's index. Facts the host file leaves out (power, temperature, NUMA
  node, topology of a pair with no facts) raise ``NvmlNotSupported``, as a
  real GPU that cannot tell does.
- Calls before ``init`` (or after ``shutdown``) fail with
  NVML_ERROR_UNINITIALIZED; an index past the end fails with
  NVML_ERROR_INVALID_ARGUMENT, as NVML does.
- Health events as NVML has them: each event set receives the events of
  the GPUs and types registered on it, raised after it was registered;
  ``supported_event_types`` answers the host file's ``supported_events``
  and ``register_events`` refuses any other type (NVML_ERROR_NOT_SUPPORTED,
  nothing registered). ``interrupt_wait`` ends a wait at once.
- Tests steer it: ``inject_xid(index, xid)`` / ``inject_ecc(index)`` raise a
  health event on a GPU (delivered to every event set registered for it;
  the count is returned); ``set_usage`` changes readings;
  ``fail(function, code)`` makes every later call of that function fail
  with that NVML code until ``fail(function, None)``; ``live_event_sets``
  counts the event sets not yet freed.
- MIG: a MIG device handle is ``(gpu index, MIG device index)``; it answers
  the MIG calls, ``uuid`` and ``memory``; utilization, power and
  temperature are NVML_ERROR_NOT_SUPPORTED and any other per-GPU call
  NVML_ERROR_INVALID_ARGUMENT, as NVML (and the fake NVML) answer a MIG
  handle. A GPU with MIG mode on has ``MAX_MIG_DEVICES`` slots; without it
  ``max_mig_device_count`` is NVML_ERROR_NOT_SUPPORTED.
- Compute mode: every GPU starts in DEFAULT; ``set_compute_mode`` takes
  DEFAULT, PROHIBITED or EXCLUSIVE_PROCESS (anything else, and a MIG
  handle, is NVML_ERROR_INVALID_ARGUMENT, as the fake NVML answers) and
  appends ``(uuid, mode)`` to ``compute_mode_changes``, the history tests
  read (as they read the fake NVML's ``$FAKE_NVML_STATE``).
- Thread-safe: the executor may call it from several threads.
"""

from __future__ import annotations

import collections
import os
import threading

import msgspec

from ._errors import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NvmlError,
)
from ._hostfile import HostSpec, SimGpu, SimMigDevice, load_host_file, parse_host_file
from ._port import COMPUTE_MODE_DEFAULT, COMPUTE_MODE_EXCLUSIVE_PROCESS, COMPUTE_MODE_PROHIBITED
from ._port import HEALTH_EVENT_TYPES, MAX_MIG_DEVICES, HealthEvent, MemoryInfo, Nvml, Utilization

__all__ = ["SimulatedNvml"]

_MIB = 1024 * 1024


class SimulatedNvml(Nvml):
    """A simulated node (see module rules)."""

    kind = "simulated"

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.source = spec.source
        self._gpus = list(spec.gpus)
        self._lock = threading.Condition()
        self._initialized = 0
        self._event_sets: list[_EventSet] = []
        self._failures: dict[str, int] = {}
        self._compute_modes: dict[int, int] = {}
        self.compute_mode_changes: list[tuple[str, int]] = []
        """Every ``set_compute_mode`` as ``(uuid, mode)``, in order (see rules)."""

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "SimulatedNvml":
        """Load and validate a host file (raises HostFileError)."""
        return cls(load_host_file(path))

    @classmethod
    def from_text(cls, text: str, name: str = "<host file>.toml") -> "SimulatedNvml":
        """Build from host-file text (TOML, or JSON when ``name`` ends in .json)."""
        return cls(parse_host_file(text, name))

    @classmethod
    def with_gpus(cls, count: int) -> "SimulatedNvml":
        """A node of ``count`` plain GPUs (``gpu_count = count``)."""
        return cls.from_text(f"gpu_count = {int(count)}", "<gpu_count>.toml")

    # ------------------------------------------------------------ steering

    def inject_xid(self, index: int, xid: int, gpu_instance: int | None = None) -> int:
        """Raise Xid ``xid`` on GPU ``index`` (on one MIG GPU instance of it when
        given); the number of event sets it reached."""
        return self._push(HealthEvent(index=index, kind="xid", code=xid, gpu_instance=gpu_instance))

    def inject_ecc(self, index: int, gpu_instance: int | None = None) -> int:
        """Raise a double-bit ECC error on GPU ``index``; the event sets it reached."""
        return self._push(HealthEvent(index=index, kind="ecc", gpu_instance=gpu_instance))

    def set_usage(self, index: int, **readings: int | None) -> None:
        """Change readings of GPU ``index`` (``memory_used_mib``, ``utilization_gpu``,
        ``utilization_memory``, ``power_mw``, ``temperature_c``)."""
        allowed = {"memory_used_mib", "utilization_gpu", "utilization_memory", "power_mw", "temperature_c"}
        unknown = set(readings) - allowed
        if unknown:
            raise ValueError(f"Unknown readings {sorted(unknown)}; expected some of {sorted(allowed)}")
        with self._lock:
            self._gpus[index] = msgspec.structs.replace(self._gpus[index], **readings)

    def fail(self, function: str, code: int | None) -> None:
        """Make NVML ``function`` (e.g. ``"nvmlDeviceGetMinorNumber"``) fail with
        ``code`` from now on; ``None`` heals it."""
        with self._lock:
            if code is None:
                self._failures.pop(function, None)
            else:
                self._failures[function] = code

    @property
    def live_event_sets(self) -> int:
        """Event sets created and not yet freed (a stop frees its set once no
        wait is in progress: tests wait for this to reach 0)."""
        with self._lock:
            return len(self._event_sets)

    def _push(self, event: HealthEvent) -> int:
        if not 0 <= event.index < len(self._gpus):
            raise ValueError(f"No GPU with index {event.index} on this node ({len(self._gpus)} GPUs)")
        bit = HEALTH_EVENT_TYPES[event.kind]
        reached = 0
        with self._lock:
            for event_set in self._event_sets:
                if event_set.registered.get(event.index, 0) & bit:
                    event_set.queue.append(event)
                    reached += 1
            self._lock.notify_all()
        return reached

    # ------------------------------------------------------------ the port

    def _check(self, function: str, initialized: bool = True) -> None:
        code = self._failures.get(function)
        if code is not None:
            raise NvmlError.of(function, code)
        if initialized and self._initialized <= 0:
            raise NvmlError.of(function, NVML_ERROR_UNINITIALIZED)

    def _gpu(self, function: str, handle: int) -> SimGpu:
        self._check(function)
        if not isinstance(handle, int) or not 0 <= handle < len(self._gpus):
            raise NvmlError.of(function, NVML_ERROR_INVALID_ARGUMENT, detail=f"no device handle {handle!r}")
        return self._gpus[handle]

    def _mig(self, function: str, handle: object) -> tuple[SimGpu, SimMigDevice]:
        self._check(function)
        if (
            isinstance(handle, tuple)
            and len(handle) == 2
            and 0 <= handle[0] < len(self._gpus)
            and 0 <= handle[1] < len(self._gpus[handle[0]].mig_devices)
        ):
            gpu = self._gpus[handle[0]]
            return gpu, gpu.mig_devices[handle[1]]
        raise NvmlError.of(function, NVML_ERROR_INVALID_ARGUMENT, detail=f"no MIG device handle {handle!r}")

    @staticmethod
    def _is_mig(handle: object) -> bool:
        return isinstance(handle, tuple)

    def _whole_gpu_only(self, function: str, handle: object) -> None:
        """Readings NVML gives for whole GPUs only: a MIG handle is NOT_SUPPORTED."""
        if self._is_mig(handle):
            self._mig(function, handle)
            raise NvmlError.of(function, NVML_ERROR_NOT_SUPPORTED, detail="a MIG device handle")

    def init(self) -> None:
        self._check("nvmlInitWithFlags", initialized=False)
        with self._lock:
            self._initialized += 1

    def shutdown(self) -> None:
        self._check("nvmlShutdown")
        with self._lock:
            self._initialized -= 1

    def driver_version(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.spec.driver_version

    def device_count(self) -> int:
        self._check("nvmlDeviceGetCount_v2")
        return len(self._gpus)

    def handle(self, index: int) -> int:
        function = "nvmlDeviceGetHandleByIndex_v2"
        self._check(function)
        if not 0 <= index < len(self._gpus):
            raise NvmlError.of(
                function, NVML_ERROR_INVALID_ARGUMENT, detail=f"no GPU with index {index} ({len(self._gpus)} GPUs)"
            )
        return index

    def minor(self, handle: int) -> int:
        return self._gpu("nvmlDeviceGetMinorNumber", handle).minor

    def uuid(self, handle: int | tuple[int, int]) -> str:
        if self._is_mig(handle):
            return self._mig("nvmlDeviceGetUUID", handle)[1].uuid
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def name(self, handle: int) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def pci_bus_id(self, handle: int) -> str:
        return self._gpu("nvmlDeviceGetPciInfo_v3", handle).pci_bus_id

    def memory(self, handle: int | tuple[int, int]) -> MemoryInfo:
        if self._is_mig(handle):
            mig = self._mig("nvmlDeviceGetMemoryInfo", handle)[1]
            return MemoryInfo(total=mig.memory_total_mib * _MIB, used=mig.memory_used_mib * _MIB)
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        return MemoryInfo(total=gpu.memory_total_mib * _MIB, used=gpu.memory_used_mib * _MIB)

    def utilization(self, handle: int) -> Utilization:
        self._whole_gpu_only("nvmlDeviceGetUtilizationRates", handle)
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        return Utilization(gpu=gpu.utilization_gpu, memory=gpu.utilization_memory)

    def power_mw(self, handle: int) -> int:
        self._whole_gpu_only("nvmlDeviceGetPowerUsage", handle)
        return self._optional_fact("nvmlDeviceGetPowerUsage", handle, "power_mw")

    def temperature_c(self, handle: int) -> int:
        self._whole_gpu_only("nvmlDeviceGetTemperature", handle)
        return self._optional_fact("nvmlDeviceGetTemperature", handle, "temperature_c")

    def numa_node(self, handle: int) -> int:
        return self._optional_fact("nvmlDeviceGetNumaNodeId", handle, "numa_node")

    def _optional_fact(self, function: str, handle: int, field: str) -> int:
        """A GPU's fact the host file may leave out: NOT_SUPPORTED then, as NVML says."""
        value = getattr(self._gpu(function, handle), field)
        if value is None:
            raise NvmlError.of(function, NVML_ERROR_NOT_SUPPORTED)
        return value

    def mig_mode(self, handle: int) -> bool:
        return self._gpu("nvmlDeviceGetMigMode", handle).mig

    def compute_mode(self, handle: int) -> int:
        self._gpu("nvmlDeviceGetComputeMode", handle)
        with self._lock:
            return self._compute_modes.get(handle, COMPUTE_MODE_DEFAULT)

    def set_compute_mode(self, handle: int, mode: int) -> None:
        function = "nvmlDeviceSetComputeMode"
        gpu = self._gpu(function, handle)
        if mode not in (COMPUTE_MODE_DEFAULT, COMPUTE_MODE_PROHIBITED, COMPUTE_MODE_EXCLUSIVE_PROCESS):
            raise NvmlError.of(function, NVML_ERROR_INVALID_ARGUMENT, detail=f"no compute mode {mode!r}")
        with self._lock:
            self._compute_modes[handle] = mode
            self.compute_mode_changes.append((gpu.uuid, mode))

    # ------------------------------------------------------------ MIG

    def max_mig_device_count(self, handle: int) -> int:
        function = "nvmlDeviceGetMaxMigDeviceCount"
        gpu = self._gpu(function, handle)
        if not gpu.mig:
            raise NvmlError.of(function, NVML_ERROR_NOT_SUPPORTED, detail="MIG mode is off")
        return MAX_MIG_DEVICES

    def mig_device_handle(self, handle: int, index: int) -> tuple[int, int]:
        function = "nvmlDeviceGetMigDeviceHandleByIndex"
        gpu = self._gpu(function, handle)
        if not gpu.mig:
            raise NvmlError.of(function, NVML_ERROR_NOT_SUPPORTED, detail="MIG mode is off")
        if not 0 <= index < MAX_MIG_DEVICES:
            raise NvmlError.of(function, NVML_ERROR_INVALID_ARGUMENT, detail=f"no MIG device slot {index}")
        if index >= len(gpu.mig_devices):
            raise NvmlError.of(function, NVML_ERROR_NOT_FOUND)
        return (handle, index)

    def gpu_instance_id(self, mig_handle: tuple[int, int]) -> int:
        return self._mig("nvmlDeviceGetGpuInstanceId", mig_handle)[1].gi

    def compute_instance_id(self, mig_handle: tuple[int, int]) -> int:
        return self._mig("nvmlDeviceGetComputeInstanceId", mig_handle)[1].ci

    def mig_parent_handle(self, mig_handle: tuple[int, int]) -> int:
        self._mig("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig_handle)
        return mig_handle[0]

    def mig_profile(self, mig_handle: tuple[int, int]) -> str:
        return self._mig("nvmlDeviceGetAttributes_v2", mig_handle)[1].profile

    def nvlink_remote_bus_ids(self, handle: int) -> list[str]:
        gpu = self._gpu("nvmlDeviceGetNvLinkState", handle)
        remote: list[str] = []
        for peer, links in gpu.nvlink.items():
            remote.extend([self._gpus[peer].pci_bus_id] * links)
        return remote

    def topology_level(self, first: int, second: int) -> int:
        function = "nvmlDeviceGetTopologyCommonAncestor"
        self._gpu(function, first)
        self._gpu(function, second)
        level = self.spec.topology_level(first, second)
        if level is None:
            raise NvmlError.of(function, NVML_ERROR_NOT_SUPPORTED)
        return level

    def control_devices(self) -> dict[str, str]:
        return dict(self.spec.control_devices)

    def event_set_create(self) -> "_EventSet":
        self._check("nvmlEventSetCreate")
        event_set = _EventSet()
        with self._lock:
            self._event_sets.append(event_set)
        return event_set

    def supported_event_types(self, handle: int) -> int:
        gpu = self._gpu("nvmlDeviceGetSupportedEventTypes", handle)
        mask = 0
        for kind in gpu.supported_events:
            mask |= HEALTH_EVENT_TYPES[kind]
        return mask

    def register_events(self, handle: int, types: int, event_set: "_EventSet") -> None:
        function = "nvmlDeviceRegisterEvents"
        self._gpu(function, handle)
        self._check_set(function, event_set)
        if types & ~self.supported_event_types(handle):
            raise NvmlError.of(function, NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            event_set.registered[handle] = event_set.registered.get(handle, 0) | types

    def event_set_wait(self, event_set: "_EventSet", timeout_s: float) -> HealthEvent | None:
        function = "nvmlEventSetWait_v2"
        self._check_set(function, event_set)
        with self._lock:
            if not event_set.queue and not event_set.interrupted:
                self._lock.wait_for(lambda: bool(event_set.queue) or event_set.interrupted,
                                    timeout=max(0.0, timeout_s))
            event_set.interrupted = False
            return event_set.queue.popleft() if event_set.queue else None

    def event_set_free(self, event_set: "_EventSet") -> None:
        function = "nvmlEventSetFree"
        self._check_set(function, event_set)
        with self._lock:
            self._event_sets.remove(event_set)

    def interrupt_wait(self, event_set: "_EventSet") -> None:
        with self._lock:
            event_set.interrupted = True
            self._lock.notify_all()

    def _check_set(self, function: str, event_set: object) -> None:
        self._check(function)
        with self._lock:
            if not any(event_set is live for live in self._event_sets):
                raise NvmlError.of(function, NVML_ERROR_INVALID_ARGUMENT, detail="not a live event set")


class _EventSet:
    """One simulated ``nvmlEventSet_t``: registrations and undelivered events."""

    __slots__ = ("registered", "queue", "interrupted")

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        """GPU index -> mask of registered ``EVENT_TYPE_*`` bits."""
        self.queue: collections.deque[HealthEvent] = collections.deque()
        self.interrupted = False
