"""Usage (R-IS-5): what NVML says of the GPUs and MIG devices a container holds.

Rules:
- ``usage(id)``: nested ids -> "Not supported for nested containers";
  unknown ids -> "Unknown container". Mesos returns nothing here; this port
  reports, per unit held, NVML memory used/total, utilisation, power and
  temperature where NVML has them (None where it has no answer); a MIG
  device is read on its MIG handle and named by profile and instances.
- Answered at once when no call on the container is in flight (nor a
  recovery); otherwise in arrival order, behind them.
- One executor job per usage (``NvmlService.usages``); an NVML failure is an
  ``IsolatorError`` with NVML's text.
- Mixed into the isolator actor (``NvidiaGpuIsolatorProcess``).
"""

from __future__ import annotations

import time
from typing import Any

from actors import Gpu
from actors.mig import MigDevice

from ._errors import IsolatorError, as_isolator_error
from ._types import ContainerID, GpuStatistics, ResourceStatistics, check_container_id


class UsageReport:
    """The isolator actor's ``usage`` verb (see the module rules)."""

    infos: dict
    nvml: Any
    inventory: Any
    _mig: bool
    _recovering: Any
    _in_order: Any
    _in_flight: Any
    _units_of: Any

    def usage(self, container_id: ContainerID) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        if self._in_flight(container_id) or self._recovering is not None:  # answer in arrival order
            return self._in_order(container_id, self._usage_in_order, container_id)
        return self._usage_now(container_id)

    async def _usage_in_order(self, container_id: ContainerID) -> ResourceStatistics:
        result = self._usage_now(container_id)
        return result if isinstance(result, ResourceStatistics) else await result

    def _usage_now(self, container_id: ContainerID) -> Any:
        if container_id not in self.infos:
            raise IsolatorError("Unknown container")
        gpus = sorted(self._units_of(container_id))
        if not gpus:
            return ResourceStatistics(timestamp=time.time(), gpus_allocated=0)
        return self._usage(gpus)

    async def _usage(self, gpus: list[Gpu]) -> ResourceStatistics:
        try:
            readings = await self.nvml.usages(gpus)
        except Exception as error:
            raise as_isolator_error(error) from error
        by_gpu = self.inventory.by_gpu()
        by_mig = self.inventory.by_mig() if self._mig else {}
        stats = []
        for gpu in gpus:
            r = readings.get(gpu)
            if isinstance(gpu, MigDevice):
                stats.append(_mig_statistics(gpu, by_mig.get(gpu), r))
                continue
            info = by_gpu.get(gpu)
            stats.append(GpuStatistics(minor=gpu.minor, uuid=info.uuid if info is not None else None,
                                       **_readings(r)))
        return ResourceStatistics(timestamp=time.time(), gpus_allocated=len(gpus), gpus=stats)


def _mig_statistics(device: MigDevice, info: Any, reading: Any) -> GpuStatistics:
    """NVML's view of one MIG device a container holds (on its MIG handle)."""
    return GpuStatistics(
        minor=device.parent.minor,
        uuid=info.uuid if info is not None else None,
        mig_profile=info.profile if info is not None else None,
        gpu_instance_id=device.gi,
        compute_instance_id=device.ci,
        **_readings(reading),
    )


def _readings(reading: Any) -> dict[str, int | None]:
    """A reading's fields as ``GpuStatistics`` names them (None without a reading)."""
    return {
        "memory_used_bytes": reading.memory_used_bytes if reading else None,
        "memory_total_bytes": reading.memory_total_bytes if reading else None,
        "utilization_gpu_percent": reading.utilization_gpu_percent if reading else None,
        "utilization_memory_percent": reading.utilization_memory_percent if reading else None,
        "power_milliwatts": reading.power_mw if reading else None,
        "temperature_celsius": reading.temperature_c if reading else None,
    }
