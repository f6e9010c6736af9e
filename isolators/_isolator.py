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
  previous call on that id); calls for different containers run concurrently.
- ``prepare``: nested DEBUG -> None; nested -> launch info only; a known id ->
  "Container has already been prepared"; else allocate, then ONE device
  ``configure`` of the whole policy (deny all; standard set, control devices,
  GPUs), then the launch info. Any failure undoes what was done: the GPUs go
  back, the cgroup is removed, no record stays.
- ``update`` grows by allocating and allowing; shrinks by denying and then
  releasing the highest minors first. A failed update changes nothing.
- ``cleanup`` is idempotent: the cgroup is removed (if processes remain, the
  GPUs are first denied to it, then released, with a warning), the GPUs go
  back and the record is forgotten.
- ``recover`` re-claims the GPUs each surviving cgroup may access (v1
  ``devices.list``; v2 the checkpoint). A cgroup under the root whose device
  state is unknown keeps every GPU it might hold out of the free pool until it
  is cleaned up, and is reported; so do cgroups nobody named (orphans).
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from typing import Any, Iterable

from actors import (
    NVIDIA_MAJOR,
    DeviceControl,
    DeviceRule,
    Flags,
    Gpu,
    Resources,
    container_policy,
    copy_device_nodes,
    nvidia_device_nodes,
)
from runtime import Executor, Future, Process, Promise, dispatch, spawn, terminate, wait

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
)

logger = logging.getLogger(__name__)

REQUIRED_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_CONTROL_DEVICES = ("nvidia-uvm-tools", "nvidia-modeset")


def gpu_rule(gpu: Gpu) -> DeviceRule:
    """The device rule that grants one GPU (read, write, mknod as in Mesos)."""
    return DeviceRule("c", gpu.major, gpu.minor, "rwm")


def requested_gpus(resources: Resources) -> int:
    """The whole number of GPUs ``resources`` asks for (0 when absent)."""
    gpus = resources.gpus()
    value = gpus if gpus is not None else 0.0
    if int(round(value * 1000)) % 1000 != 0:
        raise IsolatorError("The 'gpus' resource must be an unsigned integer")
    return int(round(value))


class _Info:
    """What the isolator knows of one top-level container."""

    __slots__ = ("container_id", "cgroup", "allocated", "unknown_state", "watchers")

    def __init__(self, container_id: ContainerID, cgroup: str) -> None:
        self.container_id = container_id
        self.cgroup = cgroup
        self.allocated: set[Gpu] = set()
        self.unknown_state = False
        self.watchers: list[Promise] = []


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
        self._executor = Executor(max_workers=2, name="gpu-isolator")
        self.recovery_report: list[str] = []

    # -- construction -----------------------------------------------------
    @classmethod
    async def create(cls, flags: Flags, components: NvidiaComponents) -> "MesosIsolator":
        """Check flags, pick the device backend, record control devices, spawn."""
        check_isolation(flags)
        host_numbers = dict(components.inventory.control_devices) if components.inventory.kind == "simulated" else None
        control = await Executor(1).run(find_control_devices, flags, host_numbers)
        devices = await DeviceControl.create(
            backend=flags.device_backend,
            hierarchy=flags.cgroups_hierarchy,
            cgroups_root=flags.cgroups_root,
            work_dir=flags.work_dir,
        )
        process = cls(flags, components, devices, control)
        spawn(process)
        return MesosIsolator(process, devices)

    def finalize(self) -> None:
        self._executor.shutdown(wait=False)

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

        async def run() -> Any:
            try:
                if previous is not None and previous.is_pending():
                    await previous
                return await operation(*args)
            finally:
                done.set_value(None)
                if self._tails.get(container_id) is done.future:
                    del self._tails[container_id]

        return run()

    # -- the policy ---------------------------------------------------------
    def _gpu_rules(self, gpus: Iterable[Gpu]) -> list[DeviceRule]:
        return [gpu_rule(g) for g in sorted(gpus)]

    def _policy(self, gpus: Iterable[Gpu]) -> tuple[list[DeviceRule], list[DeviceRule]]:
        allow, deny = container_policy(list(self.control_devices.values()), self._gpu_rules(gpus))
        return list(allow), list(deny)

    # -- recover --------------------------------------------------------------
    async def recover(self, states: list[ContainerState], orphans: set[ContainerID]) -> None:
        total = self.allocator.total()
        named: list[ContainerID] = [s.container_id for s in states] + sorted(orphans or ())
        known = {cid.value for cid in named if not cid.has_parent()}
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
            if gpus:
                await self.allocator.reclaim(gpus)
            info.allocated = gpus
            self.infos[cid] = info
            logger.info("Container %s: recovered with GPUs %s", cid, _minors(gpus))
        for info in unknown:
            state = await self.allocator.state()
            held = set(state.allocated)
            free = {g for g in total if g not in held}
            if free:
                await self.allocator.reclaim(free)
            info.allocated = set(free)
            self._report(
                f"Container {info.container_id}: cgroup '{info.cgroup}' exists but its device state is unknown"
                f" (no checkpoint entry); GPUs {_minors(free)} are kept out of the free pool until it is cleaned up"
            )

    def _report(self, line: str) -> None:
        logger.warning("%s", line)
        self.recovery_report.append(line)

    # -- prepare --------------------------------------------------------------
    def prepare(self, container_id: ContainerID, config: ContainerConfig) -> Any:
        if container_id.has_parent():
            if config.container_class == ContainerClass.DEBUG:
                return None
            return self._serialized(container_id, self._launch_info, container_id, config)
        return self._serialized(container_id, self._prepare, container_id, config)

    async def _prepare(self, container_id: ContainerID, config: ContainerConfig) -> ContainerLaunchInfo | None:
        if container_id in self.infos:
            raise IsolatorError("Container has already been prepared")
        requested = requested_gpus(config.resources)
        info = _Info(container_id, container_id.path())
        self.infos[container_id] = info
        configured = False
        try:
            gpus: set[Gpu] = set(await self.allocator.allocate(requested)) if requested else set()
            info.allocated = gpus
            allow, deny = self._policy(gpus)
            await self.devices.configure(info.cgroup, allow, deny)
            configured = True
            launch = await self._launch_info(container_id, config)
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
                await self.devices.remove(info.cgroup)
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
        mounts = await self._executor.run(
            _prepare_filesystem, config.rootfs, inject, self.volume.host_path, self.volume.container_path,
            self.flags.dev_dir, devices_dir,
        )
        launch = ContainerLaunchInfo(mounts=mounts)
        if env is not None:
            if config.has_task_info:
                launch.task_environment = env
            else:
                launch.environment = env
        return launch

    # -- update ---------------------------------------------------------------
    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Any:
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        return self._serialized(container_id, self._update, container_id, resources)

    async def _update(self, container_id: ContainerID, resources: Resources) -> None:
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        requested = requested_gpus(resources)
        held = len(info.allocated)
        if requested > held:
            extra = set(await self.allocator.allocate(requested - held))
            try:
                await self.devices.reconfigure(info.cgroup, self._gpu_rules(extra), [])
            except BaseException:
                await self.allocator.deallocate(extra)
                raise
            info.allocated |= extra
            logger.info("Container %s: granted GPUs %s (now %s)", container_id, _minors(extra), _minors(info.allocated))
        elif requested < held:
            surplus = set(sorted(info.allocated, reverse=True)[: held - requested])
            await self.devices.reconfigure(info.cgroup, [], self._gpu_rules(surplus))
            info.allocated -= surplus
            await self.allocator.deallocate(surplus)
            logger.info("Container %s: released GPUs %s, highest minors first (now %s)",
                        container_id, _minors(surplus), _minors(info.allocated))

    # -- usage ----------------------------------------------------------------
    def usage(self, container_id: ContainerID) -> Any:
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
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
        if container_id.has_parent():
            return None
        return self._serialized(container_id, self._cleanup, container_id)

    async def _cleanup(self, container_id: ContainerID) -> None:
        info = self.infos.get(container_id)
        if info is None:
            logger.debug("Container %s: ignoring cleanup request for unknown container", container_id)
            return
        removed = await self.devices.remove(info.cgroup)
        if not removed:
            if info.allocated:
                await self.devices.reconfigure(info.cgroup, [], self._gpu_rules(info.allocated))
            logger.warning("Container %s: cgroup '%s' still has processes; it stays, its GPUs %s were denied"
                           " and released", container_id, info.cgroup, _minors(info.allocated))
        gpus, info.allocated = info.allocated, set()
        if gpus:
            await self.allocator.deallocate(gpus)
        self.infos.pop(container_id, None)
        for watcher in info.watchers:
            watcher.discard()
        logger.info("Container %s: cleaned up, released GPUs %s", container_id, _minors(gpus))

    # -- beyond Mesos -----------------------------------------------------------
    def watch(self, container_id: ContainerID) -> Future:
        """R-IS-9: a Future of a ContainerLimitation, raised when one of the
        container's GPUs turns unhealthy (discarded at cleanup)."""
        if container_id.has_parent():
            raise IsolatorError("Not supported for nested containers")
        info = self.infos.get(container_id)
        if info is None:
            raise IsolatorError("Unknown container")
        health = self.allocator.watch(set(info.allocated))
        info.watchers.append(health)

        def limitation(event: Any) -> ContainerLimitation:
            message = f"GPU {event.gpu.major}:{event.gpu.minor} of container {container_id} became unhealthy: {event.reason}"
            logger.warning("Container %s: %s", container_id, message)
            return ContainerLimitation(resources=Resources.parse("gpus:1"), message=message)

        return health.then(limitation)

    async def reconcile(self) -> list[Repair]:
        repairs: list[Repair] = []
        for cid, info in list(self.infos.items()):
            if info.unknown_state:
                continue
            allow, deny = self._policy(info.allocated)
            fixed = await self.devices.reconcile(info.cgroup, allow, deny)
            for line in fixed:
                logger.warning("Container %s: drift repaired: %s", cid, line)
                repairs.append(Repair(str(cid), line))
        return repairs

    def containers(self) -> dict[str, list[int]]:
        """The containers known and the minors each holds (for scripts and tests)."""
        return {str(cid): sorted(g.minor for g in info.allocated) for cid, info in self.infos.items()}


def _minors(gpus: Iterable[Gpu]) -> list[int]:
    return sorted(g.minor for g in gpus)


def _runtime_path(container_id: ContainerID) -> str:
    # Mesos' layout: containers/<parent>/containers/<child>.
    parts = []
    cid: ContainerID | None = container_id
    while cid is not None:
        parts.append(cid.value)
        cid = cid.parent
    return "/containers/".join(reversed(parts))


def _prepare_filesystem(rootfs: str, inject: bool, host_path: str, container_path: str,
                        dev_dir: str, devices_dir: str) -> list[ContainerMountInfo]:
    """The blocking part of a launch info: one executor job per prepare."""
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
        try:
            copied = copy_device_nodes(nodes, devices_dir)
        except Exception as e:
            raise IsolatorError(f"Failed to copy NVIDIA device nodes into '{devices_dir}': {e}") from None
        for node, path in zip(nodes, copied):
            mounts.append(ContainerMountInfo(path, os.path.join(rootfs, "dev", node.name), MS_BIND))
    return mounts


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
        for pid in (self.pid, getattr(self.devices, "pid", None)):
            if pid is not None:
                terminate(pid)
                await wait(pid)
