"""NvidiaGpuIsolatorProcess: the lifecycle verbs; gives every container exactly
the GPUs it was granted.

Rules (Mesos ``gpu/isolator.cpp``, plus what Mesos never finished):
- One actor holds per-container facts only (cgroup, GPUs held). The allocator
  actor is the single source of truth for which GPU is free; the device
  control actor is the single writer of device rules; the volume actor owns
  the host volume. All of them are reached by dispatch.
- ``create`` probes the host off the event loop (``_startup``: R-FL-2 flags,
  control devices by number), builds device control, spawns the actor and
  returns its handle (``MesosIsolator``).
- Calls for one container apply in arrival order, calls for different
  containers concurrently, every call after a recovery issued before it
  (``_ordering``); every failure leaves as an ``IsolatorError``.
- Every unit taken from the allocator is in the ledger (``_ledger``) with
  the reason it is not free, and goes back only through it (``_give_back``):
  never while a cgroup may reach it.
- ``prepare``: nested DEBUG -> None; nested -> launch info only; a known id ->
  "Container has already been prepared"; else allocate, then ONE device
  ``configure`` of the whole policy (deny all; standard set, control devices,
  GPUs), then the launch info (``_launch``). Any failure undoes what was
  done: the cgroup is removed, then the GPUs go back and no record stays
  (if processes of an earlier container hold it, it is stripped of every
  GPU and lingers; if it cannot be removed, it lingers WITH the GPUs --
  and when its configure itself failed it may reach any GPU, so every free
  one is held back from that moment on -- until a cleanup, prepare or
  reconcile removes it).
- Every entry point re-validates the container id (``check_container_id``)
  before anything else: a bad or forged id fails with InvalidContainerID and
  no path is ever built from it.
- ``update`` has one algorithm for GPUs and MIG devices (``UnitCatalog``):
  per resource, take the extra units (all or nothing) and pick the surplus,
  highest first; write the whole policy of what is kept (exactly what a
  fresh prepare would write, so reconcile sees no drift); then the surplus
  goes back. A failed update changes nothing; the extra units of a failed
  one go back only once the kernel is known not to grant them.
- ``cleanup`` is idempotent (of an unknown id: nothing to do, unless a
  cgroup of that name exists under the root -- someone else made it --
  which is removed, or denied every GPU while processes keep it): the
  cgroup is removed (if processes remain, the
  GPUs are first denied to it, then released, with a warning; the cgroup is
  remembered as lingering and a later prepare of that id is refused until
  its processes are gone), the GPUs go back, the copied device nodes are
  removed and the record is forgotten.
- ``recover`` (``_recovering``; serialized, see below) gathers the facts (the cgroups under the root, each one's
  device state, the GPUs the allocator holds), asks the pure planner
  (``_recovery.plan_recovery``) and carries the plan out: one reclaim, the
  records, then every recovered cgroup whose state is known is reconciled
  to its recovered policy (the kernel may lag the record after a crash),
  repairs reported. Containers of unknown device state may reach any
  GPU: every free one is held back for them (the quarantine, shown as
  theirs), and so is every one released until the last of them is
  cleaned up; they can only be cleaned up.
- ``usage`` (R-IS-5, ``_usage``): NVML readings per unit held.
- ``watch`` (R-IS-9, ``_health``) follows the GPUs the container holds now
  (re-armed at every update); its Futures are discarded at cleanup.
- ``reconcile`` (R-DV-5, ``_repair``) repairs each container's kernel state,
  queued behind its other calls, also periodically; GPUs whose grant had an
  unknown outcome, and cgroups that could not be removed, are settled there
  by reading the kernel back, never by a guess.
- ``recover`` runs one at a time, once every call issued before it is done,
  and every call issued after it (usage included) waits for it: a prepare
  right after ``recover()`` never gets a GPU a recovered container holds, and
  a prepare of an id being recovered is refused ("Container has already been
  prepared") without touching its cgroup. Calls wait rather than being
  refused: an agent may issue them without awaiting the recovery.
- Metrics (``_metrics``): published at initialize, given back at finalize;
  prepare, update, cleanup and each container's reconcile are counted and
  timed (``measured``), gauges read the records when a snapshot is taken.
- Units (R-MG-3): with a MIG strategy the allocator hands out MIG devices
  too (``UnitCatalog``): a container's demand is counted per resource
  (``gpus``, ``mig-<profile>``), taken all or nothing, granted by the MIG
  device's parent node and its two capability nodes, released highest
  first per resource, recognised at recovery from the kernel's state.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
from typing import Any

from actors import Gpu
from actors.devices import DeviceControl, DeviceRule
from actors.mig import MigCapabilityError, MigDevice, read_mig_capabilities
from actors.flags import Flags
from actors.resources import Resources
from runtime import Executor, Future, Process, Sequence, spawn

from ._components import NvidiaComponents
from ._container_specs import ContainerSpecs
from ._errors import IsolatorError, as_isolator_error
from ._health import HealthWatch
from ._grant import ContainerRecord, Policies
from ._ledger import GpuLedger, Reach
from ._units import UnitCatalog
from ._launch import build_launch_info, remove_devices_dir, runtime_path
from ._metrics import IsolatorMetrics, measured
from ._ordering import ContainerOrdering
from ._usage import UsageReport
from ._recovering import Recovering
from ._repair import KernelRepair
from ._recovery import minors
from ._startup import probe_host
from ._types import (
    ContainerClass,
    ContainerConfig,
    ContainerID,
    ContainerLaunchInfo,
    check_container_id,
)

logger = logging.getLogger(__name__)


class NvidiaGpuIsolatorProcess(ContainerOrdering, Recovering, UsageReport, KernelRepair, HealthWatch, Process):
    """The NVIDIA GPU isolator actor (see the module rules)."""

    def __init__(self, flags: Flags, components: NvidiaComponents, devices: DeviceControl,
                 control_devices: dict[str, DeviceRule], catalog: UnitCatalog | None = None) -> None:
        super().__init__()
        self.flags = flags
        self.allocator = components.allocator
        self.volume = components.volume
        self.nvml = components.nvml
        self.inventory = components.inventory
        self.devices = devices
        self.control_devices = control_devices
        self.infos: dict[ContainerID, ContainerRecord] = {}
        self._init_ordering()
        self._recoveries = Sequence(on_idle=self._recovered)
        """Recoveries, one at a time."""
        self._recovering: Future | None = None
        """The last recovery issued while it runs or waits: later calls wait for it."""
        self.catalog = catalog if catalog is not None else UnitCatalog(components.allocator.pools())
        """The units handed out: their rules, grants and resources."""
        self._mig = self.catalog.has_mig
        """MIG devices are handed out (else every path is the whole-GPU one)."""
        self.policies = Policies(control_devices.values(), self.catalog.rules if self._mig else None)
        self._executor = Executor(max_workers=2, name="gpu-isolator")
        self.specs = ContainerSpecs(flags.cdi_spec_dir, flags.dev_dir, components.inventory, control_devices,
                                    components.volume, self._executor, self.catalog.caps if self._mig else None)
        """The containers' transient CDI specs (R-CD-1; nothing written without ``cdi_spec_dir``)."""
        self.recovery_report: list[str] = []
        self.ledger = GpuLedger()
        """Every unit taken from the allocator, and why it is not free (``_ledger``)."""
        self._lingering: dict[ContainerID, str] = {}
        """Ids whose cgroup could not be removed (processes inside, a failed or
        unknown removal), and why; what it may still reach is in the ledger."""
        self._device_dirs: set[ContainerID] = set()
        """Ids (nested too) whose device nodes a prepare copied."""
        self.reconcile_runs = 0
        """Periodic reconciliations completed (``flags.reconcile_interval``)."""
        self._reconcile_timer: Any = None
        self._stopping = False
        self._metrics = IsolatorMetrics()
        """Counts and timers (``_metrics``), published while the actor runs."""

    # -- construction -----------------------------------------------------
    @classmethod
    async def create(cls, flags: Flags, components: NvidiaComponents,
                     devices: DeviceControl | None = None) -> Any:
        """Check flags, record control devices (off the loop), pick the device
        backend, spawn; the handle (``MesosIsolator``).

        ``devices``: a device control to use instead of building one from the
        flags (tests inject a ``FaultInjectingBackend`` this way); the
        isolator's ``close()`` terminates it either way."""
        from ._handle import MesosIsolator

        host_numbers = dict(components.inventory.control_devices) if components.inventory.kind == "simulated" else None
        pools = components.allocator.pools()
        has_mig = any(isinstance(unit, MigDevice) for units in pools.values() for unit in units)
        executor = Executor(1, name="gpu-isolator-create")
        try:
            control = await executor.run(probe_host, flags, host_numbers)
            caps = await executor.run(read_mig_capabilities, flags.proc_dir) if has_mig else None
            catalog = UnitCatalog(pools, caps, flags.nvidia_mig_strategy)
        except MigCapabilityError as e:
            raise IsolatorError(str(e)) from e
        finally:
            executor.shutdown(wait=False)
        if devices is None:
            try:
                devices = await DeviceControl.create(
                    backend=flags.device_backend,
                    hierarchy=flags.cgroups_hierarchy,
                    cgroups_root=flags.cgroups_root,
                    work_dir=flags.work_dir,
                    worker=flags.device_worker,
                )
            except Exception as error:
                raise as_isolator_error(error) from error
        process = cls(flags, components, devices, control, catalog)
        spawn(process)
        return MesosIsolator(process, devices)

    def initialize(self) -> None:
        self._metrics.publish(self)
        self._schedule_reconcile()

    def finalize(self) -> None:
        self._stopping = True
        self._metrics.close()
        if self._reconcile_timer is not None:
            self._reconcile_timer.cancel()
            self._reconcile_timer = None
        self._executor.shutdown(wait=False)
        self._release_all()

    def supports_nesting(self) -> bool:
        return True

    def supports_standalone(self) -> bool:
        return True

    # -- prepare --------------------------------------------------------------
    def prepare(self, container_id: ContainerID, config: ContainerConfig) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            if config.container_class == ContainerClass.DEBUG:
                return None
            return self._in_order(container_id, self._nested_launch_info, container_id, config)
        return self._in_order(container_id, self._prepare, container_id, config)

    @measured("prepare")
    async def _prepare(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        if container_id in self.infos:
            raise IsolatorError("Container has already been prepared")
        demand = self.catalog.demand(config.resources)
        if container_id in self._lingering:
            await self._refuse_while_lingering(container_id)
        if container_id in self.infos:  # re-check after the await
            raise IsolatorError("Container has already been prepared")
        info = ContainerRecord(container_id, container_id.value if container_id.parent is None else container_id.path())
        self.infos[container_id] = info
        touched = False  # whether units were taken and the kernel asked for anything
        configured = False  # whether it answered: the cgroup grants exactly ``units``
        try:
            units: set = set(await self.allocator.allocate_resources(demand)) if any(demand.values()) else set()
            self.ledger.hold(container_id, units)
            touched = True
            await self.devices.configure(info.cgroup, self.policies.of(units))
            configured = True
            launch = await self._launch_info(container_id, config) if config.rootfs is not None else None
            if launch is not None or self.specs.enabled:
                launch = await self.specs.attach(container_id, units, config, launch)
        except BaseException as e:
            if container_id in self._device_dirs:
                await self._remove_device_copies(container_id)
            await self._undo_prepare(info, touched, configured)
            logger.warning("Container %s: prepare failed and was undone: %s", container_id, e)
            raise
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: prepared with GPUs %s", container_id, minors(units))
        return launch

    async def _undo_prepare(self, info: ContainerRecord, touched: bool, configured: bool = False) -> None:
        """Forget the record; its units go back once the kernel says no cgroup
        of it grants them: a configure that failed may have applied anything
        (its effects are unknown when the device worker died), so its cgroup
        may reach any unit until it is removed; while it cannot be, it lingers
        with its units, for a later cleanup or reconcile to finish."""
        cid = info.container_id
        if self.infos.get(cid) is info:
            del self.infos[cid]
        if not touched:  # nothing taken, the kernel never asked: nothing there to undo
            return
        try:
            if not configured:
                await self._reaches_any(cid, Reach.FAILED_PREPARE)
            self._lingering[cid] = "its prepare failed"
            await self._settle_lingering(cid)
        except Exception as error:  # keep the original error; what stayed is recorded and logged
            logger.error("Container %s: undoing a failed prepare did not finish: %s", cid, error)

    async def _refuse_while_lingering(self, container_id: ContainerID) -> None:
        """A cgroup of an earlier container with this id is still there: try to
        remove it once more; refuse the prepare while it stays."""
        try:
            if await self._settle_lingering(container_id):
                return
        except Exception:
            pass
        reason = self._lingering.get(container_id, "it is still there")
        raise IsolatorError(
            f"Container {container_id}: the cgroup '{container_id.path()}' of an earlier container with"
            f" this id {reason}; it cannot be prepared again until it is gone"
        )

    async def _launch_info(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        launch, copied = await build_launch_info(
            self._executor, self.volume, self.flags.runtime_dir, self.flags.dev_dir, container_id, config,
            mig_files=self.catalog.container_files(self.flags.dev_dir) if self._mig else None)
        if copied:
            self._device_dirs.add(container_id)
        return launch

    async def _nested_launch_info(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        """A nested container's launch info: it shares its top-level container's grant (R-CD-1)."""
        launch = await self._launch_info(container_id, config)
        root = container_id.root()
        if root not in self.infos or self.ledger.reach(root) is Reach.UNKNOWN_STATE:
            return launch
        return self.specs.attach_nested(container_id, launch, self.ledger.held(root))

    # -- update ---------------------------------------------------------------
    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        if (container_id in self.infos and not self._in_flight(container_id) and self._crashed is None
                and self._recovering is None and self.ledger.reach(container_id) is not Reach.UNKNOWN_STATE
                and self.catalog.fits(self.ledger.held(container_id), resources)):
            self._metrics.update.runs.inc()
            return None  # nothing to change, and no earlier call on it in flight: done now
        return self._in_order(container_id, self._update, container_id, resources)

    @measured("update")
    async def _update(self, container_id: ContainerID, resources: Resources) -> None:
        """Per resource, take the extra units (all or nothing) and give back the
        surplus, highest first: ONE ``configure`` of the whole policy of what
        is kept (exactly what a fresh prepare would write, so reconcile sees no
        drift), the CDI spec rewritten, then the surplus goes back. A failed
        update changes nothing; the extra units of a failed one go back only
        once the kernel is known not to grant them."""
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        demand = self.catalog.demand(resources)
        if self.ledger.reach(container_id) is Reach.UNKNOWN_STATE:
            raise IsolatorError(
                f"Container {container_id}: its device state was unknown at recovery (GPUs"
                f" {minors(self.ledger.held_back())} are held back for it); it can only be cleaned up"
            )
        held = self.ledger.held(container_id)
        counts = self.catalog.held(held)
        wanted = {name: count - counts.get(name, 0) for name, count in demand.items() if count > counts.get(name, 0)}
        surplus = self.catalog.surplus(held, demand)
        if not wanted and not surplus:
            return
        extra: set = set(await self.allocator.allocate_resources(wanted)) if wanted else set()
        self.ledger.withhold(container_id, extra)  # its grant is under way: the kernel may have it from now on
        keep = (held - surplus) | extra
        try:
            await self.devices.configure(info.cgroup, self.policies.of(keep))
        except BaseException:
            # Never released on a guess: the grant may be in the kernel (a
            # device worker that died mid-batch); held back until the kernel
            # is made to match the record, or read back.
            await self._settle_withheld(info)
            raise
        await self._respec(info, keep)
        await self._give_back(self.ledger.enforced(container_id, keep))
        self._arm(info)
        if logger.isEnabledFor(logging.INFO):
            changes = ([f"granted GPUs {minors(extra)}"] if extra else []) + (
                [f"released GPUs {minors(surplus)}, highest minors first"] if surplus else [])
            logger.info("Container %s: %s (now %s)", container_id, "; ".join(changes), minors(keep))

    async def _respec(self, info: ContainerRecord, units: set) -> None:
        """After an update's kernel change, rewrite the container's CDI spec
        (before any unit is released: no stale spec names a freed GPU). If it
        cannot be written, the kernel goes back to the units held before and
        the extra ones go back to the pool: the update changes nothing. If the
        kernel cannot be put back, the extra units stay withheld until it is
        (reconcile) or it is read back."""
        try:
            await self.specs.write(info.container_id, units)
        except IsolatorError:
            held = self.ledger.held(info.container_id)
            try:
                await self.devices.configure(info.cgroup, self.policies.of(held))
            except Exception as e:  # the cgroup may still grant them: keep them withheld
                logger.error("Container %s: failed to restore its device rules after a failed CDI spec write: %s",
                             info.container_id, e)
                await self._settle_withheld(info)
                raise
            await self._give_back(self.ledger.enforced(info.container_id, held))
            raise

    # -- cleanup --------------------------------------------------------------
    def cleanup(self, container_id: ContainerID) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            if container_id in self._device_dirs:  # only its copied device nodes to remove
                return self._in_order(container_id, self._remove_device_copies, container_id)
            return None
        return self._in_order(container_id, self._cleanup, container_id)

    @measured("cleanup")
    async def _cleanup(self, container_id: ContainerID) -> None:
        info = self.infos.get(container_id)
        if info is None:
            if container_id in self._lingering:
                await self._settle_lingering(container_id)
            else:
                await self._cleanup_unknown(container_id)
            await self._remove_device_copies(container_id)
            return
        # Until the kernel has removed the cgroup (or, processes inside,
        # denies it every GPU) a failure changes nothing: the record and its
        # GPUs stay, and the cleanup can be retried.
        if self.specs.enabled:  # first: a failure here changes nothing, and no spec outlives its GPUs
            await self.specs.remove(container_id)
        removed = await self.devices.remove(info.cgroup)
        if not removed:
            # The standard set and the control devices stay.
            await self.devices.configure(info.cgroup, self.policies.of(()))
            self._lingering[container_id] = "still has processes"
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, info.cgroup, minors(self._units_of(container_id)))
        self.infos.pop(container_id, None)
        if info.watchers or info.health is not None:
            self._stop_watching(info)
        reach = self.ledger.reach(container_id)
        released = self.ledger.removed(container_id) if removed else self.ledger.enforced(container_id, ())
        await self._give_back(released)
        if reach is Reach.UNKNOWN_STATE and self.ledger.held_back():
            waiting = sorted(str(cid) for cid in self.ledger.reaching())
            logger.warning("Container %s: cleaned up; GPUs %s stay out of the free pool until %s (which may reach any"
                           " GPU) are cleaned up or repaired", container_id, minors(self.ledger.held_back()), waiting)
        if container_id in self._device_dirs:
            await self._remove_device_copies(container_id)
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: cleaned up, released GPUs %s", container_id, minors(released.freed))

    async def _cleanup_unknown(self, container_id: ContainerID) -> None:
        """Cleanup of an id the isolator has no record of: as in Mesos, nothing
        to do -- unless a cgroup of that name exists under the root (someone
        else made it): it would grant every device, so it is removed, or (it
        has processes) denied every GPU and kept as lingering, with a warning."""
        cgroup = container_id.path()
        if not await self.devices.exists(cgroup):
            logger.debug("Container %s: ignoring cleanup request for unknown container", container_id)
            return
        if await self.devices.remove(cgroup):
            logger.warning("Container %s: cleanup of an unknown container found its cgroup '%s' under the isolator"
                           " root (made by someone else); removed it", container_id, cgroup)
            return
        await self.devices.configure(cgroup, self.policies.of(()))
        self._lingering[container_id] = "still has processes"
        logger.warning("Container %s: cleanup of an unknown container found its cgroup '%s' under the isolator root"
                       " (made by someone else) with processes inside; it stays, denied every GPU", container_id,
                       cgroup)

    async def _remove_device_copies(self, container_id: ContainerID) -> None:
        if container_id not in self._device_dirs:
            return
        self._device_dirs.discard(container_id)
        try:
            await self._executor.run(remove_devices_dir, self.flags.runtime_dir, runtime_path(container_id))
        except OSError as e:
            logger.warning("Container %s: failed to remove its copied device nodes: %s", container_id, e)

    def containers(self) -> dict[str, list[int]]:
        """The containers known and the minors each holds (for scripts and tests);
        a MIG device is written ``195:0/gi3/ci0``."""
        return {str(cid): minors(self._units_of(cid)) for cid in self.infos}

    def _units_of(self, container_id: ContainerID) -> frozenset:
        """The units a container holds: its record's, or (its device state was
        unknown at recovery) every unit held back for it."""
        if self.ledger.reach(container_id) is Reach.UNKNOWN_STATE:
            return self.ledger.held_back()
        return self.ledger.held(container_id)
