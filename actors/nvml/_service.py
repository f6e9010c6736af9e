"""NvmlService: the NVML port as actors use it, off the event loop.

Rules:
- Every NVML call runs on a ``runtime.Executor`` (R-NV-2): one executor job
  per question (``inventory()`` reads a whole node in one job, ``usages()``
  reads several GPUs — and MIG devices, on their MIG handles — in one job). Nothing here blocks the loop.
- ``inventory()`` is read once and cached (a node's GPUs do not change while
  the agent runs); ``inventory(refresh=True)`` reads it again.
- Health events (R-HE-1): ``start_health_events(indices)`` creates the
  event set and registers the GPUs (``register_health_events``) in one
  job; ``wait_health_event(timeout_s)`` waits on it on a thread of its own
  (a single-thread *background* executor: a health wait never delays
  inventory or usage calls, and ``Clock.settle()`` does not wait for it);
  ``stop_health_events()`` ends them without waiting: it interrupts a wait
  where the port can (NVML's own wait cannot be cut short) and the set is
  freed once no wait is in progress -- at once, or by the waiting thread
  when its wait returns. A wait after the stop fails with ``NvmlError``.
- ``NvmlService.open(host_file)`` opens the port in the executor
  (``open_nvml``: the host file's simulated node, or the real NVML when
  None; never a made-up node).
- ``close()`` stops health events, shuts NVML down (once; after the wait in
  progress, if any, again by the waiting thread) and stops the executors
  this service created. It never waits out an NVML event wait.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any, Callable, TypeVar

from runtime import Executor

from actors.gpu import Gpu, GpuInfo
from actors.mig import MigDevice

from ._errors import NVML_ERROR_UNINITIALIZED, NvmlError
from ._health import HealthRegistration, register_health_events
from ._inventory import GpuUsage, MigDeviceUsage, NodeInventory, read_inventory, read_mig_usage, read_usage
from ._open import open_nvml
from ._port import EventSet, HealthEvent, Nvml

__all__ = ["NvmlService"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class NvmlService:
    """Async access to an ``Nvml`` port through an Executor (see module rules)."""

    def __init__(self, nvml: Nvml, executor: Executor | None = None) -> None:
        self.nvml = nvml
        self._owns_executor = executor is None
        self.executor = executor if executor is not None else Executor(max_workers=2, name="nvml")
        self._event_executor: Executor | None = None
        self._event_set: EventSet | None = None
        self._event_lock = threading.Lock()
        """Guards the three fields below (never held during an NVML wait)."""
        self._waiting = False
        self._after_wait: list[Callable[[], None]] = []
        """What a stop or close left for the waiting thread to do when its wait returns."""
        self._inventory: NodeInventory | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        host_file: str | os.PathLike[str] | None,
        executor: Executor | None = None,
    ) -> "NvmlService":
        """Open (and init) the port for ``host_file`` in the executor."""
        runner = executor if executor is not None else Executor(max_workers=2, name="nvml")
        try:
            nvml = await runner.run(open_nvml, host_file)
        except BaseException:
            if executor is None:
                runner.shutdown(wait=False)
            raise
        service = cls(nvml, runner)
        service._owns_executor = executor is None
        return service

    @property
    def kind(self) -> str:
        """``"nvml"`` or ``"simulated"``."""
        return self.nvml.kind

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run any blocking ``fn(*args)`` (e.g. a port method) in the executor."""
        return await self.executor.run(fn, *args)

    async def inventory(self, refresh: bool = False) -> NodeInventory:
        """The node's GPUs and topology (cached after the first read)."""
        if self._inventory is None or refresh:
            self._inventory = await self.executor.run(read_inventory, self.nvml)
        return self._inventory

    async def gpus(self) -> list[GpuInfo]:
        """Every GPU of the node, by NVML index."""
        return list((await self.inventory()).gpus)

    async def count(self) -> int:
        return await self.executor.run(self.nvml.device_count)

    async def usage(self, gpu: Gpu) -> GpuUsage:
        """Current readings of one GPU (KeyError if the node has no such GPU)."""
        return (await self.usages([gpu]))[gpu]

    async def usages(self, gpus: Iterable[Gpu | MigDevice]) -> dict[Any, GpuUsage | MigDeviceUsage]:
        """Current readings of several GPUs (and MIG devices), in one executor job."""
        inventory = await self.inventory()
        by_gpu = inventory.by_gpu()
        targets = []
        migs = []
        for gpu in sorted(set(gpus)):
            if isinstance(gpu, MigDevice):
                mig = inventory.by_mig().get(gpu)
                if mig is None:
                    raise KeyError(f"MIG device {gpu} is not on this node")
                migs.append((mig.parent_index, mig.index, gpu))
                continue
            info = by_gpu.get(gpu)
            if info is None:
                raise KeyError(f"GPU {gpu} is not on this node")
            targets.append((info.index, gpu))
        if not targets and not migs:
            return {}
        if not migs:
            readings = await self.executor.run(read_usage, self.nvml, targets)
            return {usage.gpu: usage for usage in readings}
        whole, parts = await self.executor.run(_read_units, self.nvml, targets, migs)
        return {**{usage.gpu: usage for usage in whole}, **{usage.device: usage for usage in parts}}

    # ------------------------------------------------------------ health events

    @property
    def health_events_started(self) -> bool:
        return self._event_set is not None

    async def start_health_events(self, indices: Iterable[int]) -> HealthRegistration:
        """Create the event set and register the GPUs at ``indices`` (one job)."""
        if self._event_set is not None:
            raise RuntimeError("health events are already started on this NVML service")
        wanted = list(indices)

        def start() -> tuple[EventSet, HealthRegistration]:
            event_set = self.nvml.event_set_create()
            try:
                return event_set, register_health_events(self.nvml, event_set, wanted)
            except BaseException:
                self.nvml.event_set_free(event_set)
                raise

        self._event_set, registration = await self.executor.run(start)
        return registration

    def _wait(self, event_set: EventSet, timeout_s: float) -> HealthEvent | None:
        with self._event_lock:
            if self._event_set is not event_set:
                raise NvmlError.of("nvmlEventSetWait_v2", NVML_ERROR_UNINITIALIZED,
                                   detail="health events were stopped")
            self._waiting = True
        try:
            return self.nvml.event_set_wait(event_set, timeout_s)
        finally:
            with self._event_lock:
                self._waiting = False
                left, self._after_wait = self._after_wait, []
            for action in left:
                action()

    def _after_waiting(self, action: Callable[[], None]) -> bool:
        """Leave ``action`` to the waiting thread; False when none waits (run it yourself)."""
        with self._event_lock:
            if self._waiting:
                self._after_wait.append(action)
                return True
        return False

    async def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        """The next health event within ``timeout_s`` seconds, or None (see rules)."""
        event_set = self._event_set
        if event_set is None:
            raise NvmlError.of("nvmlEventSetWait_v2", NVML_ERROR_UNINITIALIZED,
                               detail="health events are not started")
        if self._event_executor is None:
            self._event_executor = Executor(max_workers=1, name="nvml-events", background=True)
        return await self._event_executor.run(self._wait, event_set, timeout_s)

    async def stop_health_events(self) -> None:
        """Stop health events: later waits fail; the set is freed once no wait
        is in progress (see the module rules; idempotent, never blocks)."""
        with self._event_lock:
            event_set, self._event_set = self._event_set, None
        if event_set is None:
            return

        def free() -> None:
            try:
                self.nvml.event_set_free(event_set)
            except NvmlError as exc:
                logger.warning("Freeing the NVML event set failed: %s", exc)

        if not self._after_waiting(free):
            await self.executor.run(free)
        self.nvml.interrupt_wait(event_set)
        events, self._event_executor = self._event_executor, None
        if events is not None:
            events.shutdown(wait=False)

    async def close(self) -> None:
        """Stop health events, shut NVML down and stop this service's executors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self.stop_health_events()
        if not self._after_waiting(self.nvml.close):
            await self.executor.run(self.nvml.close)
        if self._owns_executor:
            self.executor.shutdown(wait=False)


def _read_units(nvml: Nvml, targets: list, migs: list) -> tuple[list[GpuUsage], list[MigDeviceUsage]]:
    """Whole GPUs and MIG devices in one blocking pass (one executor job)."""
    return read_usage(nvml, targets), read_mig_usage(nvml, migs)
