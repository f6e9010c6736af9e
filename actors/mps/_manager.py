"""MpsDaemons: the MPS control daemons a front door runs, one per shared unit (R-MP-1, R-MP-2).

Rules:
- One daemon per shared unit (a GPU or a MIG device, named by its UUID),
  started by the first share of the unit and stopped (``quit``) when its
  last share is returned; its pipe and log directories are
  ``<runtime_dir>/mps/<uuid>/{pipe,log}`` and only the unit's UUID is
  visible to it (``_daemon``). A daemon left running by an earlier life of
  the front door (its pid file names a live process) is taken over, not
  started twice.
- Compute mode through NVML: a GPU unit is set to EXCLUSIVE_PROCESS before
  its daemon starts (an NVML failure fails the share, naming the unit) and
  back to DEFAULT after it stops (or after a start that failed); a failure
  to restore it is logged with the command that does it by hand, and tried
  again at the next stop and at ``close()``. A MIG unit's compute mode is left alone: NVML sets compute
  mode on whole GPUs only, and NVIDIA's DRA driver sets it on the GPUs of
  an MPS claim, never on its MIG devices.
- Limits (R-MP-2) are set through the control daemon, not only in the
  client's environment: on every share, ``set_default_device_pinned_mem_limit
  0 <MiB>M`` and ``set_default_active_thread_percentage <pct>`` (what the
  next server of the daemon gets), and for every server already running
  (``get_server_list``) ``set_device_pinned_mem_limit <pid> 0 <MiB>M``
  and ``set_active_thread_percentage <pid> <pct>``. The device is named by
  its index in the daemon, 0 (its ``CUDA_VISIBLE_DEVICES`` is the unit
  alone), never by UUID: NVIDIA's device plugin found the real daemon does
  not apply a limit set by UUID (NVIDIA/k8s-device-plugin#572). MPS holds these limits
  per server, and one server serves every client of a daemon, so shares of
  one unit are equal: a share asking other limits than the unit's live
  shares have is refused naming both. Memory is given in whole MiB, as
  NVIDIA's DRA driver gives it; less than 1 MiB is refused.
- A daemon that exits while shares live is started again after a backoff
  (``backoff_s``: first wait, doubled up to ``backoff_max_s``), at most
  ``max_restarts`` times in a row; every start bumps ``generation``, and a
  start after such an exit (by the restart, or by a share that came
  first) counts in ``restarts``. A share whose daemon is down, or
  was granted under an earlier generation, is ``interrupted``
  (``share_state``): its clients lost their server with the daemon and
  must start again; a share granted since is not. The exit is noticed through a pidfd on the event loop (asyncio:
  ``add_reader``; the daemon is not our child, ``-d`` forks it away).
- A share asked for while its unit's daemon is down starts it at once;
  when that fails the share fails with ``MpsDaemonFailed`` (the exit and
  the tail of ``control.log``), and nothing is left behind: no share, the
  compute mode DEFAULT again.
- One unit's operations run one at a time (an ``asyncio.Lock`` per unit);
  units do not wait for one another. Every blocking step (directories, the
  control program, NVML) is one job on an Executor: nothing blocks the
  loop. Every wait is bounded (``timeout_s``).
- A daemon left running with no share (its front door died while the
  unit's last share went: a pod removed, a claim never answered
  prepared) is nobody's to stop but the front door that comes back:
  ``left_running()`` names the units under the runtime directory whose
  daemon runs (their pid file names a live process) with no share here,
  and ``stop_left(uuid)`` stops one (``quit``, SIGKILL past the timeout,
  compute mode DEFAULT: the earlier life set it) unless a share came
  first. The front door calls them once its live shares are granted
  again, and only for units no other front door holds in the node ledger
  (the runtime directory may be shared by every front door of the node).
- ``cgroup`` (None or ``none``: the front door's own): where a daemon is
  started, ``<mount>/<cgroup>`` in every cgroup hierarchy (``_cgroup``),
  so that stopping the front door's container (its cgroup killed) leaves
  the daemon and its clients' server running for the front door that
  comes back. Not root, it is ignored with a warning.
- Metrics (``runtime.MetricSet``, given back by ``close()``):
  ``mps/daemons`` (daemons running), ``mps/daemon_restarts`` (daemons
  started again after exiting), ``mps/shares`` (live shares).
- ``close()`` stops every daemon (``quit``; SIGKILL past the timeout) and
  restores compute modes. Asyncio only: the front doors that share (the
  kubelet plugin, the DRA plugin) run on asyncio (``grpc.aio``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import msgspec

from runtime import Executor, MetricSet, current_runtime

from actors.nvml import COMPUTE_MODE_DEFAULT, COMPUTE_MODE_EXCLUSIVE_PROCESS, Nvml, NvmlError, NvmlService

from . import _daemon
from ._cgroup import NO_CGROUP, procs_files, validate_mps_cgroup
from ._daemon import DaemonPaths
from ._errors import MpsError, UnequalShare

__all__ = ["MpsDaemons", "ShareLimits", "ShareState", "DEFAULT_MPS_CONTROL"]

logger = logging.getLogger(__name__)

DEFAULT_MPS_CONTROL = "nvidia-cuda-mps-control"
_MIB = 1024 * 1024
UNIT_INDEX = 0
"""The unit's device index in its own daemon, which sees it alone (see module rules)."""


class ShareLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one share of a unit may use (R-MP-2)."""

    memory_bytes: int
    """Device memory the share's clients may pin, in bytes (whole MiB are set)."""
    thread_percentage: int
    """The share's active thread percentage, 1..100."""

    def check(self) -> None:
        if self.memory_bytes < _MIB:
            raise MpsError(f"an MPS share's memory limit must be at least 1 MiB, got {self.memory_bytes} bytes")
        if not 1 <= self.thread_percentage <= 100:
            raise MpsError(f"an MPS share's thread percentage must be 1..100, got {self.thread_percentage}")

    @property
    def memory_text(self) -> str:
        return f"{self.memory_bytes // _MIB}M"


class ShareState(msgspec.Struct, frozen=True, kw_only=True):
    """One live share as the manager sees it."""

    share_id: str
    unit: str
    limits: ShareLimits
    pipe_dir: str
    """The daemon's pipe directory (a share's containers get it at ``/tmp/nvidia-mps``)."""
    shm_dir: str
    """The unit's shared memory (a share's containers get it at ``/dev/shm``)."""
    generation: int
    """The daemon start it was granted under (1: the first)."""
    interrupted: bool
    """The daemon it was granted under exited (it may run again since): its clients lost their server."""


class _Unit:
    __slots__ = ("uuid", "paths", "lock", "pid", "pidfd", "generation", "starts", "shares", "limits",
                 "stopping", "restart_task", "failure", "whole_gpu", "mode_set", "exited")

    def __init__(self, uuid: str, paths: DaemonPaths) -> None:
        self.uuid = uuid
        self.paths = paths
        self.lock = asyncio.Lock()
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.generation = 0
        self.starts = 0
        self.shares: dict[str, tuple[ShareLimits, int]] = {}
        self.limits: ShareLimits | None = None
        self.stopping = False
        self.restart_task: asyncio.Task | None = None
        self.failure: MpsError | None = None
        self.whole_gpu: bool | None = None
        self.mode_set = False
        """This manager set the unit EXCLUSIVE_PROCESS and has not restored it yet."""
        self.exited = False
        """Its daemon exited while shares lived, and has not been started again."""


def _launch(control: str, paths: DaemonPaths, uuid: str, timeout_s: float, cgroup: str | None) -> int:
    """Start ``uuid``'s daemon in the daemons' cgroup (made first), or in the front door's (None)."""
    procs = procs_files(cgroup) if cgroup is not None else ()
    return _daemon.start(control, paths, uuid, timeout_s, procs)


def _find_gpu(nvml: Nvml, uuid: str) -> Any:
    """The handle of the whole GPU ``uuid``; None when it is not one (a MIG device)."""
    for index in range(nvml.device_count()):
        handle = nvml.handle(index)
        if nvml.uuid(handle) == uuid:
            return handle
    return None


def _set_mode(nvml: Nvml, uuid: str, mode: int) -> bool:
    """Set GPU ``uuid``'s compute mode; False when ``uuid`` is no whole GPU."""
    handle = _find_gpu(nvml, uuid)
    if handle is None:
        return False
    nvml.set_compute_mode(handle, mode)
    return True


class MpsDaemons:
    """The MPS control daemons of one front door (see module rules)."""

    def __init__(
        self,
        nvml: NvmlService,
        runtime_dir: str | os.PathLike[str],
        control: str = DEFAULT_MPS_CONTROL,
        *,
        timeout_s: float = 10.0,
        backoff_s: float = 0.2,
        backoff_max_s: float = 5.0,
        max_restarts: int = 5,
        executor: Executor | None = None,
        cgroup: str | None = None,
    ) -> None:
        self.cgroup = None if cgroup in (None, NO_CGROUP) else validate_mps_cgroup(cgroup)  # type: ignore[arg-type]
        if self.cgroup is not None and os.geteuid() != 0:
            logger.warning("MPS control daemons stay in the front door's cgroups, not %r: only root moves a process"
                           " between cgroups", self.cgroup)
            self.cgroup = None
        self.nvml = nvml
        self.runtime_dir = os.fspath(runtime_dir)
        self.control = control
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_restarts = max_restarts
        self._owns_executor = executor is None
        self.executor = executor if executor is not None else Executor(max_workers=2, name="mps")
        self._units: dict[str, _Unit] = {}
        self._share_units: dict[str, str] = {}
        self.restarts = 0
        """Daemons started again after exiting (``mps/daemon_restarts``)."""
        self._closed = False
        self._metrics = MetricSet(current_runtime().metrics)
        self._metrics.gauge("mps/daemons", lambda: sum(u.pid is not None for u in self._units.values()),
                            "MPS control daemons running")
        self._metrics.counter("mps/daemon_restarts", "MPS control daemons started again after exiting",
                              read=lambda: self.restarts)
        self._metrics.gauge("mps/shares", lambda: len(self._share_units), "live MPS shares")

    # ------------------------------------------------------------ queries

    def daemon_pid(self, uuid: str) -> int | None:
        """The PID of ``uuid``'s daemon when it runs."""
        unit = self._units.get(uuid)
        return unit.pid if unit is not None else None

    def paths(self, uuid: str) -> DaemonPaths:
        """Where ``uuid``'s daemon keeps its pipes and log."""
        return DaemonPaths.under(self.runtime_dir, uuid)

    def share_state(self, share_id: str) -> ShareState | None:
        """A live share, or None."""
        uuid = self._share_units.get(share_id)
        if uuid is None:
            return None
        unit = self._units[uuid]
        limits, generation = unit.shares[share_id]
        return ShareState(share_id=share_id, unit=uuid, limits=limits, pipe_dir=unit.paths.pipe,
                          shm_dir=unit.paths.shm, generation=generation,
                          interrupted=unit.pid is None or generation < unit.generation)

    def shares(self) -> list[ShareState]:
        """Every live share."""
        return [s for s in (self.share_state(i) for i in list(self._share_units)) if s is not None]

    # ------------------------------------------------------------ shares

    async def share(self, uuid: str, share_id: str, limits: ShareLimits) -> ShareState:
        """Grant ``share_id`` a share of unit ``uuid`` with ``limits`` (see module rules)."""
        if self._closed:
            raise MpsError(f"cannot share {uuid}: the MPS daemons are closed")
        limits.check()
        held = self._share_units.get(share_id)
        if held is not None and held != uuid:
            raise MpsError(f"share {share_id!r} is already a share of {held}, not of {uuid}")
        unit = self._units.get(uuid)
        if unit is None:
            unit = self._units[uuid] = _Unit(uuid, self.paths(uuid))
        async with unit.lock:
            if share_id in unit.shares:
                if unit.shares[share_id][0] != limits:
                    raise MpsError(f"share {share_id!r} of {uuid} already has limits {unit.shares[share_id][0]},"
                                   f" not {limits}")
                return self.share_state(share_id)  # type: ignore[return-value]
            if unit.shares and unit.limits is not None and unit.limits != limits:
                raise UnequalShare(
                    f"cannot share {uuid} with {_describe(limits)}: its live shares have {_describe(unit.limits)},"
                    " and MPS holds limits per server, one server for every client of a unit, so the shares of"
                    " one unit are equal (R-MP-2); ask for the same limits or another unit"
                )
            if unit.pid is None:
                await self._start(unit)
            try:
                await self._apply_limits(unit, limits)
            except MpsError:
                if not unit.shares:
                    await self._stop(unit)
                raise
            unit.limits = limits
            unit.shares[share_id] = (limits, unit.generation)
            self._share_units[share_id] = uuid
            logger.info("MPS share %s of %s granted (%s)", share_id, uuid, _describe(limits))
            return self.share_state(share_id)  # type: ignore[return-value]

    async def release(self, share_id: str) -> bool:
        """Return a share; the unit's last share stops its daemon. False when unknown."""
        uuid = self._share_units.get(share_id)
        if uuid is None:
            return False
        unit = self._units[uuid]
        async with unit.lock:
            if unit.shares.pop(share_id, None) is None:
                return False
            del self._share_units[share_id]
            logger.info("MPS share %s of %s returned", share_id, uuid)
            if not unit.shares:
                unit.limits = None
                await self._stop(unit)
        return True

    async def left_running(self) -> list[str]:
        """Units whose daemon runs with no share here (see module rules)."""
        running = await self.executor.run(_daemon.running_units, self.runtime_dir)
        return [uuid for uuid in running if uuid not in self._units or not self._units[uuid].shares]

    async def stop_left(self, uuid: str) -> bool:
        """Stop ``uuid``'s daemon left running with no share (see module rules); whether one was stopped."""
        if self._closed:
            return False
        unit = self._units.get(uuid)
        if unit is None:
            unit = self._units[uuid] = _Unit(uuid, self.paths(uuid))
        async with unit.lock:
            if unit.shares:
                return False
            if unit.pid is None:
                pid = await self.executor.run(_daemon.running_pid, unit.paths)
                if pid is None:
                    return False
                unit.pid = pid
                unit.mode_set = unit.whole_gpu is not False  # an earlier life set it EXCLUSIVE_PROCESS
            logger.warning("MPS control daemon of %s (pid %d) runs with no share (left by an earlier life of this"
                           " front door): stopping it", uuid, unit.pid)
            await self._stop(unit)
            return True

    async def close(self) -> None:
        """Stop every daemon and restore compute modes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            for unit in list(self._units.values()):
                async with unit.lock:
                    for share_id in unit.shares:
                        self._share_units.pop(share_id, None)
                    unit.shares.clear()
                    await self._stop(unit)
        finally:
            self._metrics.close()
            if self._owns_executor:
                self.executor.shutdown(wait=False)

    # ------------------------------------------------------------ the daemon

    async def _start(self, unit: _Unit) -> None:
        """Start (or take over) ``unit``'s daemon; on failure leave nothing behind."""
        await self.executor.run(_daemon.prepare, unit.paths)
        pid = await self.executor.run(_daemon.running_pid, unit.paths)
        if unit.whole_gpu is not False and not unit.mode_set:
            try:
                unit.whole_gpu = await self.nvml.call(_set_mode, self.nvml.nvml, unit.uuid,
                                                      COMPUTE_MODE_EXCLUSIVE_PROCESS)
            except NvmlError as exc:
                raise MpsError(f"cannot set {unit.uuid} to compute mode EXCLUSIVE_PROCESS for its MPS daemon: {exc};"
                               " NVML's compute mode needs root") from None
            unit.mode_set = unit.whole_gpu
        if pid is None:
            try:
                pid = await self.executor.run(_launch, self.control, unit.paths, unit.uuid, self.timeout_s,
                                              self.cgroup)
            except MpsError as exc:
                unit.failure = exc
                await self._restore_mode(unit)
                raise
            logger.info("MPS control daemon of %s started (pid %d, %s)", unit.uuid, pid, unit.paths.pipe)
        else:
            logger.info("MPS control daemon of %s taken over (pid %d, %s)", unit.uuid, pid, unit.paths.pipe)
        unit.failure = None
        unit.pid = pid
        unit.starts += 1
        unit.generation += 1
        if unit.exited:  # by the restart task, or by a share that came first
            unit.exited = False
            self.restarts += 1
        self._watch(unit)

    def _watch(self, unit: _Unit) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(unit.pid)  # type: ignore[arg-type]
        except ProcessLookupError:
            loop.call_soon(self._exited, unit, unit.pid)
            return
        unit.pidfd = fd
        loop.add_reader(fd, self._exited, unit, unit.pid)

    def _unwatch(self, unit: _Unit) -> None:
        if unit.pidfd is not None:
            asyncio.get_running_loop().remove_reader(unit.pidfd)
            os.close(unit.pidfd)
            unit.pidfd = None

    def _exited(self, unit: _Unit, pid: int) -> None:
        """``unit``'s daemon ``pid`` exited (the loop's reader callback)."""
        if unit.pid != pid:
            return
        self._unwatch(unit)
        unit.pid = None
        if unit.stopping or self._closed:
            return
        unit.exited = bool(unit.shares)
        logger.warning("MPS control daemon of %s (pid %d) exited; %d share(s) lost their server: %s",
                       unit.uuid, pid, len(unit.shares), _daemon.log_tail(unit.paths, 2).replace("\n", " | "))
        if unit.shares and unit.restart_task is None:
            unit.restart_task = asyncio.get_running_loop().create_task(self._restart(unit, pid))

    async def _restart(self, unit: _Unit, pid: int) -> None:
        delay = self.backoff_s
        try:
            for attempt in range(1, self.max_restarts + 1):
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
                async with unit.lock:
                    if unit.pid is not None or not unit.shares or self._closed:
                        return
                    try:
                        await self._start(unit)
                    except MpsError as exc:
                        logger.warning("MPS control daemon of %s: restart %d of %d failed: %s",
                                       unit.uuid, attempt, self.max_restarts, exc)
                        continue
                    logger.info("MPS control daemon of %s started again (pid %d, after pid %d exited)",
                                unit.uuid, unit.pid, pid)
                    try:
                        await self._apply_limits(unit, unit.limits)  # type: ignore[arg-type]
                    except MpsError as exc:  # the next share of the unit sets them again
                        unit.failure = exc
                        logger.error("MPS control daemon of %s: its limits could not be set again: %s",
                                     unit.uuid, exc)
                    return
            logger.error("MPS control daemon of %s: gave up after %d restarts; the next share tries again",
                         unit.uuid, self.max_restarts)
        finally:
            unit.restart_task = None

    async def _apply_limits(self, unit: _Unit, limits: ShareLimits) -> None:
        commands = [
            f"set_default_device_pinned_mem_limit {UNIT_INDEX} {limits.memory_text}",
            f"set_default_active_thread_percentage {limits.thread_percentage}",
        ]

        def apply() -> None:
            servers = _daemon.send(self.control, unit.paths, ["get_server_list"], self.timeout_s).split()
            for server in servers:
                commands.append(f"set_device_pinned_mem_limit {server} {UNIT_INDEX} {limits.memory_text}")
                commands.append(f"set_active_thread_percentage {server} {limits.thread_percentage}")
            _daemon.configure(self.control, unit.paths, commands, self.timeout_s)

        await self.executor.run(apply)

    async def _stop(self, unit: _Unit) -> None:
        """Stop ``unit``'s daemon (``quit``, SIGKILL past the timeout) and restore its compute mode."""
        if unit.restart_task is not None:
            unit.restart_task.cancel()
            unit.restart_task = None
        unit.exited = False
        pid = unit.pid
        if pid is None:
            await self._restore_mode(unit)
            return
        unit.stopping = True
        try:
            self._unwatch(unit)
            unit.pid = None

            def stop() -> None:
                try:
                    _daemon.send(self.control, unit.paths, ["quit"], self.timeout_s)
                except MpsError as exc:
                    logger.warning("MPS control daemon of %s: quit failed (%s); killing pid %d", unit.uuid, exc, pid)
                if not _daemon.wait_gone(pid, self.timeout_s):
                    logger.warning("MPS control daemon of %s (pid %d) ignored quit for %g s: SIGKILL",
                                   unit.uuid, pid, self.timeout_s)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        return
                    _daemon.wait_gone(pid, self.timeout_s)

            await self.executor.run(stop)
            logger.info("MPS control daemon of %s (pid %d) stopped", unit.uuid, pid)
            await self._restore_mode(unit)
        finally:
            unit.stopping = False

    async def _restore_mode(self, unit: _Unit) -> None:
        """DEFAULT again; a failure is logged and tried again by the next stop or ``close()``."""
        if not unit.mode_set:
            return
        try:
            await self.nvml.call(_set_mode, self.nvml.nvml, unit.uuid, COMPUTE_MODE_DEFAULT)
        except NvmlError as exc:
            logger.error("MPS: cannot set %s back to compute mode DEFAULT: %s; set it with"
                         " 'nvidia-smi -i %s -c DEFAULT'", unit.uuid, exc, unit.uuid)
            return
        unit.mode_set = False


def _describe(limits: ShareLimits) -> str:
    return f"memory {limits.memory_text} ({limits.memory_bytes} bytes), {limits.thread_percentage}% of threads"
