"""NvidiaGpuIsolator: the handle an agent holds to an NVIDIA GPU isolator actor.

Rules (Mesos' ``MesosIsolator`` wrapping a ``MesosIsolatorProcess``; named
like its siblings ``NvidiaGpuAllocator`` and ``NvidiaVolume``, the handles
of their processes):
- Each method dispatches to the isolator actor and returns a runtime
  ``Future`` at once (await it); the actor orders and runs the call.
- ``supports_nesting()`` and ``supports_standalone()`` are answered here
  (R-IS-2): both true.
- ``unit_rules()``: the device rules of every unit the isolator hands out
  (whole GPUs; MIG devices with their parent and capability nodes), as
  ``serve --confine`` denies them (SPEC R-SC-8).
- ``close()`` terminates the actor and its device control actor (waiting for
  a device worker process to exit); it cleans nothing up: containers and
  their cgroups stay for the next agent to recover.
"""

from __future__ import annotations

from actors.devices import DeviceControl, DeviceRule
from actors.resources import Resources
from runtime import Future, dispatch, terminate, wait

from ._process import NvidiaGpuIsolatorProcess
from ._types import ContainerConfig, ContainerID, ContainerLaunchInfo, ContainerLimitation, ContainerState
from ._types import Repair, ResourceStatistics


class NvidiaGpuIsolator:
    """A handle to an isolator process: each method dispatches and returns a Future."""

    def __init__(self, process: NvidiaGpuIsolatorProcess, devices: DeviceControl) -> None:
        self.pid = process.pid
        self.process = process
        self.devices = devices

    def supports_nesting(self) -> bool:
        """True: nested containers share their top-level parent's GPUs (R-IS-2)."""
        return True

    def supports_standalone(self) -> bool:
        """True: standalone containers (no executor) are isolated too (R-IS-2)."""
        return True

    def recover(self, states: list[ContainerState], orphans: set[ContainerID] | None = None) -> Future[None]:
        """After an agent restart: ``states`` are the containers the agent knows
        (they keep the GPUs their cgroups may use, read back from the kernel),
        ``orphans`` those it does not (their GPUs stay out of the pool until
        they are cleaned up). Every call issued after it waits for it."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.recover, list(states), set(orphans or ()))

    def prepare(self, container_id: ContainerID, config: ContainerConfig) -> Future[ContainerLaunchInfo | None]:
        """Grant the container the GPUs its ``config.resources`` ask for
        (``gpus:N``; MIG profiles under ``mixed``), the best-connected free
        ones, and write its device rules. The launch info (the driver volume
        for a container with its own rootfs, CDI names with ``cdi_spec_dir``)
        or None when the engine has nothing to do. Fails with
        ``IsolatorError`` ("Requested N gpus but only M available",
        "Container has already been prepared", ...) and then changes nothing."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.prepare, container_id, config)

    def update(self, container_id: ContainerID, resources: Resources, limits: dict | None = None) -> Future[None]:
        """Grow or shrink the container's GPUs to ``resources`` (the highest
        minors go back first). All or nothing: a failed update changes nothing."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.update, container_id, resources, limits)

    def usage(self, container_id: ContainerID) -> Future[ResourceStatistics]:
        """NVML's readings for the container's GPUs, at most
        ``flags.nvidia_usage_max_age`` seconds old."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.usage, container_id)

    def cleanup(self, container_id: ContainerID) -> Future[None]:
        """Remove the container's cgroup and return its GPUs (idempotent: an
        unknown id is nothing to do). If processes remain, its GPUs are denied
        to them first and the cgroup lingers until they exit."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.cleanup, container_id)

    def watch(self, container_id: ContainerID) -> Future[ContainerLimitation]:
        """Resolves with a ``ContainerLimitation`` when a GPU the container
        holds becomes unhealthy (an Xid, an ECC error, NVML lost)."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.watch, container_id)

    def reconcile(self) -> Future[list[Repair]]:
        """Compare every container's device rules and CDI spec with what the
        kernel and the spec directory hold, repair the difference, and return
        the repairs made (R-DV-5)."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.reconcile)

    def containers(self) -> Future[dict[str, list[int]]]:
        """Every container the isolator holds, by id, with its GPUs' minors."""
        return dispatch(self.pid, NvidiaGpuIsolatorProcess.containers)

    def unit_rules(self) -> list[DeviceRule]:
        """The rules granting every unit this isolator hands out (see module rules)."""
        catalog = self.process.catalog
        return catalog.rules({unit for units in catalog.pools.values() for unit in units})

    @property
    def recovery_report(self) -> list[str]:
        """What the last ``recover`` found, one line a container."""
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
