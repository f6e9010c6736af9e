"""NvmlService: the NVML port as actors use it, off the event loop.

Rules:
- Every NVML call runs on a ``runtime.Executor`` (R-NV-2): one executor job
  per question (``inventory()`` reads a whole node in one job, ``usages()``
  reads several GPUs — and MIG devices, on their MIG handles — in one job). Nothing here blocks the loop.
- ``inventory()`` is read once and cached (a node's GPUs do not change while
  the agent runs); ``inventory(refresh=True)`` reads it again.
- ``wait_event`` runs on its own single-thread executor so a health watcher
  blocked in NVML never delays inventory or usage calls.
- ``NvmlService.open(host_file)`` opens the port in the executor
  (``open_nvml``: the host file's simulated node, or the real NVML when
  None; never a made-up node).
- ``close()`` shuts NVML down (once) and stops the executors this service
  created.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Callable, TypeVar

from runtime import Executor

from actors.gpu import Gpu, GpuInfo
from actors.mig import MigDevice

from ._inventory import GpuUsage, MigDeviceUsage, NodeInventory, read_inventory, read_mig_usage, read_usage
from ._open import open_nvml
from ._port import HealthEvent, Nvml

__all__ = ["NvmlService"]

T = TypeVar("T")


class NvmlService:
    """Async access to an ``Nvml`` port through an Executor (see module rules)."""

    def __init__(self, nvml: Nvml, executor: Executor | None = None) -> None:
        self.nvml = nvml
        self._owns_executor = executor is None
        self.executor = executor if executor is not None else Executor(max_workers=2, name="nvml")
        self._event_executor: Executor | None = None
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

    @property
    def cached_inventory(self) -> NodeInventory | None:
        """The inventory if it was read already, else None (never blocks)."""
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

    async def wait_event(self, timeout_s: float) -> HealthEvent | None:
        """The next health event within ``timeout_s`` seconds, or None."""
        if self._event_executor is None:
            self._event_executor = Executor(max_workers=1, name="nvml-events")
        return await self._event_executor.run(self.nvml.wait_event, timeout_s)

    async def close(self) -> None:
        """Shut NVML down and stop this service's executors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self.executor.run(self.nvml.close)
        if self._owns_executor:
            self.executor.shutdown(wait=False)
        if self._event_executor is not None:
            self._event_executor.shutdown(wait=False)


def _read_units(nvml: Nvml, targets: list, migs: list) -> tuple[list[GpuUsage], list[MigDeviceUsage]]:
    """Whole GPUs and MIG devices in one blocking pass (one executor job)."""
    return read_usage(nvml, targets), read_mig_usage(nvml, migs)
