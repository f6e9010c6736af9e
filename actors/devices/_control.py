"""Device control: the one actor that writes device rules, and its handle.

Rules:
- ``DeviceControlProcess`` is the single writer of device rules for its
  root (``<hierarchy>/<cgroups_root>``). It hands every operation to one
  driver (``_drivers``, ``_worker``): in line (a backend that never
  blocks: in memory), a thread (group commit: one executor job per drained
  batch) or a device worker process. Operations apply in arrival order (so
  operations on one cgroup apply in the order they were called); each
  caller's Future completes with its own result or its own exception: one
  failure fails no other caller.
- An operation whose effects are unknown (its device worker process died
  or was fenced while holding it) fails with ``WorkerError``: read the
  kernel state back (``state``, ``reconcile``) before acting on it.
- An exception that is not an ``Exception`` (fault injection's simulated
  crash) fails every caller of its batch.
- At termination, every queued or in-flight operation's Future fails with
  ``ProcessTerminated`` (work already in a thread or a worker still
  finishes there; its effects stand but are not reported).
- ``DeviceControl`` is the handle. Its methods return Futures (await them).
  It hands each operation to the actor's driver at once, in the caller's
  turn (no mailbox hop: the driver keeps the order of the calls and runs
  its own continuations on the actor); once the actor has terminated, an
  operation fails with ``ProcessTerminated``.
  A cgroup is a relative path under the root (a container id, or
  ``"parent/child"``): empty, absolute or ``..`` paths are refused before
  anything is queued, and so is a bad policy (rules given as v1 lines are
  parsed there too). A policy goes to the backend as one interned
  ``Policy``; the isolator passes its policies as such.
- ``DeviceControl.create`` picks the backend (``auto``: see
  ``detect_backend``, probed in the executor) and, with a ``work_dir``,
  takes the work directory's lock (``_lock``) before reading any device
  state: a second agent on the same directory waits for it, bounded, and
  refuses to start without it. It then builds the backend in the executor
  or in the worker process. A device worker process that cannot be started
  (no pipes, no ``sys.executable``, a child that dies at start) is logged
  as a warning and a thread is used instead; the backend's own errors (a
  bad hierarchy) are raised.
- The actor publishes its metrics (``_metrics``) from initialize to finalize.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from actors.flags import DEVICE_WORKERS
from runtime import Executor, Future, Process, ProcessTerminated, dispatch, generate_id, spawn, terminate, wait

from . import _metrics
from ._backend import DeviceBackend, DeviceOperation, _check_relative, validate_cgroup, validate_cgroups_root
from ._cgroups_v1 import CgroupsV1Backend
from ._cgroups_v2 import CgroupsV2Backend
from ._detect import resolve_backend
from ._drivers import Driver, InlineDriver, ThreadDriver
from ._errors import DeviceControlError, WorkerError
from ._lock import LOCK_TIMEOUT, WorkDirLock
from ._memory import MemoryBackend
from ._policy import Policy, as_policy
from ._rules import DeviceRule, check_diff
from ._worker import WorkerDriver

logger = logging.getLogger(__name__)

_operation = tuple.__new__
"""``_operation(DeviceOperation, (kind, args))``: the NamedTuple without its
Python-level ``__new__`` (two calls per operation on the hot path)."""


class DeviceControlProcess(Process):
    """The single writer of device rules (see module rules)."""

    def __init__(self, driver: Driver) -> None:
        super().__init__(id=generate_id("device-control"))
        self.driver = driver
        self.operations = 0
        """Operations submitted so far."""
        self._metrics: Any = None
        self.stopped: ProcessTerminated | None = None
        """Set once the actor has terminated: what every later operation fails with."""

    def bind(self) -> None:
        """Once spawned, before any operation: the driver's continuations run as
        this actor's events; its metrics are published."""
        pid = self.pid
        self.driver.bind(lambda fn: dispatch(pid, _call, fn))
        self._metrics = _metrics.publish(self)  # operations, batches, worker restarts (pulled)

    def submit(self, op: DeviceOperation) -> Future:
        """A Future of ``op``'s result (called by the handle in the caller's
        turn, or dispatched)."""
        if self.stopped is not None:
            return Future.failed(self.stopped)
        self.operations += 1
        return self.driver.submit(op)

    def finalize(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        self.stopped = ProcessTerminated(f"Device control {self.pid} terminated before the operation completed")
        self.driver.stop(self.stopped)


def _call(_process: DeviceControlProcess, fn: Callable[[], Any]) -> Any:
    return fn()


async def _build_driver(
    executor: Executor, backend: str, hierarchy: str | None, cgroups_root: str, work_dir: str | None,
    worker: str, lock_timeout: float,
) -> Driver:
    validate_cgroups_root(cgroups_root)
    if worker not in DEVICE_WORKERS:  # a thread of this process, or a device worker process (``_worker``)
        raise DeviceControlError(f"Unknown device worker {worker!r}: expected one of {', '.join(DEVICE_WORKERS)}")
    kind, hierarchy = await executor.run(resolve_backend, backend, hierarchy)
    if kind == "memory":
        return InlineDriver(MemoryBackend(f"memory:{hierarchy or ''}/{cgroups_root}", shared=True))
    assert hierarchy is not None
    lock = await executor.run(WorkDirLock.acquire, work_dir, lock_timeout) if work_dir is not None else None
    try:
        if worker == "process":
            try:
                return await WorkerDriver.start(kind, hierarchy, cgroups_root, work_dir, lock)
            except WorkerError as error:  # no child process here (not the backend's own error): a thread
                logger.warning("%s; device control for %s uses a thread of this process instead", error, kind)
        if kind == "cgroups_v1":
            impl: DeviceBackend = await executor.run(CgroupsV1Backend, hierarchy, cgroups_root)
        else:
            impl = await executor.run(CgroupsV2Backend, hierarchy, cgroups_root)
        return ThreadDriver(impl, executor, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


class DeviceControl:
    """Handle of a ``DeviceControlProcess``; every method returns a Future."""

    def __init__(self, process: DeviceControlProcess) -> None:
        self._process = process
        self.pid = process.pid
        self.backend_name: str = process.driver.name
        self.root: str = process.driver.root

    @classmethod
    async def create(
        cls,
        backend: str = "auto",
        hierarchy: str | None = None,
        cgroups_root: str = "gpu-isolator",
        work_dir: str | None = None,
        backend_impl: DeviceBackend | None = None,
        worker: str = "thread",
        lock_timeout: float = LOCK_TIMEOUT,
    ) -> "DeviceControl":
        """Build the backend and spawn the actor (inside a ``runtime.Runtime``).

        ``worker``: ``thread`` runs a kernel backend in this process's
        executor; ``process`` in a device worker process (``_worker``: the
        kernel work then overlaps the event loop's). Ignored for in-memory
        and for ``backend_impl`` (applied in a thread, or in line when it
        never blocks). ``lock_timeout``: seconds to wait for the work
        directory's lock (see module rules)."""
        executor = Executor(1, name="device-control")
        try:
            if backend_impl is not None:
                driver: Driver = (
                    ThreadDriver(backend_impl, executor) if backend_impl.blocking else InlineDriver(backend_impl)
                )
            else:
                driver = await _build_driver(
                    executor, backend, hierarchy, cgroups_root, work_dir, worker, lock_timeout
                )
        except BaseException:
            executor.shutdown(wait=False)
            raise
        process = DeviceControlProcess(driver)
        spawn(process)
        process.bind()  # before any operation: the handle hands them to the driver at once
        logger.info("Device control %s uses %s at %s", process.pid, driver.name, driver.root)
        return cls(process)

    def _submit(self, kind: str, *args: Any) -> Future:
        return self._process.submit(_operation(DeviceOperation, (kind, args)))

    def _checked(self, kind: str, cgroup: str, arguments: Callable[[], tuple] | None = None) -> Future:
        """``kind`` on ``cgroup``, checked before anything is queued: a bad cgroup
        (or what ``arguments()`` refuses) fails the Future."""
        try:
            return self._submit(kind, validate_cgroup(cgroup), *(arguments() if arguments is not None else ()))
        except DeviceControlError as error:
            return Future.failed(error)

    def configure(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule | str], deny: Iterable[DeviceRule | str] = ()
    ) -> Future[Policy]:
        """Create ``cgroup`` if missing and make its policy ``(allow, deny)``, or
        the ``Policy`` given; the policy the kernel enforces."""
        try:  # the hot path (every prepare), checked in line
            return self._submit("configure", validate_cgroup(cgroup), as_policy(allow, deny))
        except DeviceControlError as error:
            return Future.failed(error)

    def reconfigure(
        self, cgroup: str, add: Iterable[DeviceRule | str] = (), remove: Iterable[DeviceRule | str] = ()
    ) -> Future[Policy]:
        """Grant ``add`` and revoke ``remove`` (exact rules); the new policy."""
        return self._checked("reconfigure", cgroup, lambda: check_diff(add, remove))

    def remove(self, cgroup: str) -> Future[bool]:
        """Delete ``cgroup``; False (with a warning) while processes remain in it."""
        try:  # the hot path (every cleanup), checked in line
            return self._submit("remove", validate_cgroup(cgroup))
        except DeviceControlError as error:
            return Future.failed(error)

    def state(self, cgroup: str) -> Future[Policy | None]:
        """The cgroup's policy (v1: read from the kernel), None when unknown."""
        return self._checked("state", cgroup)

    def exists(self, cgroup: str) -> Future[bool]:
        """Whether the cgroup exists."""
        return self._checked("exists", cgroup)

    def list_cgroups(self) -> Future[list[str]]:
        """Every cgroup below the root (relative paths, sorted)."""
        return self._submit("list_cgroups")

    def reconcile(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule | str], deny: Iterable[DeviceRule | str] = ()
    ) -> Future[list[str]]:
        """Repair drift: make the kernel enforce ``(allow, deny)`` (or the
        ``Policy`` given); the repairs, in words."""
        return self._checked("reconcile", cgroup, lambda: (as_policy(allow, deny),))

    def confine(self, path: str, deny: Iterable[DeviceRule | str]) -> Future[list[str]]:
        """Deny ``deny`` to the existing cgroup ``path`` -- named from the
        hierarchy's root (``user.slice``), outside this root -- and to every
        cgroup below it, nothing else changed (SPEC R-SC-8); what it
        changed, in words. Idempotent: call it again to re-check."""
        try:
            _check_relative(path, "confined cgroup")
            return self._submit("confine", path, as_policy(["a *:* rwm"], deny))
        except DeviceControlError as error:
            return Future.failed(error)

    def remove_root(self) -> Future[bool]:
        """Delete the root itself once no cgroup is left below it."""
        return self._submit("remove_root")

    def path(self, cgroup: str) -> str:
        """The absolute path of ``cgroup`` (for tests and logs)."""
        return self._process.driver.path(validate_cgroup(cgroup))

    @property
    def batches(self) -> int:
        """Batches handed to the backend so far (executor jobs, or frames to a worker)."""
        return self._process.driver.batches

    @property
    def worker_batches(self) -> int:
        """Batches sent to a device worker process so far: each one a round
        trip the event loop waits on (0 in line or in a thread)."""
        return self._process.driver.worker_batches

    @property
    def operations(self) -> int:
        """Operations submitted so far."""
        return self._process.operations

    @property
    def worker_pid(self) -> int | None:
        """The device worker process's id while one runs (None in a thread or in line)."""
        return self._process.driver.pid

    async def close(self) -> None:
        """Terminate the actor and wait for it, and until nothing of it can
        touch the kernel any more (its worker process has exited)."""
        terminate(self.pid)
        await wait(self.pid)
        await self._process.driver.wait_stopped()
