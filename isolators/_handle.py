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

    def unit_rules(self) -> list[DeviceRule]:
        """The rules granting every unit this isolator hands out (see module rules)."""
        catalog = self.process.catalog
        return catalog.rules({unit for units in catalog.pools.values() for unit in units})

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
