"""The allocator's metrics: how many GPUs (and MIG devices) are free, allocated, unhealthy.

Rules:
- ``publish(process)`` registers them in the current runtime (the
  allocator's ``initialize``); ``close()`` of the ``runtime.MetricSet`` it
  returns gives them back (its ``finalize``). Fixed names, summed over the
  allocators of the runtime (see ``runtime._metrics``).
- All pulled: each reads the allocator's sets when a snapshot is taken;
  allocating costs nothing more.
- ``publish_ledger(process)`` (an allocator that joined a node ledger,
  SPEC R-NL-5): ``ledger/conflicts``, ``ledger/leases``,
  ``ledger/held_elsewhere`` and ``ledger/failing_jobs``, pulled from its
  link, given back at finalize.
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


def publish_ledger(process: "GpuAllocatorProcess") -> MetricSet:
    """The node ledger's metrics of an allocator that joined one (SPEC R-NL-5):
    ``ledger/conflicts`` (grants refused because another owner of the node held
    a unit), ``ledger/leases`` (units this owner leases now) and
    ``ledger/held_elsewhere`` (managed units other owners hold) and
    ``ledger/failing_jobs`` (ledger jobs failed in a row: 0 once one works).
    All pulled."""
    metrics = MetricSet(current_runtime().metrics)
    link = process.ledger_link
    metrics.counter("ledger/conflicts", "grants refused because another front door of the node held a unit",
                    read=lambda: link.conflicts if link is not None else 0)
    metrics.gauge("ledger/leases", lambda: len(link.ours) if link is not None else 0,
                  "units this front door leases in the node ledger")
    metrics.gauge("ledger/held_elsewhere", lambda: len(link.elsewhere) if link is not None else 0,
                  "units other front doors of the node hold")
    metrics.gauge("ledger/failing_jobs", lambda: link.failures if link is not None else 0,
                  "node ledger jobs failed in a row (0 once one works again)")
    return metrics
