"""HealthMonitorProcess: NVML health events, handed to the allocator (R-HE-1..3).

Rules:
- One monitor per allocator on a node whose NVML can raise events, started
  by ``NvidiaGpuAllocator.create`` (so with the components, not at the first
  ``watch()``) after the GPUs were registered (``start_health_events``).
- It waits on the event set with ``NvmlService.wait_health_event`` (one
  ``nvmlEventSetWait_v2`` of ``wait_s`` seconds at a time, on a thread of
  its own; the event loop never blocks) and hands each event to the
  allocator actor (``GpuAllocatorProcess.health_event``), in the order NVML
  gave them. A timeout just waits again.
- A wait that fails otherwise is logged and retried after a backoff on the
  runtime Clock (``backoff_s``, ``Flags.nvidia_health_backoff``, doubling
  up to ``max_backoff_s``). The
  ``unknown_after``-th failure in a row marks every GPU unhealthy
  (``GpuAllocatorProcess.health_unknown``: the node's health is unknown);
  they come back only through ``mark_healthy``. A successful wait resets
  the count (logged).
- Terminating it stops waiting at once; the wait in progress ends in its
  thread (NVML's own timeout) and ``NvmlService.stop_health_events`` frees
  the set after it.
"""

from __future__ import annotations

import logging

from runtime import PID, Process, Timer, delay, dispatch, generate_id

from actors.nvml import NvmlService

from ._process import GpuAllocatorProcess

__all__ = ["HealthMonitorProcess"]

logger = logging.getLogger(__name__)


class HealthMonitorProcess(Process):
    """Feeds NVML health events to an allocator (see module rules)."""

    def __init__(
        self,
        nvml: NvmlService,
        allocator: PID,
        *,
        wait_s: float = 5.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        unknown_after: int = 5,
    ) -> None:
        super().__init__(generate_id("gpu-health"))
        self.nvml = nvml
        self.allocator = allocator
        self.wait_s = wait_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.unknown_after = unknown_after
        self.failures = 0
        """Failed waits in a row."""
        self.events = 0
        """Events handed to the allocator."""
        self._timer: Timer | None = None

    def initialize(self) -> None:
        dispatch(self.pid, HealthMonitorProcess._wait)

    def finalize(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait(self) -> None:
        self._timer = None
        try:
            event = await self.nvml.wait_health_event(self.wait_s)
        except Exception as exc:  # noqa: BLE001 - any failure: log, back off, retry
            self._failed(exc)
            return
        if self.failures:
            logger.warning("NVML health events are received again after %d failed waits", self.failures)
            self.failures = 0
        if event is not None:
            self.events += 1
            dispatch(self.allocator, GpuAllocatorProcess.health_event, event)
        dispatch(self.pid, HealthMonitorProcess._wait)

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))
        logger.warning("Waiting for NVML health events failed (%d in a row): %s; retrying in %gs",
                       self.failures, error, backoff)
        if self.failures == self.unknown_after:
            dispatch(self.allocator, GpuAllocatorProcess.health_unknown,
                     f"node health unknown: waiting for NVML health events failed {self.failures}"
                     f" times in a row: {error}")
        self._timer = delay(backoff, self.pid, HealthMonitorProcess._wait)

