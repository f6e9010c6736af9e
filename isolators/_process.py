"""NvidiaGpuIsolatorProcess: the actor that gives every container exactly the
GPUs it was granted -- the verbs in Mesos' words, carried out by parts it owns.

Rules (Mesos ``gpu/isolator.cpp``, plus what Mesos never finished):
- The allocator actor is the single source of truth for which unit is
  free; the device control actor is the single writer of device rules; the
  volume actor owns the host volume. All of them are reached by dispatch.
- Composed of owned parts with typed interfaces, none reading another's
  state (as libprocess' ``Sequence`` owns a ``SequenceProcess``):
  ``Ordering`` (``_ordering``: calls in their order, a recovery awaited by
  later calls, the error every call leaves with), ``GpuLedger``
  (``_ledger``: every unit taken and why it is not free -- the only place
  that frees one), ``UnitCatalog`` (``_catalog``: whole GPUs and MIG
  devices behind one interface, so every verb has one algorithm), the
  recovery planner (``_recovery``, fed by ``_recovering``), ``KernelRepair``
  (``_repair``: read-backs, drift repair, lingering cgroups, the ledger's
  releases carried out), ``HealthWatches`` (``_health``), ``UsageReader``
  (``_usage``) and ``ContainerSpecs`` (the CDI specs). The actor itself
  keeps the records (id -> cgroup) and the copied device nodes.
- ``create`` probes the host off the event loop (``_startup``: R-FL-2 flags,
  control devices by number), builds device control, spawns the actor and
  returns its handle (``NvidiaGpuIsolator``).
- Every entry point re-validates the container id (``check_container_id``)
  before anything else: a bad or forged id fails with InvalidContainerID and
  no path is ever built from it.
- ``prepare``: nested DEBUG -> None; nested -> launch info only; a known id ->
  "Container has already been prepared"; else allocate, then ONE device
  ``configure`` of the whole policy (deny all; standard set, control devices,
  units), then the launch info (``_launch``). Any failure undoes what was
  done: the cgroup is removed, then the units go back and no record stays
  (if processes of an earlier container hold it, it is stripped of every
  unit and lingers; if it cannot be removed, it lingers WITH its units --
  and when its configure itself failed it may reach any unit, so every free
  one is held back from that moment on -- until a cleanup, prepare or
  reconcile removes it).
- ``update``: per resource, take the extra units (all or nothing) and pick
  the surplus, highest first; write the whole policy of what is kept
  (exactly what a fresh prepare would write, so reconcile sees no drift),
  rewrite the CDI spec, then the surplus goes back. A failed update changes
  nothing; the extra units of a failed one go back only once the kernel is
  known not to grant them. An update asking for what the container holds,
  with nothing in flight, is answered at once.
- ``cleanup`` is idempotent (of an unknown id: nothing to do, unless a
  cgroup of that name exists under the root -- someone else made it --
  which is removed, or denied every unit while processes keep it): the
  cgroup is removed (if processes remain, the units are first denied to it,
  then released, with a warning; the cgroup lingers and a later prepare of
  that id is refused until its processes are gone), the units go back, the
  copied device nodes are removed and the record is forgotten.
- ``recover`` (one at a time, after every call issued before it; every call
  issued after it, usage included, waits for it) plans from the kernel's
  facts and carries the plan out: one reclaim, the records and their units
  in the ledger, the report, every recovered cgroup of known state
  reconciled to its record, the CDI specs. A prepare of an id being
  recovered is refused ("Container has already been prepared") without
  touching its cgroup. Containers of unknown device state may reach any
  unit: every free one is held back for them (the quarantine, shown as
  theirs), and so is every one released, until the last of them is
  cleaned up; they can only be cleaned up.
- The node ledger (SPEC 22): ``create`` joins the ledger ``flags`` name
  (``actors.ledger.node_ledger_dir``; on by default on the real NVML) as
  ``isolator:<work_dir>`` (``serve`` passes ``serve:<socket>``) before the
  actor exists, and says at start where it is or that it is off. Every
  grant names its container as the holder; a unit another front door of
  the node holds is refused by the allocator (an ``IsolatorError`` naming
  the unit's UUID, that owner and its holder). ``recover`` reclaims what
  the kernel says each container holds (with its holder) and then returns
  every unit this owner leased in an earlier run that no container holds.
- ``usage`` (R-IS-5) and ``watch`` (R-IS-9) answer for the units held now;
  usage from readings at most ``flags.nvidia_usage_max_age`` old at once
  (``_usage``), else after one NVML read.
- ``reconcile`` (R-DV-5) repairs each container's kernel state, queued
  behind its other calls, also periodically (``flags.reconcile_interval``,
  on the runtime Clock; a failed run keeps the schedule); withheld units and
  cgroups that could not be removed are settled by reading the kernel back.
- Metrics (``_metrics``): published from initialize to finalize; prepare,
  update, cleanup and each container's reconcile are counted and timed.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
from typing import Any

from actors.devices import DeviceControl, DeviceRule
from actors.flags import Flags
from actors.ledger import isolator_owner
from actors.mig import MigCapabilityError, MigDevice, read_mig_capabilities
from actors.resources import Resources
from runtime import Executor, Future, Process, await_all, delay, spawn

from ._catalog import UnitCatalog
from ._components import NvidiaComponents
from ._container_specs import ContainerSpecs
from ._errors import IsolatorError, as_isolator_error
from ._grant import Policies
from ._health import HealthWatches
from ._launch import build_launch_info, remove_devices_dir, runtime_path
from ._ledger import GpuLedger, Reach
from ._metrics import IsolatorMetrics, measured
from ._ordering import Ordering
from ._recovering import read_recovery_plan
from ._recovery import BROAD, UNKNOWN, minors
from ._repair import KernelRepair, all_repairs
from ._startup import probe_host
from ._types import ContainerClass, ContainerConfig, ContainerID, ContainerLaunchInfo, ContainerLimitation
from ._types import ContainerState, Repair, ResourceStatistics, check_container_id
from ._usage import UsageReader
from .cdi import DriverInjection, hook_program, volume_binaries

logger = logging.getLogger(__name__)


class NvidiaGpuIsolatorProcess(Process):
    """The NVIDIA GPU isolator actor (see the module rules)."""

    def __init__(self, flags: Flags, components: NvidiaComponents, devices: DeviceControl,
                 control_devices: dict[str, DeviceRule], catalog: UnitCatalog | None = None,
                 injection: DriverInjection | None = None) -> None:
        super().__init__()
        self.flags = flags
        self.allocator = components.allocator
        self.volume = components.volume
        self.devices = devices
        self.control_devices = control_devices
        self.catalog = catalog if catalog is not None else UnitCatalog(components.allocator.pools())
        """The units handed out: their rules, grants and resources."""
        self.policies = Policies(control_devices.values(), self.catalog.rules)
        self._executor = Executor(max_workers=2, name="gpu-isolator")
        self.specs = ContainerSpecs(flags.cdi_spec_dir, flags.dev_dir, components.inventory, control_devices,
                                    components.volume, self._executor,
                                    self.catalog.caps if self.catalog.has_mig else None,
                                    injection or DriverInjection(program=hook_program(flags.cdi_hook)))
        """The containers' transient CDI specs (R-CD-1; nothing written without ``cdi_spec_dir``)."""
        self.ledger = GpuLedger()
        """Every unit taken from the allocator, and why it is not free."""
        self.ordering = Ordering()
        self._metrics = IsolatorMetrics()
        """Counts and timers (``_metrics``), published while the actor runs."""
        self.repair = KernelRepair(devices, components.allocator, self.ledger, self.policies, self.catalog)
        self.watches = HealthWatches(components.allocator, self.catalog.pool_of)
        self.usages = UsageReader(components.nvml, components.inventory, self.catalog.has_mig,
                                  flags.nvidia_usage_max_age)
        self.records: dict[ContainerID, str] = {}
        """Each top-level container the isolator knows, and its cgroup (its
        units are in the ledger)."""
        self.recovery_report: list[str] = []
        self._device_dirs: set[ContainerID] = set()
        """Ids (nested too) whose device nodes a prepare copied."""
        self.reconcile_runs = 0
        """Periodic reconciliations completed (``flags.reconcile_interval``)."""
        self._reconcile_timer: Any = None
        self._stopping = False

    # -- construction -----------------------------------------------------
    @classmethod
    async def create(cls, flags: Flags, components: NvidiaComponents,
                     devices: DeviceControl | None = None, *, ledger_owner: str | None = None) -> Any:
        """Check flags, record control devices (off the loop), join the node
        ledger, pick the device backend, spawn; the handle (``NvidiaGpuIsolator``).

        ``devices``: a device control to use instead of building one from the
        flags (tests inject a ``FaultInjectingBackend`` this way); the
        isolator's ``close()`` terminates it either way. ``ledger_owner``: the
        node ledger owner this front door is (default ``isolator:<work_dir>``)."""
        from ._handle import NvidiaGpuIsolator

        host_numbers = dict(components.inventory.control_devices) if components.inventory.kind == "simulated" else None
        pools = components.allocator.pools()
        has_mig = any(isinstance(unit, MigDevice) for units in pools.values() for unit in units)
        executor = Executor(1, name="gpu-isolator-create")
        try:
            control = await executor.run(probe_host, flags, host_numbers)
            caps = await executor.run(read_mig_capabilities, flags.proc_dir) if has_mig else None
            catalog = UnitCatalog(pools, caps, flags.nvidia_mig_strategy)
            binaries = await executor.run(volume_binaries, components.volume.host_path) if flags.cdi_spec_dir else ()
        except MigCapabilityError as e:
            raise IsolatorError(str(e)) from e
        finally:
            executor.shutdown(wait=False)
        await components.join_ledger(ledger_owner or isolator_owner(flags.work_dir))
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
        process = cls(flags, components, devices, control, catalog,
                      DriverInjection(program=hook_program(flags.cdi_hook), binaries=binaries))
        spawn(process)
        return NvidiaGpuIsolator(process, devices)

    def initialize(self) -> None:
        self.ordering.bind(self.pid)
        self.watches.bind(self.pid)
        self._metrics.publish(lambda: len(self.records), lambda: len(self.repair.lingering),
                              lambda: len(self.ledger.held_back()))
        self._schedule_reconcile()

    def finalize(self) -> None:
        self._stopping = True
        self._metrics.close()
        if self._reconcile_timer is not None:
            self._reconcile_timer.cancel()
            self._reconcile_timer = None
        self._executor.shutdown(wait=False)
        self.ordering.close()

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
            return self.ordering.call(container_id, self._nested_launch_info, container_id, config)
        return self.ordering.call(container_id, self._prepare, container_id, config)

    @measured("prepare")
    async def _prepare(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        if container_id in self.records:
            raise IsolatorError("Container has already been prepared")
        demand = self.catalog.demand(config.resources)
        if container_id in self.repair.lingering:
            await self._refuse_while_lingering(container_id)
        if container_id in self.records:  # re-check after the await
            raise IsolatorError("Container has already been prepared")
        cgroup = self.records[container_id] = container_id.value
        touched = False  # whether units were taken and the kernel asked for anything
        configured = False  # whether it answered: the cgroup grants exactly ``units``
        try:
            units: set = (set(await self.allocator.allocate_resources(demand, container_id.value))
                          if any(demand.values()) else set())
            if units:
                self.ledger.hold(container_id, units)
            touched = True
            await self.devices.configure(cgroup, self.policies.of(units))
            configured = True
            launch = await self._launch_info(container_id, config) if config.rootfs is not None else None
            if launch is not None or self.specs.enabled:
                launch = await self.specs.attach(container_id, units, config, launch)
        except BaseException as e:
            if container_id in self._device_dirs:
                await self._remove_device_copies(container_id)
            await self._undo_prepare(container_id, touched, configured)
            logger.warning("Container %s: prepare failed and was undone: %s", container_id, e)
            raise
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: prepared with GPUs %s", container_id, minors(units))
        return launch

    async def _undo_prepare(self, container_id: ContainerID, touched: bool, configured: bool) -> None:
        """Forget the record; its units go back once the kernel says no cgroup
        of it grants them: a configure that failed may have applied anything
        (its effects are unknown when the device worker died), so its cgroup
        may reach any unit until it is removed; while it cannot be, it lingers
        with its units, for a later cleanup or reconcile to finish."""
        self.records.pop(container_id, None)
        if not touched:  # nothing taken, the kernel never asked: nothing there to undo
            return
        try:
            if not configured:
                await self.repair.reaches_any(container_id, Reach.FAILED_PREPARE)
            self.repair.lingering[container_id] = "its prepare failed"
            await self.repair.settle_lingering(container_id)
        except Exception as error:  # keep the original error; what stayed is recorded and logged
            logger.error("Container %s: undoing a failed prepare did not finish: %s", container_id, error)

    async def _refuse_while_lingering(self, container_id: ContainerID) -> None:
        """A cgroup of an earlier container with this id is still there: try to
        remove it once more; refuse the prepare while it stays."""
        try:
            if await self.repair.settle_lingering(container_id):
                return
        except Exception:
            pass
        reason = self.repair.lingering.get(container_id, "it is still there")
        raise IsolatorError(
            f"Container {container_id}: the cgroup '{container_id.path()}' of an earlier container with"
            f" this id {reason}; it cannot be prepared again until it is gone"
        )

    async def _launch_info(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        launch, copied = await build_launch_info(
            self._executor, self.volume, self.flags.runtime_dir, self.flags.dev_dir, container_id, config,
            mig_files=self.catalog.container_files(self.flags.dev_dir))
        if copied:
            self._device_dirs.add(container_id)
        return launch

    async def _nested_launch_info(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        """A nested container's launch info: it shares its top-level container's grant (R-CD-1)."""
        launch = await self._launch_info(container_id, config)
        root = container_id.root()
        if root not in self.records or self.ledger.reaching.get(root) is Reach.UNKNOWN_STATE:
            return launch
        return self.specs.attach_nested(container_id, launch, self.ledger.held(root))

    # -- update ---------------------------------------------------------------
    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        ordering = self.ordering
        if (container_id in self.records and ordering.quiet(container_id)
                and self.ledger.reaching.get(container_id) is not Reach.UNKNOWN_STATE
                and self.catalog.fits(self.ledger.held(container_id), resources)):
            self._metrics.update.runs.inc()
            return None  # nothing to change, and no earlier call on it in flight: done now
        return ordering.call(container_id, self._update, container_id, resources)

    @measured("update")
    async def _update(self, container_id: ContainerID, resources: Resources) -> None:
        cgroup = self.records.get(container_id)
        if cgroup is None:
            raise IsolatorError("Unknown container")
        demand = self.catalog.demand(resources)
        if self.ledger.reaching.get(container_id) is Reach.UNKNOWN_STATE:
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
        extra: set = set(await self.allocator.allocate_resources(wanted, container_id.value)) if wanted else set()
        self.ledger.withhold(container_id, extra)  # its grant is under way: the kernel may have it from now on
        keep = (held - surplus) | extra
        try:
            await self.devices.configure(cgroup, self.policies.of(keep))
        except BaseException:
            # Never released on a guess: the grant may be in the kernel (a
            # device worker that died mid-batch); withheld until the kernel
            # is made to match the record, or read back.
            await self.repair.settle_withheld(container_id, cgroup)
            raise
        await self._respec(container_id, cgroup, keep)
        await self.repair.give_back(self.ledger.enforced(container_id, keep))
        self.watches.rearm(container_id, keep)
        if logger.isEnabledFor(logging.INFO):
            changes = ([f"granted GPUs {minors(extra)}"] if extra else []) + (
                [f"released GPUs {minors(surplus)}, highest minors first"] if surplus else [])
            logger.info("Container %s: %s (now %s)", container_id, "; ".join(changes), minors(keep))

    async def _respec(self, container_id: ContainerID, cgroup: str, units: set) -> None:
        """After an update's kernel change, rewrite the container's CDI spec
        (before any unit is released: no stale spec names a freed GPU). If it
        cannot be written, the kernel goes back to the units held before and
        the extra ones go back to the pool: the update changes nothing. If the
        kernel cannot be put back, the extra units stay withheld until it is
        (reconcile) or it is read back."""
        try:
            await self.specs.write(container_id, units)
        except IsolatorError:
            held = self.ledger.held(container_id)
            try:
                await self.devices.configure(cgroup, self.policies.of(held))
            except Exception as e:  # the cgroup may still grant them: keep them withheld
                logger.error("Container %s: failed to restore its device rules after a failed CDI spec write: %s",
                             container_id, e)
                await self.repair.settle_withheld(container_id, cgroup)
                raise
            await self.repair.give_back(self.ledger.enforced(container_id, held))
            raise

    # -- cleanup --------------------------------------------------------------
    def cleanup(self, container_id: ContainerID) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            if container_id in self._device_dirs:  # only its copied device nodes to remove
                return self.ordering.call(container_id, self._remove_device_copies, container_id)
            return None
        return self.ordering.call(container_id, self._cleanup, container_id)

    @measured("cleanup")
    async def _cleanup(self, container_id: ContainerID) -> None:
        cgroup = self.records.get(container_id)
        if cgroup is None:
            if container_id in self.repair.lingering:
                await self.repair.settle_lingering(container_id)
            else:
                await self.repair.remove_unknown(container_id)
            await self._remove_device_copies(container_id)
            return
        # Until the kernel has removed the cgroup (or, processes inside,
        # denies it every unit) a failure changes nothing: the record and its
        # units stay, and the cleanup can be retried.
        if self.specs.enabled:  # first: a failure here changes nothing, and no spec outlives its GPUs
            await self.specs.remove(container_id)
        removed = await self.devices.remove(cgroup)
        if not removed:
            # The standard set and the control devices stay.
            await self.devices.configure(cgroup, self.policies.of(()))
            self.repair.lingering[container_id] = "still has processes"
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, cgroup, minors(self.ledger.shown(container_id)))
        del self.records[container_id]
        if container_id in self.watches.watched:
            self.watches.forget(container_id)
        reach = self.ledger.reaching.get(container_id)
        released = self.ledger.removed(container_id) if removed else self.ledger.enforced(container_id, ())
        if released.freed or released.held_back:
            await self.repair.give_back(released)
        if reach is Reach.UNKNOWN_STATE and self.ledger.held_back():
            logger.warning("Container %s: cleaned up; GPUs %s stay out of the free pool until %s (which may reach any"
                           " GPU) are cleaned up or repaired", container_id, minors(self.ledger.held_back()),
                           sorted(str(cid) for cid in self.ledger.reaching))
        if container_id in self._device_dirs:
            await self._remove_device_copies(container_id)
        if logger.isEnabledFor(logging.INFO):
            logger.info("Container %s: cleaned up, released GPUs %s", container_id, minors(released.freed))

    async def _remove_device_copies(self, container_id: ContainerID) -> None:
        if container_id not in self._device_dirs:
            return
        self._device_dirs.discard(container_id)
        try:
            await self._executor.run(remove_devices_dir, self.flags.runtime_dir, runtime_path(container_id))
        except OSError as e:
            logger.warning("Container %s: failed to remove its copied device nodes: %s", container_id, e)

    # -- recover ----------------------------------------------------------------
    def recover(self, states: list[ContainerState], orphans: set[ContainerID]) -> Future:
        for state in states:
            check_container_id(getattr(state, "container_id", state))
        for orphan in orphans or ():
            check_container_id(orphan)
        return self.ordering.recover(self._recover, states, orphans)

    async def _recover(self, states: list[ContainerState], orphans: set[ContainerID], earlier: list[Future]) -> None:
        if earlier:
            await await_all(earlier)
        named = [s.container_id for s in states] + sorted(orphans or ())
        plan = await read_recovery_plan(self.devices, self.allocator, self.catalog, named,
                                        lambda: self.records, self.repair.lingering)
        for cid in plan.missing:
            logger.warning("Container %s: couldn't find the cgroup '%s' for recovery", cid, cid.path())
        if plan.claim:
            holders = {unit: container.container_id.value for container in plan.containers
                       for unit in container.gpus}
            await self.allocator.reclaim(plan.claim, holders, plan.quarantine)
        recovered: list[tuple[ContainerID, str]] = []
        for container in plan.containers:
            cid = container.container_id
            if container.kind == UNKNOWN:  # it may reach any unit: the quarantine is held back for it
                self.ledger.reaches_any(cid, Reach.UNKNOWN_STATE)
            else:
                self.ledger.hold(cid, container.gpus)
                recovered.append((cid, container.cgroup))
                if container.kind != BROAD:
                    logger.info("Container %s: recovered with GPUs %s", cid, minors(container.gpus))
            self.records[cid] = container.cgroup
        await self.repair.give_back(self.ledger.hold_back(plan.quarantine))
        for line in plan.report:
            self._report(line)
        for cid, cgroup in recovered:  # the kernel may hold more, or other rules, than the record
            lines, failed = await self.repair.enforce_record(cid, cgroup)
            for line in lines:
                self._metrics.repairs.inc()
                self._report(f"Container {cid}: recovery repaired its device rules: {line}")
            if failed is not None:
                self._report(f"Container {cid}: recovery {failed.description}")
        returned = await self.allocator.release_unclaimed()
        if returned:
            logger.info("Recovery: units %s this front door leased in the node ledger before it stopped, held by no"
                        " container now, went back", returned)
        unknown = [cid for cid in self.records if self.ledger.reaching.get(cid) is Reach.UNKNOWN_STATE]
        known = {cid: self.ledger.held(cid) for cid in self.records if cid not in unknown}
        try:
            lines, errors = await self.specs.recover(known, unknown)
            for line in lines:
                self._report(line)
            for line in errors:  # a spec nobody could read, moved aside (SPEC R-SH-3)
                self._report(line, logging.ERROR)
        except IsolatorError as e:  # the kernel and the allocator are recovered; say what the specs lack
            self._report(f"The CDI specs could not be brought in line with the recovered containers: {e}")

    def _report(self, line: str, level: int = logging.WARNING) -> None:
        logger.log(level, "%s", line)
        self.recovery_report.append(line)

    # -- reconcile ----------------------------------------------------------------
    def reconcile(self) -> Any:
        """R-DV-5: make every container's kernel device state match its record;
        the repairs made (empty when nothing drifted). Each container's repair
        waits behind its earlier calls; a cleaned-up container is skipped."""
        runs = [self.ordering.call(cid, self._reconcile_one, cid) for cid in sorted(self.records)]
        runs += [self.ordering.call(cid, self.repair.reconcile_lingering, cid) for cid in self.repair.to_settle()]
        return all_repairs(runs)

    @measured("reconcile")
    async def _reconcile_one(self, cid: ContainerID) -> list[Repair]:
        """One container's repairs; units withheld for it go back once the kernel enforces its record."""
        cgroup = self.records.get(cid)
        if cgroup is None or self.ledger.reaching.get(cid) is Reach.UNKNOWN_STATE:
            return []
        lines, failed = await self.repair.enforce_record(cid, cgroup)
        repairs = [Repair(str(cid), line) for line in lines]
        for line in lines:
            logger.warning("Container %s: drift repaired: %s", cid, line)
        if failed is not None:
            self._metrics.repairs.inc(len(repairs))
            return repairs + [failed]
        line = await self.specs.ensure(cid, self.ledger.held(cid))
        if line is not None:
            logger.warning("Container %s: drift repaired: %s", cid, line)
            repairs.append(Repair(str(cid), line))
        released = self.ledger.enforced(cid, self.ledger.held(cid))  # the kernel enforces the record now
        if released.freed or released.held_back:
            await self.repair.give_back(released)
            units = minors(released.freed | released.held_back)
            logger.info("Container %s: GPUs %s, held back while its kernel state was unknown, released", cid, units)
            repairs.append(Repair(str(cid), f"released GPUs {units} held back while its kernel state was unknown"))
        self._metrics.repairs.inc(len(repairs))
        return repairs

    def _schedule_reconcile(self) -> None:
        interval = self.flags.reconcile_interval
        if interval is not None and not self._stopping:
            self._reconcile_timer = delay(interval, self.pid, type(self)._periodic_reconcile)

    async def _periodic_reconcile(self) -> None:
        self._reconcile_timer = None
        try:
            repairs = await self.reconcile()
            self.reconcile_runs += 1
            failed = [repair for repair in repairs if repair.failed]
            if len(repairs) > len(failed):
                logger.warning("Periodic reconcile repaired %d drifted device rules", len(repairs) - len(failed))
            if failed:
                logger.error("Periodic reconcile could not repair containers %s",
                             sorted({repair.container_id for repair in failed}))
        except Exception as e:  # keep the schedule: the next run may succeed
            logger.error("Periodic reconcile failed: %s", e)
        finally:
            self._schedule_reconcile()

    # -- usage, watch, containers ------------------------------------------------------
    def usage(self, container_id: ContainerID) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        if not self.ordering.quiet(container_id):  # answer in arrival order
            return self.ordering.call(container_id, self._usage_in_order, container_id)
        return self._usage_now(container_id)

    async def _usage_in_order(self, container_id: ContainerID) -> ResourceStatistics:
        result = self._usage_now(container_id)
        return result if isinstance(result, ResourceStatistics) else await result

    def _usage_now(self, container_id: ContainerID) -> Any:
        if container_id not in self.records:
            raise IsolatorError("Unknown container")
        return self.usages.read(self.ledger.shown(container_id))

    def watch(self, container_id: ContainerID) -> Any:
        """R-IS-9: a Future of a ContainerLimitation, raised when one of the
        units the container holds (now, after any update) turns unhealthy;
        discarded at cleanup, or when the caller discards it."""
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        return self._unboxed(self.ordering.call(container_id, self._watch, container_id))

    @staticmethod
    async def _unboxed(call: Any) -> Future[ContainerLimitation]:
        """The watch Future travels boxed: the sequence must not wait for it."""
        (future,) = await call
        return future

    async def _watch(self, container_id: ContainerID) -> tuple[Future]:
        if container_id not in self.records:
            raise IsolatorError("Unknown container")
        return (self.watches.watch(container_id, self.ledger.shown(container_id)),)

    def containers(self) -> dict[str, list[int]]:
        """The containers known and the minors each holds (for scripts and tests);
        a MIG device is written ``195:0/gi3/ci0``."""
        return {str(cid): minors(self.ledger.shown(cid)) for cid in self.records}
