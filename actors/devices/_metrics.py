"""Device control's metrics: operations, batches, device worker restarts.

Rules:
- ``publish(process)`` registers them in the current runtime (the device
  control actor's ``initialize``); ``close()`` of the ``runtime.MetricSet``
  it returns gives them back (its ``finalize``). Fixed names, summed over
  the device control actors of the runtime (see ``runtime._metrics``).
- All pulled from counts the actor and its driver keep anyway, read when a
  snapshot is taken: nothing is added to the operation path.
- ``devices/operations``: operations submitted (configure, reconfigure,
  remove, state, exists, list, reconcile, ...); ``devices/batches``:
  batches handed to the backend (one executor job, or one frame to the
  device worker process, each carrying one or more operations; in memory,
  one per operation); ``devices/worker_restarts``: device worker processes
  started after the first (0 without a worker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import MetricSet, current_runtime

if TYPE_CHECKING:
    from ._control import DeviceControlProcess

__all__ = ["publish"]


def publish(process: "DeviceControlProcess") -> MetricSet:
    """Register ``process``'s metrics (see the module rules)."""
    metrics = MetricSet(current_runtime().metrics)
    metrics.counter("devices/operations", "device control operations submitted", read=lambda: process.operations)
    metrics.counter("devices/batches", "batches handed to the device backend (executor jobs or worker frames)",
                    read=lambda: process.driver.batches)
    metrics.counter("devices/worker_restarts", "device worker processes started after the first",
                    read=lambda: max(getattr(process.driver, "starts", 1) - 1, 0))
    return metrics
