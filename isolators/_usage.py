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
- ``UsageReader.read(units)`` answers from the readings of those units
  taken at most ``max_age`` seconds ago (``flags.nvidia_usage_max_age``, on
  the runtime ``Clock``) at once: no executor job, no NVML call (NVML's own
  utilisation is a sample of up to a second). When any of them is older
  (or was never read), it reads all of them again in one executor job
  (``NvmlService.usages``) and keeps what it read; ``max_age`` 0 reads
  every time. The statistics' ``timestamp`` is when the oldest reading
  used was asked for (wall-clock seconds). An NVML failure is an
  ``IsolatorError`` with NVML's text, and keeps nothing. A container
  holding nothing is answered at once by the isolator, with no job at all.
- The readings kept are one per unit of the node (they do not grow with
  containers), each answer a fresh copy.
- A part the isolator actor owns.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

from actors.mig import MigDevice, Unit
from runtime import Clock

from ._errors import as_isolator_error
from ._types import GpuStatistics, ResourceStatistics

__all__ = ["UsageReader"]

_copy = msgspec.structs.replace


class UsageReader:
    """NVML's readings of the units a container holds (see the module rules)."""

    def __init__(self, nvml: Any, inventory: Any, has_mig: bool, max_age: float = 0.0) -> None:
        self._nvml = nvml
        self._inventory = inventory
        self._has_mig = has_mig
        self.max_age = max_age
        self._kept: dict[Unit, tuple[float, float, GpuStatistics]] = {}
        """Per unit: when its reading was asked for (``Clock``, wall clock) and its statistics."""
        self.reads = 0
        """NVML reads made (executor jobs) so far."""

    def read(self, units: Iterable[Unit]) -> Any:
        """The statistics of a container holding ``units``: a
        ``ResourceStatistics`` when recent readings answer (or it holds
        nothing: no NVML job), else an awaitable of one."""
        units = sorted(units)
        if not units:
            return ResourceStatistics(timestamp=time.time(), gpus_allocated=0)
        kept = self._kept
        if self.max_age > 0:
            oldest = Clock.now() - self.max_age
            found = [kept.get(unit) for unit in units]
            if all(entry is not None and entry[0] >= oldest for entry in found):
                return ResourceStatistics(timestamp=min(entry[1] for entry in found),  # type: ignore[index]
                                          gpus_allocated=len(units),
                                          gpus=[_copy(entry[2]) for entry in found])  # type: ignore[index]
        return self._read_now(units)

    async def _read_now(self, units: list[Unit]) -> ResourceStatistics:
        asked, wall = Clock.now(), time.time()
        self.reads += 1
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
                stat = _mig_statistics(unit, by_mig.get(unit), r)
            else:
                info = by_gpu.get(unit)
                stat = GpuStatistics(minor=unit.minor, uuid=info.uuid if info is not None else None, **_readings(r))
            self._kept[unit] = (asked, wall, stat)
            stats.append(_copy(stat))
        return ResourceStatistics(timestamp=wall, gpus_allocated=len(units), gpus=stats)


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
