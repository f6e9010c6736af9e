"""BindingsNvml: the NVML port over the real bindings (the ``pynvml`` module).

Rules:
- ``pynvml`` comes from the ``nvidia-ml-py`` distribution; it loads
  ``libnvidia-ml.so.1`` with ``ctypes.CDLL`` on the first ``nvmlInit`` (a
  library already loaded under that soname is reused, which is how the
  tests' fake NVML stands in for the driver).
- Every ``pynvml.NVMLError`` becomes an ``NvmlError`` naming the C function;
  a missing library or driver becomes ``NvmlUnavailable``.
- Handles are pynvml's ``c_nvmlDevice_t``; they are cached per index.
- NVLink: links ``0..NVML_NVLINK_MAX_LINKS-1`` are probed with
  ``nvmlDeviceGetNvLinkState``; a link NVML does not know (invalid
  argument / not supported / not found) ends or skips the probe; the remote
  end of every active link comes from ``nvmlDeviceGetNvLinkRemotePciInfo_v2``.
- MIG: handles of MIG devices are pynvml's ``c_nvmlDevice_t`` too (never
  cached). A MIG device's profile name is the driver's own name of its GPU
  instance profile (``nvmlDeviceGetGpuInstanceById`` →
  ``nvmlGpuInstanceGetInfo`` → the ``nvmlDeviceGetGpuInstanceProfileInfoV``
  whose id matches; ``MIG 1g.18gb`` → ``1g.18gb``), prefixed ``<C>c.``
  when ``nvmlDeviceGetAttributes_v2`` says the compute instance has fewer
  slices; a driver that cannot name it (an older one, or no permission)
  falls back to NVIDIA's rounding from the attributes and the parent's
  memory (``actors.mig.profile_from_attributes``).
- Health events are NVML's own calls, one port method each (the caller
  decides what to register, see ``_health``); an event's device handle is
  mapped back to its index through the handles already given out
  (``nvmlDeviceGetIndex`` otherwise).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable, TypeVar

from actors.mig import profile_from_attributes

from ._errors import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NvmlError,
)
from ._port import EVENT_TYPE_DOUBLE_BIT_ECC, HealthEvent, MemoryInfo, Nvml, Utilization

__all__ = ["BindingsNvml"]

logger = logging.getLogger(__name__)

_NO_INSTANCE = 0xFFFFFFFF
"""``gpuInstanceId`` of an event about the whole GPU (not one MIG instance)."""

T = TypeVar("T")


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise NvmlError.of(
            "nvmlInit",
            NVML_ERROR_LIBRARY_NOT_FOUND,
            detail=f"the NVML bindings are not installed (pip install nvidia-ml-py): {exc}",
        ) from None
    return pynvml


class BindingsNvml(Nvml):
    """The real NVML through ``pynvml`` (see module rules)."""

    kind = "nvml"
    source = "libnvidia-ml.so.1"

    def __init__(self) -> None:
        self._nvml = _import_pynvml()
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _call(self, function: str, call: Callable[..., T], *args: Any) -> T:
        try:
            return call(*args)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            code = int(code) if code is not None else 999
            try:
                text = str(exc)
            except Exception:  # noqa: BLE001 - str() itself calls into NVML
                text = None
            raise NvmlError.of(function, code, text) from None

    # ------------------------------------------------------------ the port

    def init(self) -> None:
        self._call("nvmlInit", self._nvml.nvmlInit)

    def shutdown(self) -> None:
        with self._lock:
            self._handles.clear()
        self._call("nvmlShutdown", self._nvml.nvmlShutdown)

    def driver_version(self) -> str:
        return self._call("nvmlSystemGetDriverVersion", self._nvml.nvmlSystemGetDriverVersion)

    def device_count(self) -> int:
        return self._call("nvmlDeviceGetCount_v2", self._nvml.nvmlDeviceGetCount)

    def handle(self, index: int) -> Any:
        with self._lock:
            handle = self._handles.get(index)
        if handle is None:
            handle = self._call(
                "nvmlDeviceGetHandleByIndex_v2", self._nvml.nvmlDeviceGetHandleByIndex, index
            )
            with self._lock:
                self._handles[index] = handle
        return handle

    def minor(self, handle: Any) -> int:
        return self._call("nvmlDeviceGetMinorNumber", self._nvml.nvmlDeviceGetMinorNumber, handle)

    def uuid(self, handle: Any) -> str:
        return self._call("nvmlDeviceGetUUID", self._nvml.nvmlDeviceGetUUID, handle)

    def name(self, handle: Any) -> str:
        return self._call("nvmlDeviceGetName", self._nvml.nvmlDeviceGetName, handle)

    def pci_bus_id(self, handle: Any) -> str:
        info = self._call("nvmlDeviceGetPciInfo_v3", self._nvml.nvmlDeviceGetPciInfo, handle)
        return _text(info.busId)

    def memory(self, handle: Any) -> MemoryInfo:
        info = self._call("nvmlDeviceGetMemoryInfo", self._nvml.nvmlDeviceGetMemoryInfo, handle)
        return MemoryInfo(total=int(info.total), used=int(info.used))

    def utilization(self, handle: Any) -> Utilization:
        rates = self._call(
            "nvmlDeviceGetUtilizationRates", self._nvml.nvmlDeviceGetUtilizationRates, handle
        )
        return Utilization(gpu=int(rates.gpu), memory=int(rates.memory))

    def power_mw(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage", self._nvml.nvmlDeviceGetPowerUsage, handle))

    def temperature_c(self, handle: Any) -> int:
        return int(
            self._call(
                "nvmlDeviceGetTemperature",
                self._nvml.nvmlDeviceGetTemperature,
                handle,
                self._nvml.NVML_TEMPERATURE_GPU,
            )
        )

    def numa_node(self, handle: Any) -> int:
        if not hasattr(self._nvml, "nvmlDeviceGetNumaNodeId"):
            raise NvmlError.of("nvmlDeviceGetNumaNodeId", NVML_ERROR_NOT_SUPPORTED)
        try:
            node = self._call("nvmlDeviceGetNumaNodeId", self._nvml.nvmlDeviceGetNumaNodeId, handle)
        except NvmlError as exc:
            if exc.code == NVML_ERROR_FUNCTION_NOT_FOUND:  # an older driver
                raise NvmlError.of("nvmlDeviceGetNumaNodeId", NVML_ERROR_NOT_SUPPORTED) from None
            raise
        if node < 0:
            raise NvmlError.of("nvmlDeviceGetNumaNodeId", NVML_ERROR_NOT_SUPPORTED)
        return int(node)

    def mig_mode(self, handle: Any) -> bool:
        current, _pending = self._call("nvmlDeviceGetMigMode", self._nvml.nvmlDeviceGetMigMode, handle)
        return bool(current)

    def compute_mode(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetComputeMode", self._nvml.nvmlDeviceGetComputeMode, handle))

    def set_compute_mode(self, handle: Any, mode: int) -> None:
        self._call("nvmlDeviceSetComputeMode", self._nvml.nvmlDeviceSetComputeMode, handle, int(mode))

    # ------------------------------------------------------------ MIG

    def max_mig_device_count(self, handle: Any) -> int:
        return int(
            self._call("nvmlDeviceGetMaxMigDeviceCount", self._nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        )

    def mig_device_handle(self, handle: Any, index: int) -> Any:
        return self._call(
            "nvmlDeviceGetMigDeviceHandleByIndex", self._nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, index
        )

    def gpu_instance_id(self, mig_handle: Any) -> int:
        return int(self._call("nvmlDeviceGetGpuInstanceId", self._nvml.nvmlDeviceGetGpuInstanceId, mig_handle))

    def compute_instance_id(self, mig_handle: Any) -> int:
        return int(
            self._call("nvmlDeviceGetComputeInstanceId", self._nvml.nvmlDeviceGetComputeInstanceId, mig_handle)
        )

    def mig_parent_handle(self, mig_handle: Any) -> Any:
        return self._call(
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
            self._nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
            mig_handle,
        )

    def mig_profile(self, mig_handle: Any) -> str:
        parent = self.mig_parent_handle(mig_handle)
        get_attributes = getattr(self._nvml, "nvmlDeviceGetAttributes_v2", None) or self._nvml.nvmlDeviceGetAttributes
        attributes = self._call("nvmlDeviceGetAttributes_v2", get_attributes, mig_handle)
        gpu_slices = int(attributes.gpuInstanceSliceCount)
        compute_slices = int(attributes.computeInstanceSliceCount)
        name = self._gpu_instance_profile_name(parent, self.gpu_instance_id(mig_handle))
        if name is None:
            return profile_from_attributes(
                gpu_slices, compute_slices, int(attributes.memorySizeMB), self.memory(parent).total
            )
        return name if compute_slices >= gpu_slices else f"{compute_slices}c.{name}"

    def _gpu_instance_profile_name(self, parent: Any, gi: int) -> str | None:
        """The driver's name of the profile of GPU instance ``gi`` (None: it cannot tell)."""
        nvml = self._nvml
        try:
            instance = self._call("nvmlDeviceGetGpuInstanceById", nvml.nvmlDeviceGetGpuInstanceById, parent, gi)
            profile_id = int(self._call("nvmlGpuInstanceGetInfo", nvml.nvmlGpuInstanceGetInfo, instance).profileId)
            for profile in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12))):
                try:
                    info = self._call(
                        "nvmlDeviceGetGpuInstanceProfileInfoV",
                        nvml.nvmlDeviceGetGpuInstanceProfileInfo,
                        parent,
                        profile,
                        2,
                    )
                except NvmlError as exc:
                    if exc.code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                        continue  # a profile this GPU does not have
                    raise
                if int(info.id) == profile_id:
                    name = _text(info.name).strip()
                    name = name[4:] if name.startswith("MIG ") else name
                    return name or None
        except NvmlError as exc:
            if exc.code in _CANNOT_NAME_PROFILE:
                return None
            raise
        return None

    def nvlink_remote_bus_ids(self, handle: Any) -> list[str]:
        remote: list[str] = []
        for link in range(int(getattr(self._nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                active = self._call("nvmlDeviceGetNvLinkState", self._nvml.nvmlDeviceGetNvLinkState, handle, link)
            except NvmlError as exc:
                if exc.code in (NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_FOUND):
                    if exc.code == NVML_ERROR_NOT_SUPPORTED and link == 0:
                        return remote  # no NVLink on this GPU
                    continue
                raise
            if not active:
                continue
            info = self._call(
                "nvmlDeviceGetNvLinkRemotePciInfo_v2", self._nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link
            )
            remote.append(_text(info.busId))
        return remote

    def topology_level(self, first: Any, second: Any) -> int:
        return int(
            self._call(
                "nvmlDeviceGetTopologyCommonAncestor",
                self._nvml.nvmlDeviceGetTopologyCommonAncestor,
                first,
                second,
            )
        )

    def control_devices(self) -> dict[str, str]:
        return {}

    # ------------------------------------------------------------ health

    def event_set_create(self) -> Any:
        return self._call("nvmlEventSetCreate", self._nvml.nvmlEventSetCreate)

    def supported_event_types(self, handle: Any) -> int:
        return int(
            self._call(
                "nvmlDeviceGetSupportedEventTypes", self._nvml.nvmlDeviceGetSupportedEventTypes, handle
            )
        )

    def register_events(self, handle: Any, types: int, event_set: Any) -> None:
        self._call("nvmlDeviceRegisterEvents", self._nvml.nvmlDeviceRegisterEvents, handle, types, event_set)

    def event_set_wait(self, event_set: Any, timeout_s: float) -> HealthEvent | None:
        try:
            data = self._call(
                "nvmlEventSetWait_v2", self._nvml.nvmlEventSetWait_v2, event_set, max(0, int(timeout_s * 1000))
            )
        except NvmlError as exc:
            if exc.code == NVML_ERROR_TIMEOUT:
                return None
            raise
        index = self._index_of(data.device)
        instance = int(data.gpuInstanceId)
        gpu_instance = None if instance == _NO_INSTANCE else instance
        if int(data.eventType) & EVENT_TYPE_DOUBLE_BIT_ECC:
            return HealthEvent(index=index, kind="ecc", gpu_instance=gpu_instance)
        return HealthEvent(index=index, kind="xid", code=int(data.eventData), gpu_instance=gpu_instance)

    def event_set_free(self, event_set: Any) -> None:
        self._call("nvmlEventSetFree", self._nvml.nvmlEventSetFree, event_set)

    def _index_of(self, device: Any) -> int:
        """The NVML index of an event's device handle (-1 if NVML cannot say)."""
        address = ctypes.cast(device, ctypes.c_void_p).value
        with self._lock:
            for index, handle in self._handles.items():
                if ctypes.cast(handle, ctypes.c_void_p).value == address:
                    return index
        try:
            return int(self._call("nvmlDeviceGetIndex", self._nvml.nvmlDeviceGetIndex, device))
        except NvmlError:
            return -1


_CANNOT_NAME_PROFILE = frozenset(
    {
        NVML_ERROR_NOT_SUPPORTED,
        NVML_ERROR_FUNCTION_NOT_FOUND,
        NVML_ERROR_NO_PERMISSION,
        NVML_ERROR_NOT_FOUND,
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    }
)
"""An older driver, or an unprivileged caller: name the profile from the attributes."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
