"""The allocator's metrics: how many GPUs (and MIG devices) are free, allocated, unhealthy.

Rules:
- ``publish(process)`` registers them in the current runtime (the
  allocator's ``initialize``); ``close()`` of the ``runtime.MetricSet`` it
  returns gives them back (its ``finalize``). Fixed names, summed over the
  allocators of the runtime (see ``runtime._metrics``).
- All pulled: each reads the allocator's sets when a snapshot is taken;
  allocating costs nothing more.
- For whole GPUs (``allocator/gpus_*``) and MIG devices
  (``allocator/mig_devices_*``, 0 on a node without MIG): ``_total``
  managed, ``_free`` allocatable now (not allocated, healthy),
  ``_allocated`` held by containers (healthy or not), ``_unhealthy``
  withheld as unhealthy (allocated or not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.gpu import Gpu
from runtime import MetricSet, current_runtime

if TYPE_CHECKING:
    from ._process import GpuAllocatorProcess

__all__ = ["publish"]

_KINDS = (("gpus", "whole GPUs"), ("mig_devices", "MIG devices"))


def publish(process: "GpuAllocatorProcess") -> MetricSet:
    """Register ``process``'s gauges (see the module rules)."""
    whole = frozenset(unit for unit in process.total if isinstance(unit, Gpu))
    metrics = MetricSet(current_runtime().metrics)
    for (kind, what), units in zip(_KINDS, (whole, process.total - whole)):
        metrics.gauge(f"allocator/{kind}_total", lambda units=units: len(units), f"{what} this allocator manages")
        metrics.gauge(f"allocator/{kind}_free", lambda units=units: len(units & process.available()),
                      f"{what} allocatable now (not allocated, healthy)")
        metrics.gauge(f"allocator/{kind}_allocated", lambda units=units: len(units & process.allocated),
                      f"{what} held by containers")
        metrics.gauge(f"allocator/{kind}_unhealthy", lambda units=units: len(units & process.unhealthy.keys()),
                      f"{what} withheld as unhealthy (allocated or not)")
    return metrics
