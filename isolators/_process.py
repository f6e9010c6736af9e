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
- ``prepare``: nested DEBUG -> None; nested -> launch info only; a known id ->
  "Container has already been prepared"; else allocate, then ONE device
  ``configure`` of the whole policy (deny all; standard set, control devices,
  GPUs), then the launch info (``_launch``). Any failure undoes what was
  done: the cgroup is removed, then the GPUs go back and no record stays
  (if processes of an earlier container hold it, it is stripped of every
  GPU and lingers; if it cannot be removed, it lingers WITH the GPUs --
  and every free GPU too when its configure itself failed, since it may
  then grant any -- never allocated without a record, until a cleanup,
  prepare or reconcile removes it).
- Every entry point re-validates the container id (``check_container_id``)
  before anything else: a bad or forged id fails with InvalidContainerID and
  no path is ever built from it.
- ``update`` grows by allocating and allowing; shrinks by writing the policy
  of the GPUs it keeps (exactly what a fresh prepare would write, so the
  surplus is denied and reconcile sees no drift) and then releasing the
  highest minors first. A failed update changes nothing; the extra GPUs of
  a failed grow go back only once the kernel is known not to grant them.
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
  repairs reported. Containers of unknown device state share one
  quarantine and can only be cleaned up.
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
  Without MIG devices the whole-GPU paths run unchanged.
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
from ._grant import ContainerRecord, LingeringCgroup, Policies, gpu_rules, requested_gpus
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
        self._quarantine: set[Gpu] = set()
        """GPUs held back for every container whose device state was unknown at recovery."""
        self._lingering: dict[ContainerID, LingeringCgroup] = {}
        """Ids whose cgroup could not be removed (processes inside, a failed or
        unknown removal), with the GPUs still withheld for it."""
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
        if self._mig:
            demand = self.catalog.demand(config.resources)
            requested = sum(demand.values())
        else:
            requested = requested_gpus(config.resources)
        if container_id in self._lingering:
            await self._refuse_while_lingering(container_id)
        if container_id in self.infos:  # re-check after the await
            raise IsolatorError("Container has already been prepared")
        info = ContainerRecord(container_id, container_id.value if container_id.parent is None else container_id.path())
        self.infos[container_id] = info
        touched = False  # whether the kernel was asked for anything
        configured = False  # whether it answered: the cgroup grants exactly ``gpus``
        try:
            if not requested:
                gpus: set[Gpu] = set()
            elif self._mig:
                gpus = set(await self.allocator.allocate_resources(demand))
            else:
                gpus = set(await self.allocator.allocate(requested))
            info.allocated = gpus
            touched = True
            await self.devices.configure(info.cgroup, self.policies.of(gpus))
            configured = True
            launch = await self._launch_info(container_id, config) if config.rootfs is not None else None
            if launch is not None or self.specs.enabled:
                launch = await self.specs.attach(container_id, info.allocated, config, launch)
        except BaseException as e:
            if container_id in self._device_dirs:
                await self._remove_device_copies(container_id)
            await self._undo_prepare(info, touched, configured)
            logger.warning("Container %s: prepare failed and was undone: %s", container_id, e)
            raise
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: prepared with GPUs %s", container_id, minors(info.allocated))
        return launch

    async def _undo_prepare(self, info: ContainerRecord, touched: bool, configured: bool = False) -> None:
        """Forget the record and give its GPUs back -- once the kernel says no
        cgroup of it grants them: a configure that failed may have applied
        anything (its effects are unknown when the device worker died), so
        the cgroup is removed first; while it cannot be, it lingers with the
        GPUs (and, if its configure failed, every free GPU: it may grant any),
        for a later cleanup or reconcile to finish."""
        cid = info.container_id
        if self.infos.get(cid) is info:
            del self.infos[cid]
        gpus, info.allocated, info.withheld = info.allocated | info.withheld, set(), set()
        try:
            if not touched:  # the kernel was never asked: nothing there to undo
                await self._give_back(gpus)
                return
            self._lingering[cid] = LingeringCgroup(gpus, "its prepare failed", may_grant_any=not configured)
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
        lingering = self._lingering.get(container_id)
        reason = lingering.reason if lingering is not None else "it is still there"
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
        root = self.infos.get(container_id.root())
        if root is None or root.unknown_state:
            return launch
        return self.specs.attach_nested(container_id, launch, root.allocated)

    # -- update ---------------------------------------------------------------
    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        info = self.infos.get(container_id)
        if (info is not None and not self._in_flight(container_id) and self._crashed is None
                and self._recovering is None and not info.unknown_state and self._fits(info, resources)):
            self._metrics.update.runs.inc()
            return None  # nothing to change, and no earlier call on it in flight: done now
        return self._in_order(container_id, self._update, container_id, resources)

    def _fits(self, info: ContainerRecord, resources: Resources) -> bool:
        """Whether ``info`` holds exactly what ``resources`` ask for."""
        if not self._mig:
            return requested_gpus(resources) == len(info.allocated)
        demand = {name: count for name, count in self.catalog.demand(resources).items() if count}
        return demand == self.catalog.held(info.allocated)

    @measured("update")
    async def _update(self, container_id: ContainerID, resources: Resources) -> None:
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        if self._mig:
            return await self._update_units(info, self.catalog.demand(resources))
        requested = requested_gpus(resources)
        if info.unknown_state:
            raise IsolatorError(
                f"Container {container_id}: its device state was unknown at recovery (GPUs"
                f" {minors(info.allocated)} are held back for it); it can only be cleaned up"
            )
        held = len(info.allocated)
        if requested > held:
            extra = set(await self.allocator.allocate(requested - held))
            try:
                await self.devices.reconfigure(info.cgroup, gpu_rules(extra), [])
            except BaseException:
                # Never released on a guess: the grant may be in the kernel
                # (a device worker that died mid-batch); they are held back
                # until the kernel is made to match the record, or read back.
                info.withheld |= extra
                await self._settle_withheld(info)
                raise
            await self._respec(info, info.allocated | extra, extra)
            info.allocated = info.allocated | extra
            self._arm(info)
            logger.info("Container %s: granted GPUs %s (now %s)", container_id, minors(extra), minors(info.allocated))
        elif requested < held:
            surplus = set(sorted(info.allocated, reverse=True)[: held - requested])
            keep = info.allocated - surplus
            # The whole policy of the GPUs kept, not a bare deny: the model would
            # then also deny mknod of the surplus, which a fresh prepare allows
            # (c *:* m), and reconcile/recovery would see that as drift.
            await self.devices.configure(info.cgroup, self.policies.of(keep))
            await self._respec(info, keep)
            info.allocated = keep
            self._arm(info)
            await self._give_back(surplus)
            logger.info("Container %s: released GPUs %s, highest minors first (now %s)",
                        container_id, minors(surplus), minors(info.allocated))

    async def _respec(self, info: ContainerRecord, gpus: set[Gpu], extra: set[Gpu] | None = None) -> None:
        """After an update's kernel change, rewrite the container's CDI spec
        (before any GPU is released: no stale spec names a freed GPU). If it
        cannot be written, the kernel goes back to the GPUs held before and
        the ``extra`` ones go back to the pool: the update changes nothing.
        If the kernel cannot be put back, the ``extra`` GPUs stay withheld
        until it is (reconcile) or it is read back."""
        try:
            await self.specs.write(info.container_id, gpus)
        except IsolatorError:
            try:
                await self.devices.configure(info.cgroup, self.policies.of(info.allocated))
            except Exception as e:  # the cgroup may still grant them: keep them held
                logger.error("Container %s: failed to restore its device rules after a failed CDI spec write: %s",
                             info.container_id, e)
                info.withheld |= extra or set()
                await self._settle_withheld(info)
                raise
            await self._give_back(extra or set())
            raise

    async def _update_units(self, info: ContainerRecord, demand: dict[str, int]) -> None:
        """``update`` on a MIG node: per resource, take the extra units (all or
        nothing) and give back the surplus, highest first; ONE ``configure`` of
        the whole policy of what is kept, the CDI spec rewritten, then the
        surplus goes back."""
        container_id = info.container_id
        if info.unknown_state:
            raise IsolatorError(
                f"Container {container_id}: its device state was unknown at recovery (GPUs"
                f" {minors(info.allocated)} are held back for it); it can only be cleaned up"
            )
        held = self.catalog.held(info.allocated)
        wanted = {name: count - held.get(name, 0) for name, count in demand.items() if count > held.get(name, 0)}
        surplus = self.catalog.surplus(info.allocated, demand)
        if not wanted and not surplus:
            return
        extra: set = set(await self.allocator.allocate_resources(wanted)) if wanted else set()
        keep = (info.allocated - surplus) | extra
        try:
            await self.devices.configure(info.cgroup, self.policies.of(keep))
        except BaseException:
            # As for GPUs: never released on a guess (the grant may be in the
            # kernel); held back until the kernel matches the record again.
            info.withheld |= extra
            await self._settle_withheld(info)
            raise
        await self._respec(info, keep, extra)
        info.allocated = keep
        self._arm(info)
        await self._give_back(surplus)
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: granted %s, released %s, highest first (now %s)", container_id,
                        minors(extra), minors(surplus), minors(info.allocated))

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
        if not await self.devices.remove(info.cgroup):
            # The standard set and the control devices stay.
            await self.devices.configure(info.cgroup, self.policies.of(()))
            self._lingering[container_id] = LingeringCgroup(set(), "still has processes")
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, info.cgroup, minors(info.allocated | info.withheld))
        self.infos.pop(container_id, None)
        if info.watchers or info.health is not None:
            self._stop_watching(info)
        if info.unknown_state:
            info.allocated = set()
            waiting = sorted(str(i.container_id) for i in self.infos.values() if i.unknown_state)
            if waiting:
                gpus: set[Gpu] = set()
                logger.warning("Container %s: cleaned up; GPUs %s stay out of the free pool until %s (of unknown"
                               " device state too) are cleaned up", container_id, minors(self._quarantine), waiting)
            else:
                gpus, self._quarantine = self._quarantine, set()
        else:
            gpus, info.allocated, info.withheld = info.allocated | info.withheld, set(), set()
        await self._give_back(gpus)
        if container_id in self._device_dirs:
            await self._remove_device_copies(container_id)
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: cleaned up, released GPUs %s", container_id, minors(gpus))

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
        self._lingering[container_id] = LingeringCgroup(set(), "still has processes")
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
        if self._mig:
            return {str(cid): minors(info.allocated) for cid, info in self.infos.items()}
        return {str(cid): sorted(g.minor for g in info.allocated) for cid, info in self.infos.items()}
