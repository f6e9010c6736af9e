"""NvidiaGpuAllocator: the handle to a GPU allocator process.

Rules (R-AL-1, SPEC section 11; Mesos' ``NvidiaGpuAllocator``):
- ``NvidiaGpuAllocator.resources(flags)`` computes the node's ``gpus``
  resource with every R-FL-1 check (a plain call; no Runtime needed; it may
  ask NVML, which blocks — it is a start-up check).
- Under a MIG strategy (R-MG-3) the allocator's units are the pools of
  ``managed_units``: ``allocate_resources({"mig-1g.18gb": 1, …})`` takes
  from them, ``pools()`` lists them, ``info(unit)`` is a ``GpuInfo`` or a
  ``MigDeviceInfo``; topology scores cover whole GPUs only.
- ``await NvidiaGpuAllocator.create(flags, resources)`` reads the NVML
  inventory (through the Executor), picks the managed GPUs (the devices
  flag, else indices ``0..gpus-1``) and spawns the allocator process. With
  no GPU to manage it touches no NVML at all.
- ``resources`` and ``create`` agree (R-NV-1): without a usable NVML (no
  host file, no driver) ``resources`` passes ``gpus`` through unchecked, as
  Mesos does, and ``create`` of the GPUs it names fails with "Failed to
  nvml::initialize: ..." (NVML's own error); nothing is ever managed that
  NVML did not report.
- ``total()`` is the managed set (sync). Every other call dispatches to the
  process and returns a runtime ``Future``: ``allocate(count) ->
  Future[set[Gpu]]``, ``allocate(gpus) -> Future[None]``,
  ``deallocate(gpus)``, ``reclaim(gpus)``, ``take_free()``, ``available()``,
  ``allocated()``, health calls. One handle may be shared by several
  isolators; copies of it address the same process.
- Health (R-HE-1): with ``flags.nvidia_health_checks`` (the default),
  ``create`` registers the GPUs it manages (or whose MIG devices it
  manages) for NVML health events before it returns and spawns a
  ``HealthMonitorProcess`` feeding the allocator; units on GPUs NVML cannot
  report on (every unit when checks are off or the event set cannot be
  made) are listed as ``unwatched`` in ``state()``.
- The node ledger (SPEC 22; the process's rules): ``join_ledger(directory,
  owner)`` once, before the first grant; grants then name their
  ``holder`` (``allocate(…, holder=)``, ``allocate_resources(…, holder=)``,
  ``reclaim(units, holders)``, ``take_free(holder)``; ``hold(units,
  holder)`` and ``let_go(holder, units)`` for front doors whose holders
  share units); ``release_unclaimed()`` once the front door has recovered;
  ``ledger_state()``, ``ledger_since(generation)`` and ``refresh_ledger()``
  say what other owners hold.
- ``close()`` stops the health monitor (never waiting out NVML's wait in
  progress), terminates the process and, if ``create`` opened NVML, shuts
  it down. Leaving a ``Runtime`` scope terminates the processes too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from runtime import PID, Future, ProcessTerminated, dispatch, spawn, terminate, wait

from actors.flags import Flags
from actors.gpu import Gpu, GpuInfo
from actors.mig import MigDevice, MigDeviceInfo, Unit
from actors.nvml import Nvml, NodeInventory, NvmlError, NvmlService
from actors.resources import Resources

from ._errors import AllocatorError
from ._ledger_state import LedgerState
from ._monitor import HealthMonitorProcess
from ._health import GpuHealth, HealthSnapshot
from ._process import AllocatorState, GpuAllocatorProcess
from ._mig_resources import managed_units, needs_inventory
from ._resources import gpu_resources
from ._topology import PairScores

__all__ = ["NvidiaGpuAllocator"]

logger = logging.getLogger(__name__)


class NvidiaGpuAllocator:
    """A handle to a ``GpuAllocatorProcess`` (see module rules)."""

    def __init__(
        self,
        pid: PID,
        total: Iterable[Gpu],
        *,
        inventory: NodeInventory | None = None,
        nvml: NvmlService | None = None,
        owns_nvml: bool = False,
        pools: dict[str, Iterable[Unit]] | None = None,
        monitor: PID | None = None,
    ) -> None:
        self.pid = pid
        self._total = frozenset(total)
        self._pools = (
            {name: frozenset(units) for name, units in pools.items()} if pools is not None else {"gpus": self._total}
        )
        self.inventory = inventory
        """The NVML inventory read at create (None when no GPU is managed)."""
        self.nvml = nvml
        """The NVML service (for usage readings); None when no GPU is managed."""
        self._owns_nvml = owns_nvml
        self._wrapped_nvml = False
        self.monitor = monitor
        """The health monitor process (None when nothing is watched)."""

    # ------------------------------------------------------------ creation

    @staticmethod
    def resources(flags: Flags, nvml: Nvml | None = None) -> Resources:
        """The node's GPU resources per R-FL-1; raises AllocatorError (Mesos' texts)."""
        return gpu_resources(flags, nvml)

    @classmethod
    async def create(
        cls,
        flags: Flags,
        resources: Resources,
        nvml: NvmlService | Nvml | None = None,
    ) -> "NvidiaGpuAllocator":
        """Spawn an allocator for the GPUs ``flags``/``resources`` select.

        ``nvml``: a service or an initialised port to read the inventory from;
        default: the port for ``flags.host_file`` (the real NVML when None),
        which ``close()`` shuts down again. Health monitoring follows
        ``flags.nvidia_health_checks`` (see the module rules)."""
        if not needs_inventory(flags, resources):
            process = GpuAllocatorProcess((), strategy=flags.gpu_allocation)
            return cls(spawn(process), ())
        owns = wrapped = False
        if nvml is None:
            try:
                service = await NvmlService.open(flags.host_file)
            except NvmlError as exc:  # no invented GPUs: the ones resources named cannot be found
                raise AllocatorError(f"Failed to nvml::initialize: {exc}") from exc
            owns = True
        elif isinstance(nvml, NvmlService):
            service = nvml
        else:
            service = NvmlService(nvml)
            wrapped = True
        try:
            inventory = await service.inventory()
            pools = managed_units(flags, resources, inventory)
            units = [unit for pool in pools.values() for unit in pool]
            unwatched, watching = await _start_health_events(flags, service, inventory, units)
        except BaseException as exc:
            if owns:
                await service.close()
            elif wrapped:
                service.executor.shutdown(wait=False)
            if isinstance(exc, NvmlError):
                raise AllocatorError(f"Failed to read the GPU inventory from NVML: {exc}") from exc
            raise
        whole = [unit for unit in units if isinstance(unit, Gpu)]
        process = GpuAllocatorProcess(
            units,
            PairScores.from_inventory(inventory, whole),
            strategy=flags.gpu_allocation,
            inventory=inventory,
            pools=pools,
            ignored_xids=flags.nvidia_ignored_xids,
            unwatched=unwatched,
        )
        pid = spawn(process)
        monitor = None
        if watching:
            monitor = spawn(HealthMonitorProcess(service, pid, wait_s=flags.nvidia_health_wait,
                                                 backoff_s=flags.nvidia_health_backoff))
        handle = cls(pid, units, inventory=inventory, nvml=service, owns_nvml=owns, pools=pools, monitor=monitor)
        handle._wrapped_nvml = wrapped
        return handle

    @classmethod
    def of(
        cls,
        gpus: Iterable[Gpu],
        scores: PairScores | None = None,
        *,
        strategy: str = "topology",
        pools: dict[str, Iterable[Unit]] | None = None,
    ) -> "NvidiaGpuAllocator":
        """Spawn an allocator for a given set of GPUs (no NVML; a Runtime must be
        running); ``pools`` as in ``GpuAllocatorProcess`` (MIG devices too)."""
        gpus = list(gpus) if pools is None else [unit for units in pools.values() for unit in units]
        process = GpuAllocatorProcess(gpus, scores, strategy=strategy, pools=pools)
        return cls(spawn(process), gpus, pools=pools)

    # ------------------------------------------------------------ the API

    def total(self) -> set[Gpu]:
        """The managed units: whole GPUs (and MIG devices under a MIG strategy)."""
        return set(self._total)

    def info(self, unit: Unit) -> GpuInfo | MigDeviceInfo | None:
        """The inventory record of a managed GPU or MIG device (None without inventory)."""
        if self.inventory is None:
            return None
        if isinstance(unit, MigDevice):
            return self.inventory.by_mig().get(unit)
        return self.inventory.by_gpu().get(unit)

    def allocate(self, request: int | Iterable[Gpu], holder: str | None = None) -> Future[Any]:
        """``allocate(count) -> Future[set[Gpu]]`` (best-connected available GPUs);
        ``allocate(gpus) -> Future[None]`` (exactly those); ``holder``: who
        holds them (named in the node ledger)."""
        if isinstance(request, int) and not isinstance(request, bool):
            return dispatch(self.pid, GpuAllocatorProcess.allocate_count, request, holder)
        if isinstance(request, (Gpu, MigDevice)):
            return Future.failed(
                AllocatorError(f"allocate() takes a set of GPUs, got the single GPU {request}")
            )
        if isinstance(request, (bool, float, str, bytes)) or not isinstance(request, Iterable):
            return Future.failed(
                AllocatorError(f"allocate() takes a count or a set of GPUs, got {request!r}")
            )
        return dispatch(self.pid, GpuAllocatorProcess.allocate_gpus, frozenset(request), holder)

    def allocate_resources(self, demand: dict[str, int], holder: str | None = None) -> Future[set[Unit]]:
        """Units for several resources at once, all or nothing:
        ``{"gpus": 1, "mig-1g.18gb": 2}`` (R-MG-3; see the process's rules)."""
        return dispatch(self.pid, GpuAllocatorProcess.allocate_resources, dict(demand), holder)

    def pools(self) -> dict[str, set[Unit]]:
        """Resource name -> the units managed under it (sync)."""
        return {name: set(units) for name, units in self._pools.items()}

    def deallocate(self, gpus: Iterable[Gpu]) -> Future[None]:
        """Return GPUs; fails naming any not allocated."""
        return dispatch(self.pid, GpuAllocatorProcess.deallocate, frozenset(gpus))

    def reclaim(self, gpus: Iterable[Gpu], holders: dict[Unit, str] | None = None,
                quarantine: Iterable[Unit] = ()) -> Future[None]:
        """Recovery: take GPUs a surviving container holds, whatever their health
        (``holders``: unit -> its holder, for the node ledger; ``quarantine``: those
        held back for containers of unknown state)."""
        return dispatch(self.pid, GpuAllocatorProcess.reclaim, frozenset(gpus), dict(holders or {}),
                        frozenset(quarantine))

    def take_free(self, holder: str | None = None) -> Future[set[Unit]]:
        """Take every unit not allocated (healthy or not, and no other front door's),
        in one call; the units taken."""
        return dispatch(self.pid, GpuAllocatorProcess.take_free, holder)

    # ------------------------------------------------------------ the node ledger

    def join_ledger(self, directory: str, owner: str, linger: float | None = None) -> Future[LedgerState]:
        """Take and return leases in the node ledger at ``directory`` as ``owner``
        (``actors.ledger.isolator_owner`` …) from now on; the ledger as joined.
        Fails with ``actors.ledger.LedgerError`` when another process of that
        owner runs or the directory cannot be trusted."""
        if linger is None:
            return dispatch(self.pid, GpuAllocatorProcess.join_ledger, directory, owner)
        return dispatch(self.pid, GpuAllocatorProcess.join_ledger, directory, owner, linger)

    def hold(self, units: Iterable[Unit], holder: str) -> Future[None]:
        """``holder`` holds exactly ``units`` (shared with other holders of this
        owner), all or none; refused naming unit, owner and holder when another
        front door holds one (the plugins' Allocate and prepare)."""
        return dispatch(self.pid, GpuAllocatorProcess.hold, frozenset(units), holder)

    def let_go(self, holder: str, units: Iterable[Unit] | None = None) -> Future[set[Unit]]:
        """``holder`` holds ``units`` (None: all of its units) no more; the units
        no holder keeps (returned to the node ledger shortly)."""
        return dispatch(self.pid, GpuAllocatorProcess.let_go, holder,
                        frozenset(units) if units is not None else None)

    def release_unclaimed(self) -> Future[list[str]]:
        """After recovery: return every unit leased in an earlier run and not
        reclaimed; what went back."""
        return dispatch(self.pid, GpuAllocatorProcess.release_unclaimed)

    def ledger_state(self) -> Future[LedgerState | None]:
        """What the node ledger link knows: other owners' units, inherited ones (None: no ledger)."""
        return dispatch(self.pid, GpuAllocatorProcess.ledger_state)

    def ledger_since(self, generation: int | None) -> Future[LedgerState]:
        """The ``LedgerState`` once the units other owners hold changed after
        ``generation`` (None: now); discard to stop waiting."""
        return dispatch(self.pid, GpuAllocatorProcess.ledger_since, generation)

    def refresh_ledger(self) -> Future[LedgerState]:
        """Read the node ledger again now (one executor job); the ``LedgerState`` then."""
        return dispatch(self.pid, GpuAllocatorProcess.refresh_ledger)

    def available(self) -> Future[set[Gpu]]:
        """The GPUs that may be handed out now (free and healthy)."""
        return dispatch(self.pid, GpuAllocatorProcess.available)

    def allocated(self) -> Future[set[Gpu]]:
        """The GPUs handed out."""
        return dispatch(self.pid, GpuAllocatorProcess.allocated_gpus)

    def state(self) -> Future[AllocatorState]:
        """A snapshot: total, available, allocated, unhealthy."""
        return dispatch(self.pid, GpuAllocatorProcess.state)

    def mark_unhealthy(self, gpu: Gpu, reason: str = "marked unhealthy by the operator") -> Future[GpuHealth]:
        """Withhold ``gpu`` from allocation until ``mark_healthy``."""
        return dispatch(self.pid, GpuAllocatorProcess.mark_unhealthy, gpu, reason)

    def mark_healthy(self, gpu: Gpu) -> Future[GpuHealth]:
        """Return ``gpu`` to the pool of GPUs that may be handed out."""
        return dispatch(self.pid, GpuAllocatorProcess.mark_healthy, gpu)

    def unhealthy(self) -> Future[dict[Gpu, str]]:
        """GPUs withheld as unhealthy, with the reason."""
        return dispatch(self.pid, GpuAllocatorProcess.unhealthy_gpus)

    def watch(self, gpus: Iterable[Gpu]) -> Future[GpuHealth]:
        """Completes when any of ``gpus`` turns unhealthy (discard to stop watching)."""
        return dispatch(self.pid, GpuAllocatorProcess.watch, frozenset(gpus))

    def health_since(self, generation: int | None) -> Future[HealthSnapshot]:
        """The unhealthy units once their set changed after ``generation``
        (None: now); discard to stop waiting."""
        return dispatch(self.pid, GpuAllocatorProcess.health_since, generation)

    def preferred(self, candidates: Iterable[Unit], count: int, include: Iterable[Unit] = ()) -> Future[list[Unit]]:
        """The ``count`` of ``candidates`` (holding ``include``) that ``allocate``
        would choose, allocating nothing."""
        return dispatch(self.pid, GpuAllocatorProcess.preferred, frozenset(candidates), count, frozenset(include))

    async def close(self) -> None:
        """Stop health monitoring, return unused node ledger leases, terminate the
        allocator process (and NVML, when ``create`` opened it)."""
        try:
            await dispatch(self.pid, GpuAllocatorProcess.leave_ledger)
        except ProcessTerminated:
            pass
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            terminate(monitor)
            await wait(monitor)
            if self.nvml is not None:
                await self.nvml.stop_health_events()
        terminate(self.pid)
        await wait(self.pid)
        if self._owns_nvml and self.nvml is not None:
            self._owns_nvml = False
            await self.nvml.close()
        elif self._wrapped_nvml and self.nvml is not None:
            self._wrapped_nvml = False
            self.nvml.executor.shutdown(wait=False)  # ours; the port stays the caller's

    # ------------------------------------------------------------ identity

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NvidiaGpuAllocator) and other.pid == self.pid

    def __hash__(self) -> int:
        return hash(self.pid)

    def __repr__(self) -> str:
        return f"NvidiaGpuAllocator({self.pid}, total={sorted(self._total)})"

async def _start_health_events(
    flags: Flags, service: NvmlService, inventory: NodeInventory, units: list[Unit]
) -> tuple[set[Gpu], bool]:
    """Register the GPUs of the managed units for health events (R-HE-2): the
    GPUs left unwatched, and whether a monitor should wait on the events."""
    gpus = {unit.parent if isinstance(unit, MigDevice) else unit for unit in units}
    infos = [info for info in inventory.gpus if info.gpu in gpus]
    if not flags.nvidia_health_checks:
        logger.info("GPU health checks are off (--nvidia_health_checks=false): no GPU's health is watched")
        return gpus, False
    if service.health_events_started:
        logger.warning("Health events of this NVML service already feed another allocator;"
                       " this allocator's GPUs are not watched")
        return gpus, False
    try:
        registration = await service.start_health_events([info.index for info in infos])
    except NvmlError as exc:
        logger.warning("GPU health monitoring is off: %s; no GPU's health is watched", exc)
        return gpus, False
    if not registration.registered:
        await service.stop_health_events()
        return gpus, False
    by_index = {info.index: info.gpu for info in infos}
    return {by_index[index] for index in registration.unknown}, True
