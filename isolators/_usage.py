"""Usage (R-IS-5): what NVML says of the GPUs and MIG devices a container holds.

Rules:
- ``usage(id)``: nested ids -> "Not supported for nested containers";
  unknown ids -> "Unknown container". Mesos returns nothing here; this port
  reports, per unit held, NVML memory used/total, utilisation, power and
  temperature where NVML has them (None where it has no answer); a MIG
  device is read on its MIG handle and named by profile and instances.
- Answered at once when no call on the container is in flight (nor a
  recovery); otherwise in arrival order, behind them (the isolator's
  ``Ordering``).
- ``UsageReader.read(units)``: one executor job per usage
  (``NvmlService.usages``); an NVML failure is an ``IsolatorError`` with
  NVML's text. A container holding nothing is answered at once by the
  isolator, with no job at all.
- A part the isolator actor owns.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from actors.mig import MigDevice, Unit

from ._errors import as_isolator_error
from ._types import GpuStatistics, ResourceStatistics

__all__ = ["UsageReader"]


class UsageReader:
    """NVML's readings of the units a container holds (see the module rules)."""

    def __init__(self, nvml: Any, inventory: Any, has_mig: bool) -> None:
        self._nvml = nvml
        self._inventory = inventory
        self._has_mig = has_mig

    async def read(self, units: Iterable[Unit]) -> ResourceStatistics:
        """The statistics of a container holding ``units`` (at least one)."""
        units = sorted(units)
        try:
            readings = await self._nvml.usages(units)
        except Exception as error:
            raise as_isolator_error(error) from error
        by_gpu = self._inventory.by_gpu()
        by_mig = self._inventory.by_mig() if self._has_mig else {}
        stats = []
        for unit in units:
            r = readings.get(unit)
            if isinstance(unit, MigDevice):
                stats.append(_mig_statistics(unit, by_mig.get(unit), r))
                continue
            info = by_gpu.get(unit)
            stats.append(GpuStatistics(minor=unit.minor, uuid=info.uuid if info is not None else None,
                                       **_readings(r)))
        return ResourceStatistics(timestamp=time.time(), gpus_allocated=len(units), gpus=stats)


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
