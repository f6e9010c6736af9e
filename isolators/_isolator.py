"""NvidiaGpuIsolatorProcess: gives every container exactly the GPUs it was granted.

Rules (Mesos ``gpu/isolator.cpp``, plus what Mesos never finished):
- One actor holds per-container facts only (cgroup, GPUs held). The allocator
  actor is the single source of truth for which GPU is free; the device
  control actor is the single writer of device rules; the volume actor owns
  the host volume. All of them are reached by dispatch.
- ``create`` refuses to start without ``cgroups/devices`` (or ``cgroups/all``
  with the devices subsystem) and ``filesystem/linux`` (R-FL-2), and records
  the control devices by number (R-IS-1).
- Calls for one container apply in arrival order (each waits for the
  previous call on that id; ``usage`` too, while a call on it is in flight);
  calls for different containers run concurrently.
- ``prepare``: nested DEBUG -> None; nested -> launch info only; a known id ->
  "Container has already been prepared"; else allocate, then ONE device
  ``configure`` of the whole policy (deny all; standard set, control devices,
  GPUs), then the launch info. Any failure undoes what was done: the GPUs go
  back, the cgroup is removed (if processes of an earlier container hold it,
  it is stripped of every GPU and remembered as lingering), no record stays.
- Every entry point re-validates the container id (``check_container_id``)
  before anything else: a bad or forged id fails with InvalidContainerID and
  no path is ever built from it.
- ``update`` grows by allocating and allowing; shrinks by writing the policy
  of the GPUs it keeps (exactly what a fresh prepare would write, so the
  surplus is denied and reconcile sees no drift) and then releasing the
  highest minors first. A failed update changes nothing.
- ``cleanup`` is idempotent: the cgroup is removed (if processes remain, the
  GPUs are first denied to it, then released, with a warning; the cgroup is
  remembered as lingering and a later prepare of that id is refused until
  its processes are gone), the GPUs go back, the copied device nodes are
  removed and the record is forgotten.
- The device nodes a prepare copies are its own: a failed copy removes the
  nodes and directories it made (nothing else), cleanup removes the
  container's devices directory.
- ``recover`` re-claims the GPUs each surviving cgroup may access (v1
  ``devices.list``; v2 the checkpoint). A cgroup under the root whose device
  state is unknown keeps every GPU it might hold out of the free pool until it
  is cleaned up, and is reported; so do cgroups nobody named (orphans).
  Several such cgroups share one quarantine: any of them may use any of its
  GPUs, so none goes back to the pool before the last of them is cleaned
  up. Such a container cannot be updated, only cleaned up.
  Exact grants are claimed first; a cgroup granting GPUs by wildcard (a crash
  between its mkdir and its rules, a wiped policy) then keeps only the GPUs
  nobody else holds. Every recovered cgroup is reconciled to its recovered
  policy (the kernel may lag the record after a crash), repairs reported.
- ``watch`` (R-IS-9) follows the GPUs the container holds now (re-armed at
  every update); its Futures are discarded at cleanup.
- ``reconcile`` (R-DV-5) repairs each container's kernel state, queued behind
  its other calls; ``flags.reconcile_interval`` runs it periodically on the
  runtime Clock (scheduled at initialize, cancelled at finalize).
- A ``SimulatedCrash`` from device control (fault injection) fails the call
  with an ``IsolatorError`` and every later call too: the agent is "dead";
  drop every actor and recover.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from typing import Any, Iterable

from actors import NVIDIA_MAJOR, Gpu
from actors.devices import DeviceControl, DeviceRule, SimulatedCrash, container_policy
from actors.flags import Flags
from actors.resources import Resources
from actors.volume import copy_device_nodes, nvidia_device_nodes
from runtime import Executor, Future, Process, Promise, defer, delay, dispatch, spawn, terminate, wait

from ._components import NvidiaComponents
from ._errors import IsolatorError
from ._types import (
    MS_BIND,
    MS_RDONLY,
    MS_REC,
    ContainerClass,
    ContainerConfig,
    ContainerID,
    ContainerLaunchInfo,
    ContainerLimitation,
    ContainerMountInfo,
    ContainerState,
    GpuStatistics,
    Repair,
    ResourceStatistics,
    check_container_id,
)

logger = logging.getLogger(__name__)

REQUIRED_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_CONTROL_DEVICES = ("nvidia-uvm-tools", "nvidia-modeset")


def gpu_rule(gpu: Gpu) -> DeviceRule:
    """The device rule that grants one GPU (read, write, mknod as in Mesos)."""
    return DeviceRule("c", gpu.major, gpu.minor, "rwm")


def requested_gpus(resources: Resources) -> int:
    """The whole number of GPUs ``resources`` asks for (0 when absent)."""
    if "gpus" in resources.others:  # a range or set: never read as "no GPUs"
        raise IsolatorError("The 'gpus' resource must be an unsigned integer")
    gpus = resources.gpus()
    value = gpus if gpus is not None else 0.0
    if int(round(value * 1000)) % 1000 != 0:
        raise IsolatorError("The 'gpus' resource must be an unsigned integer")
    return int(round(value))


class _Info:
    """What the isolator knows of one top-level container."""

    __slots__ = ("container_id", "cgroup", "allocated", "unknown_state", "watchers", "health")

    def __init__(self, container_id: ContainerID, cgroup: str) -> None:
        self.container_id = container_id
        self.cgroup = cgroup
        self.allocated: set[Gpu] = set()
        self.unknown_state = False
        self.watchers: list[Promise] = []
        """Promises of ContainerLimitation handed out by ``watch``."""
        self.health: Future | None = None
        """The allocator's watch of ``allocated`` while there are watchers."""


def check_isolation(flags: Flags) -> None:
    """R-FL-2: the isolators the GPU isolator needs, with Mesos' messages."""
    tokens = [t.strip() for t in flags.isolation.split(",") if t.strip()]
    if "cgroups/all" in tokens:
        if not _devices_subsystem_enabled():
            raise IsolatorError("The `devices` cgroups subsystem is not enabled by the kernel")
    elif "cgroups/devices" not in tokens:
        raise IsolatorError(
            "The 'cgroups/devices' or 'cgroups/all' isolator must be enabled in order to use the 'gpu/nvidia' isolator"
        )
    if "filesystem/linux" not in tokens:
        raise IsolatorError("The 'filesystem/linux' isolator must be enabled in order to use the 'gpu/nvidia' isolator")


def _devices_subsystem_enabled() -> bool:
    try:
        with open("/proc/cgroups") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == "devices":
                    return fields[-1] == "1"
    except OSError:
        pass
    # cgroup2 controls devices through eBPF, always available there.
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def find_control_devices(flags: Flags, host_numbers: dict[str, str] | None) -> dict[str, DeviceRule]:
    """R-IS-1: the control devices by number, from ``dev_dir`` or the host file.

    Blocking (stat, maybe ``nvidia-modprobe``): run it through an executor.
    """
    dev_dir = flags.dev_dir
    present = os.path.exists(os.path.join(dev_dir, "nvidiactl"))
    if not present and host_numbers is not None:
        rules = {}
        for name, numbers in host_numbers.items():
            major, minor = (int(x) for x in str(numbers).split(":"))
            rules[os.path.join(dev_dir, name)] = DeviceRule("c", major, minor, "rwm")
        return rules
    uvm = os.path.join(dev_dir, "nvidia-uvm")
    if present and not os.path.exists(uvm):
        try:
            subprocess.run(["nvidia-modprobe", "-u", "-c", "0"], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise IsolatorError(f"Failed to load '{uvm}': {e}") from None
    rules = {}
    for name in REQUIRED_CONTROL_DEVICES + OPTIONAL_CONTROL_DEVICES:
        path = os.path.join(dev_dir, name)
        try:
            st = os.stat(path)
        except OSError as e:
            if name in REQUIRED_CONTROL_DEVICES:
                raise IsolatorError(f"Failed to obtain device ID for '{path}': {e.strerror}") from None
            continue
        rules[path] = DeviceRule("c", os.major(st.st_rdev), os.minor(st.st_rdev), "rwm")
    return rules


class NvidiaGpuIsolatorProcess(Process):
    """The NVIDIA GPU isolator actor (see the module rules)."""

    def __init__(self, flags: Flags, components: NvidiaComponents, devices: DeviceControl,
                 control_devices: dict[str, DeviceRule]) -> None:
        super().__init__()
        self.flags = flags
        self.allocator = components.allocator
        self.volume = components.volume
        self.nvml = components.nvml
        self.inventory = components.inventory
        self.devices = devices
        self.control_devices = control_devices
        self.infos: dict[ContainerID, _Info] = {}
        self._tails: dict[ContainerID, Future] = {}
        self._policies: dict[frozenset[Gpu], tuple[tuple[DeviceRule, ...], tuple[DeviceRule, ...]]] = {}
        """Container policies by GPU set (pure; churn repeats a few)."""
        self._executor = Executor(max_workers=2, name="gpu-isolator")
        self.recovery_report: list[str] = []
        self._quarantine: set[Gpu] = set()
        """GPUs held back for every container whose device state was unknown at recovery."""
        self._lingering: set[ContainerID] = set()
        """Ids whose cgroup a cleanup had to leave (processes still inside)."""
        self._device_dirs: set[ContainerID] = set()
        """Ids (nested too) whose device nodes a prepare copied."""
        self.reconcile_runs = 0
        """Periodic reconciliations completed (``flags.reconcile_interval``)."""
        self._crashed: SimulatedCrash | None = None
        self._reconcile_timer: Any = None
        self._stopping = False

    # -- construction -----------------------------------------------------
    @classmethod
    async def create(cls, flags: Flags, components: NvidiaComponents,
                     devices: DeviceControl | None = None) -> "MesosIsolator":
        """Check flags, pick the device backend, record control devices, spawn.

        ``devices``: a device control to use instead of building one from the
        flags (tests inject a ``FaultInjectingBackend`` this way); the
        isolator's ``close()`` terminates it either way."""
        check_isolation(flags)
        host_numbers = dict(components.inventory.control_devices) if components.inventory.kind == "simulated" else None
        executor = Executor(1, name="gpu-isolator-create")
        try:
            control = await executor.run(find_control_devices, flags, host_numbers)
        finally:
            executor.shutdown(wait=False)
        if devices is None:
            devices = await DeviceControl.create(
                backend=flags.device_backend,
                hierarchy=flags.cgroups_hierarchy,
                cgroups_root=flags.cgroups_root,
                work_dir=flags.work_dir,
                worker=flags.device_worker,
            )
        process = cls(flags, components, devices, control)
        spawn(process)
        return MesosIsolator(process, devices)

    def initialize(self) -> None:
        self._schedule_reconcile()

    def finalize(self) -> None:
        self._stopping = True
        if self._reconcile_timer is not None:
            self._reconcile_timer.cancel()
            self._reconcile_timer = None
        self._executor.shutdown(wait=False)

    # -- periodic drift repair (R-DV-5, ``flags.reconcile_interval``) ----------
    def _schedule_reconcile(self) -> None:
        interval = self.flags.reconcile_interval
        if interval is not None and not self._stopping:
            self._reconcile_timer = delay(interval, self.pid, NvidiaGpuIsolatorProcess._periodic_reconcile)

    async def _periodic_reconcile(self) -> None:
        self._reconcile_timer = None
        try:
            repairs = await self.reconcile()
            self.reconcile_runs += 1
            if repairs:
                logger.warning("Periodic reconcile repaired %d drifted device rules", len(repairs))
        except Exception as e:  # keep the schedule: the next run may succeed
            logger.error("Periodic reconcile failed: %s", e)
        finally:
            self._schedule_reconcile()

    def supports_nesting(self) -> bool:
        return True

    def supports_standalone(self) -> bool:
        return True

    # -- per-container ordering ---------------------------------------------
    def _serialized(self, container_id: ContainerID, operation: Any, *args: Any) -> Any:
        """Run ``operation(*args)`` after every earlier call on this container."""
        previous = self._tails.get(container_id)
        done: Promise = Promise()
        self._tails[container_id] = done.future
        return self._in_order(container_id, previous, done, operation, args)

    async def _in_order(self, container_id: ContainerID, previous: Future | None, done: Promise,
                        operation: Any, args: tuple) -> Any:
        try:
            if previous is not None and previous.is_pending():
                await previous
            if self._crashed is not None:
                raise SimulatedCrash(f"the agent crashed earlier ({self._crashed})")
            return await operation(*args)
        except SimulatedCrash as crash:
            # Fault injection: the agent "died" in this call. Fail it as an
            # Exception (a BaseException would never complete its Future)
            # and refuse every later call; drop every actor and recover.
            while isinstance(crash.__context__, SimulatedCrash):  # an undo hit the dead backend
                crash = crash.__context__
            self._crashed = self._crashed or crash
            raise IsolatorError(
                f"Container {container_id}: simulated crash of the agent: {crash};"
                " drop every actor and recover"
            ) from crash
        finally:
            done.set_value(None)
            if self._tails.get(container_id) is done.future:
                del self._tails[container_id]

    # -- the policy ---------------------------------------------------------
    def _gpu_rules(self, gpus: Iterable[Gpu]) -> list[DeviceRule]:
        return [gpu_rule(g) for g in sorted(gpus)]

    def _policy(self, gpus: Iterable[Gpu]) -> tuple[tuple[DeviceRule, ...], tuple[DeviceRule, ...]]:
        key = frozenset(gpus)
        policy = self._policies.get(key)
        if policy is None:
            allow, deny = container_policy(list(self.control_devices.values()), self._gpu_rules(key))
            if len(self._policies) >= 256:
                self._policies.clear()
            policy = self._policies[key] = (tuple(allow), tuple(deny))
        return policy

    # -- recover --------------------------------------------------------------
    async def recover(self, states: list[ContainerState], orphans: set[ContainerID]) -> None:
        for state in states:
            check_container_id(getattr(state, "container_id", state))
        for orphan in orphans or ():
            check_container_id(orphan)
        total = self.allocator.total()
        named: list[ContainerID] = [s.container_id for s in states] + sorted(orphans or ())
        known = {cid.value for cid in named if not cid.has_parent()}
        known |= {cid.value for cid in self.infos} | {cid.value for cid in self._lingering}
        existing = {c for c in await self.devices.list_cgroups() if "/" not in c}
        for name in sorted(existing - known):
            try:
                cid = ContainerID(name)
            except ValueError:
                self._report(f"cgroup '{name}' under the isolator root is not a container id; left alone")
                continue
            self._report(f"Container {cid}: cgroup found under the root but named by no state; recovered as an orphan")
            named.append(cid)
        unknown: list[_Info] = []
        broad: list[tuple[_Info, set[Gpu]]] = []
        claimed: set[Gpu] = set()
        for cid in named:
            if cid.has_parent() or cid in self.infos:
                continue
            cgroup = cid.path()
            if cgroup not in existing:
                logger.warning("Container %s: couldn't find the cgroup '%s' for recovery", cid, cgroup)
                continue
            info = _Info(cid, cgroup)
            state = await self.devices.state(cgroup)
            if state is None:
                info.unknown_state = True
                unknown.append(info)
                self.infos[cid] = info
                continue
            gpus = {g for g in total if state.is_granted("c", g.major, g.minor, "rw")}
            self.infos[cid] = info
            if gpus & claimed or any(_covers_gpus(rule) for rule in state.allow):
                broad.append((info, gpus))  # after every exact claim (see below)
                continue
            if gpus:
                await self.allocator.reclaim(gpus)
            claimed |= gpus
            info.allocated = gpus
            logger.info("Container %s: recovered with GPUs %s", cid, _minors(gpus))
            await self._reconcile_recovered(info)
        # A cgroup whose rules grant GPUs by wildcard (a crash between its
        # mkdir and its first rule, or a wipe) keeps the GPUs it may use
        # that no other container holds, and its rules are rewritten to
        # exactly those: no GPU is ever granted to two containers.
        for info, may_use in broad:
            held = set((await self.allocator.state()).allocated)
            keep = {g for g in may_use if g not in held}
            if keep:
                await self.allocator.reclaim(keep)
            info.allocated = keep
            self._report(
                f"Container {info.container_id}: cgroup '{info.cgroup}' grants GPUs beyond exact rules"
                f" (an interrupted start or a wiped policy); it keeps GPUs {_minors(keep)} that no other"
                " container holds, and its device rules are rewritten to exactly those"
            )
            await self._reconcile_recovered(info)
        # Unknown device states share one quarantine (see the rules): each
        # of them may use any GPU nobody else holds.
        for info in unknown:
            state = await self.allocator.state()
            held = set(state.allocated)
            free = {g for g in total if g not in held}
            if free:
                await self.allocator.reclaim(free)
            self._quarantine |= free
            info.allocated = self._quarantine  # shared on purpose; never mutated through an info
            self._report(
                f"Container {info.container_id}: cgroup '{info.cgroup}' exists but its device state is unknown"
                f" (no checkpoint entry); GPUs {_minors(self._quarantine)} are kept out of the free pool until"
                " it (and every other container of unknown state) is cleaned up"
            )

    async def _reconcile_recovered(self, info: _Info) -> None:
        """Make the kernel enforce a recovered container's policy: after a crash
        the kernel may lag its record (v2: the checkpoint is written first)."""
        allow, deny = self._policy(info.allocated)
        for line in await self.devices.reconcile(info.cgroup, allow, deny):
            self._report(f"Container {info.container_id}: recovery repaired its device rules: {line}")

    def _report(self, line: str) -> None:
        logger.warning("%s", line)
        self.recovery_report.append(line)

    # -- prepare --------------------------------------------------------------
    def prepare(self, container_id: ContainerID, config: ContainerConfig) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            if config.container_class == ContainerClass.DEBUG:
                return None
            return self._serialized(container_id, self._launch_info, container_id, config)
        return self._serialized(container_id, self._prepare, container_id, config)

    async def _prepare(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        if container_id in self.infos:
            raise IsolatorError("Container has already been prepared")
        requested = requested_gpus(config.resources)
        if container_id in self._lingering and not await self._retry_lingering(container_id):
            raise IsolatorError(
                f"Container {container_id}: the cgroup '{container_id.path()}' of an earlier container with"
                " this id still has processes; it cannot be prepared again until they are gone"
            )
        if container_id in self.infos:  # re-check after the await
            raise IsolatorError("Container has already been prepared")
        info = _Info(container_id, container_id.path())
        self.infos[container_id] = info
        configured = False
        try:
            gpus: set[Gpu] = set(await self.allocator.allocate(requested)) if requested else set()
            info.allocated = gpus
            allow, deny = self._policy(gpus)
            await self.devices.configure(info.cgroup, allow, deny)
            configured = True
            launch = await self._launch_info(container_id, config) if config.rootfs is not None else None
        except BaseException as e:
            await self._undo_prepare(info, configured)
            logger.warning("Container %s: prepare failed and was undone: %s", container_id, e)
            raise
        logger.info("Container %s: prepared with GPUs %s", container_id, _minors(info.allocated))
        return launch

    async def _undo_prepare(self, info: _Info, configured: bool) -> None:
        if self.infos.get(info.container_id) is info:
            del self.infos[info.container_id]
        if configured or await self.devices.exists(info.cgroup):
            try:
                if not await self.devices.remove(info.cgroup):
                    # Processes of an earlier container are inside: take the GPUs back from them.
                    allow, deny = self._policy(())
                    await self.devices.configure(info.cgroup, allow, deny)
                    self._lingering.add(info.container_id)
            except Exception as e:  # keep undoing; report what stayed
                logger.error("Container %s: failed to remove cgroup '%s' while undoing prepare: %s",
                             info.container_id, info.cgroup, e)
                return  # the cgroup still grants the GPUs: keep them out of the pool
        if info.allocated:
            await self.allocator.deallocate(info.allocated)
            info.allocated = set()

    async def _launch_info(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        if config.rootfs is None:
            return None
        manifest = config.docker_manifest
        if manifest is None:
            raise IsolatorError("The 'ContainerConfig' for docker is missing a manifest")
        inject = self.volume.should_inject(manifest)
        env = self.volume.env(manifest) if inject else None
        devices_dir = os.path.join(self.flags.runtime_dir, "containers", _runtime_path(container_id), "devices")
        mounts, copied = await self._executor.run(
            _prepare_filesystem, config.rootfs, inject, self.volume.host_path, self.volume.container_path,
            self.flags.dev_dir, devices_dir,
        )
        if copied:
            self._device_dirs.add(container_id)
        launch = ContainerLaunchInfo(mounts=mounts)
        if env is not None:
            if config.has_task_info:
                launch.task_environment = env
            else:
                launch.environment = env
        return launch

    # -- update ---------------------------------------------------------------
    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        info = self.infos.get(container_id)
        if (info is not None and container_id not in self._tails and self._crashed is None
                and not info.unknown_state and requested_gpus(resources) == len(info.allocated)):
            return None  # nothing to change, and no earlier call on it in flight: done now
        return self._serialized(container_id, self._update, container_id, resources)

    async def _update(self, container_id: ContainerID, resources: Resources) -> None:
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        requested = requested_gpus(resources)
        if info.unknown_state:
            raise IsolatorError(
                f"Container {container_id}: its device state was unknown at recovery (GPUs"
                f" {_minors(info.allocated)} are held back for it); it can only be cleaned up"
            )
        held = len(info.allocated)
        if requested > held:
            extra = set(await self.allocator.allocate(requested - held))
            try:
                await self.devices.reconfigure(info.cgroup, self._gpu_rules(extra), [])
            except BaseException:
                await self.allocator.deallocate(extra)
                raise
            info.allocated = info.allocated | extra
            self._arm(info)
            logger.info("Container %s: granted GPUs %s (now %s)", container_id, _minors(extra), _minors(info.allocated))
        elif requested < held:
            surplus = set(sorted(info.allocated, reverse=True)[: held - requested])
            keep = info.allocated - surplus
            # The whole policy of the GPUs kept, not a bare deny: the model would
            # then also deny mknod of the surplus, which a fresh prepare allows
            # (c *:* m), and reconcile/recovery would see that as drift.
            allow, deny = self._policy(keep)
            await self.devices.configure(info.cgroup, allow, deny)
            info.allocated = keep
            self._arm(info)
            await self.allocator.deallocate(surplus)
            logger.info("Container %s: released GPUs %s, highest minors first (now %s)",
                        container_id, _minors(surplus), _minors(info.allocated))

    # -- usage ----------------------------------------------------------------
    def usage(self, container_id: ContainerID) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        if container_id in self._tails:  # a call on it is in flight: answer after it (arrival order)
            return self._serialized(container_id, self._usage_in_order, container_id)
        return self._usage_now(container_id)

    async def _usage_in_order(self, container_id: ContainerID) -> ResourceStatistics:
        result = self._usage_now(container_id)
        return result if isinstance(result, ResourceStatistics) else await result

    def _usage_now(self, container_id: ContainerID) -> Any:
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        gpus = sorted(info.allocated)
        if not gpus:
            return ResourceStatistics(timestamp=time.time(), gpus_allocated=0)
        return self._usage(gpus)

    async def _usage(self, gpus: list[Gpu]) -> ResourceStatistics:
        readings = await self.nvml.usages(gpus)
        by_gpu = self.inventory.by_gpu()
        stats = []
        for gpu in gpus:
            r = readings.get(gpu)
            info = by_gpu.get(gpu)
            stats.append(GpuStatistics(
                minor=gpu.minor,
                uuid=info.uuid if info is not None else None,
                memory_used_bytes=r.memory_used_bytes if r else None,
                memory_total_bytes=r.memory_total_bytes if r else None,
                utilization_gpu_percent=r.utilization_gpu_percent if r else None,
                utilization_memory_percent=r.utilization_memory_percent if r else None,
                power_milliwatts=r.power_mw if r else None,
                temperature_celsius=r.temperature_c if r else None,
            ))
        return ResourceStatistics(timestamp=time.time(), gpus_allocated=len(gpus), gpus=stats)

    # -- cleanup --------------------------------------------------------------
    def cleanup(self, container_id: ContainerID) -> Any:
        check_container_id(container_id)
        if container_id.has_parent():
            if container_id in self._device_dirs:  # only its copied device nodes to remove
                return self._serialized(container_id, self._remove_device_copies, container_id)
            return None
        return self._serialized(container_id, self._cleanup, container_id)

    async def _cleanup(self, container_id: ContainerID) -> None:
        info = self.infos.get(container_id)
        if info is None:
            if container_id in self._lingering:
                await self._retry_lingering(container_id)
            else:
                logger.debug("Container %s: ignoring cleanup request for unknown container", container_id)
            await self._remove_device_copies(container_id)
            return
        removed = await self.devices.remove(info.cgroup)
        if not removed:
            # Processes remain: the cgroup keeps the standard set and the
            # control devices, and loses every GPU (whatever it held).
            allow, deny = self._policy(())
            await self.devices.configure(info.cgroup, allow, deny)
            self._lingering.add(container_id)
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, info.cgroup, _minors(info.allocated))
        self.infos.pop(container_id, None)
        watchers, info.watchers = info.watchers, []
        for watcher in watchers:
            watcher.discard()
        self._arm(info)
        if info.unknown_state:
            info.allocated = set()
            waiting = sorted(str(i.container_id) for i in self.infos.values() if i.unknown_state)
            if waiting:
                gpus: set[Gpu] = set()
                logger.warning("Container %s: cleaned up; GPUs %s stay out of the free pool until %s (of unknown"
                               " device state too) are cleaned up", container_id, _minors(self._quarantine), waiting)
            else:
                gpus, self._quarantine = self._quarantine, set()
        else:
            gpus, info.allocated = info.allocated, set()
        if gpus:
            await self.allocator.deallocate(gpus)
        if container_id in self._device_dirs:
            await self._remove_device_copies(container_id)
        logger.info("Container %s: cleaned up, released GPUs %s", container_id, _minors(gpus))

    async def _retry_lingering(self, container_id: ContainerID) -> bool:
        """Remove the cgroup a cleanup had to leave; True once it is gone."""
        if await self.devices.remove(container_id.path()):
            self._lingering.discard(container_id)
            logger.info("Container %s: removed the cgroup its processes had kept", container_id)
            return True
        return False

    async def _remove_device_copies(self, container_id: ContainerID) -> None:
        if container_id not in self._device_dirs:
            return
        self._device_dirs.discard(container_id)
        try:
            await self._executor.run(_remove_devices_dir, self.flags.runtime_dir, _runtime_path(container_id))
        except OSError as e:
            logger.warning("Container %s: failed to remove its copied device nodes: %s", container_id, e)

    # -- beyond Mesos -----------------------------------------------------------
    def watch(self, container_id: ContainerID) -> Any:
        """R-IS-9: a Future of a ContainerLimitation, raised when one of the
        GPUs the container holds (now, after any update) turns unhealthy;
        discarded at cleanup, or when the caller discards it."""
        check_container_id(container_id)
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        return self._serialized(container_id, self._watch, container_id)

    async def _watch(self, container_id: ContainerID) -> Future:
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        promise: Promise = Promise()
        info.watchers.append(promise)
        promise.on_discard(defer(self.pid, lambda: self._unwatch(info, promise)))
        if info.health is None:
            self._arm(info)
        return promise.future

    def _unwatch(self, info: _Info, promise: Promise) -> None:
        if promise in info.watchers:
            info.watchers.remove(promise)
            promise.discard()
            if not info.watchers:
                self._arm(info)  # nobody watches: stop the allocator's watch

    def _arm(self, info: _Info) -> None:
        """(Re)watch the GPUs ``info`` holds now, while anybody watches it."""
        old, info.health = info.health, None
        if old is not None:
            old.discard()
        if not info.watchers:
            return
        health = self.allocator.watch(set(info.allocated))
        info.health = health
        health.on_ready(defer(self.pid, lambda event: self._unhealthy(info, health, event)))

    def _unhealthy(self, info: _Info, health: Future, event: Any) -> None:
        if info.health is not health:
            return  # re-armed or cleaned up since: stale
        info.health = None
        cid = info.container_id
        message = f"GPU {event.gpu} of container {cid} became unhealthy: {event.reason}"
        logger.warning("Container %s: %s", cid, message)
        limitation = ContainerLimitation(resources=Resources.parse("gpus:1"), message=message)
        watchers, info.watchers = info.watchers, []
        for watcher in watchers:
            watcher.set_value(limitation)

    async def reconcile(self) -> list[Repair]:
        """R-DV-5: make every container's kernel device state match its record;
        the repairs made (empty when nothing drifted). Each container's repair
        waits behind its earlier calls, so it never races a prepare, update or
        cleanup of it (a cleaned-up container is skipped, never recreated)."""
        runs = [self._serialized(cid, self._reconcile_one, cid) for cid in sorted(self.infos)]
        repairs: list[Repair] = []
        failure: Exception | None = None
        for run in runs:  # await every one, so none is left queued
            try:
                repairs += await run
            except Exception as e:
                failure = failure or e
        if failure is not None:
            raise failure
        return repairs

    async def _reconcile_one(self, cid: ContainerID) -> list[Repair]:
        info = self.infos.get(cid)
        if info is None or info.unknown_state:
            return []
        allow, deny = self._policy(info.allocated)
        repairs = []
        for line in await self.devices.reconcile(info.cgroup, allow, deny):
            logger.warning("Container %s: drift repaired: %s", cid, line)
            repairs.append(Repair(str(cid), line))
        return repairs

    def containers(self) -> dict[str, list[int]]:
        """The containers known and the minors each holds (for scripts and tests)."""
        return {str(cid): sorted(g.minor for g in info.allocated) for cid, info in self.infos.items()}


def _covers_gpus(rule: DeviceRule) -> bool:
    """Whether an allow rule grants read or write to NVIDIA devices by wildcard."""
    return (
        rule.type in ("a", "c")
        and rule.major in (None, NVIDIA_MAJOR)
        and rule.minor is None
        and ("r" in rule.access or "w" in rule.access)
    )


def _minors(gpus: Iterable[Gpu]) -> list[int]:
    return sorted(g.minor for g in gpus)


def _runtime_path(container_id: ContainerID) -> str:
    # Mesos' layout: containers/<parent>/containers/<child>.
    check_container_id(container_id)
    parts = []
    cid: ContainerID | None = container_id
    while cid is not None:
        parts.append(cid.value)
        cid = cid.parent
    return "/containers/".join(reversed(parts))


def _prepare_filesystem(rootfs: str, inject: bool, host_path: str, container_path: str,
                        dev_dir: str, devices_dir: str) -> tuple[list[ContainerMountInfo], bool]:
    """The blocking part of a launch info: one executor job per prepare.

    Returns the mounts and whether device nodes were copied. A failed copy
    removes the nodes and directories it made, and nothing else."""
    mounts: list[ContainerMountInfo] = []
    if inject:
        target = os.path.join(rootfs, container_path.lstrip("/"))
        try:
            os.makedirs(target, exist_ok=True)
        except OSError as e:
            raise IsolatorError(f"Failed to create the container directory at '{target}': {e.strerror}") from None
        mounts.append(ContainerMountInfo(host_path, target, MS_RDONLY | MS_BIND | MS_REC))
    nodes = nvidia_device_nodes(dev_dir)
    if nodes:
        made_dirs = []
        directory = devices_dir
        while not os.path.isdir(directory):
            made_dirs.append(directory)
            directory = os.path.dirname(directory)
        existed = {n.name for n in nodes if os.path.lexists(os.path.join(devices_dir, n.name))}
        try:
            copied = copy_device_nodes(nodes, devices_dir)
        except Exception as e:
            for node in nodes:
                if node.name not in existed:
                    _remove_quietly(os.unlink, os.path.join(devices_dir, node.name))
            for made in made_dirs:  # deepest first; a directory someone else filled stays
                _remove_quietly(os.rmdir, made)
            raise IsolatorError(f"Failed to copy NVIDIA device nodes into '{devices_dir}': {e}") from None
        for node, path in zip(nodes, copied):
            mounts.append(ContainerMountInfo(path, os.path.join(rootfs, "dev", node.name), MS_BIND))
    return mounts, bool(nodes)


def _remove_quietly(remove: Any, path: str) -> None:
    try:
        remove(path)
    except OSError:
        pass


def _remove_devices_dir(runtime_dir: str, relative: str) -> None:
    """Remove ``<runtime_dir>/containers/<relative>/devices`` and the container
    directories left empty above it (blocking; one executor job)."""
    containers = os.path.join(runtime_dir, "containers")
    directory = os.path.join(containers, relative)
    shutil.rmtree(os.path.join(directory, "devices"), ignore_errors=True)
    while directory != containers and directory.startswith(containers + os.sep):
        try:
            os.rmdir(directory)
        except OSError:
            return  # not empty (other files, nested containers): it stays
        directory = os.path.dirname(directory)


class MesosIsolator:
    """A handle to an isolator process: each method dispatches and returns a Future."""

    def __init__(self, process: NvidiaGpuIsolatorProcess, devices: DeviceControl) -> None:
        self.pid = process.pid
        self.process = process
        self.devices = devices

    def supports_nesting(self) -> bool:
        return True

    def supports_standalone(self) -> bool:
        return True

    def recover(self, states: list[ContainerState], orphans: set[ContainerID] | None = None) -> Future[None]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.recover, list(states), set(orphans or ()))

    def prepare(self, container_id: ContainerID, config: ContainerConfig) -> Future[ContainerLaunchInfo | None]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.prepare, container_id, config)

    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Future[None]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.update, container_id, resources, limits)

    def usage(self, container_id: ContainerID) -> Future[ResourceStatistics]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.usage, container_id)

    def cleanup(self, container_id: ContainerID) -> Future[None]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.cleanup, container_id)

    def watch(self, container_id: ContainerID) -> Future[ContainerLimitation]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.watch, container_id)

    def reconcile(self) -> Future[list[Repair]]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.reconcile)

    def containers(self) -> Future[dict[str, list[int]]]:
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.containers)

    @property
    def recovery_report(self) -> list[str]:
        return list(self.process.recovery_report)

    async def close(self) -> None:
        """Terminate the isolator and its device control actor (no cleanup)."""
        terminate(self.pid)
        await wait(self.pid)
        close = getattr(self.devices, "close", None)
        if close is not None:
            await close()  # its device worker process, if any, has exited when this returns
        elif getattr(self.devices, "pid", None) is not None:
            terminate(self.devices.pid)
            await wait(self.devices.pid)
