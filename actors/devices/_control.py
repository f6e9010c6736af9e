"""Device control: the one actor that writes device rules, and its handle.

Rules:
- ``DeviceControlProcess`` is the single writer of device rules for its
  root (``<hierarchy>/<cgroups_root>``). All kernel work goes through one
  ``Executor`` with one worker, so backends see one caller at a time; or,
  with ``worker="process"``, to one device worker process (``_worker``),
  one batch at a time, awaited without a thread.
- Group commit: an operation that arrives while an executor job runs is
  queued; when the job ends, ALL queued operations go to the backend as ONE
  batch in ONE executor job (``backend.apply_batch``). Operations apply in
  arrival order (so operations on one cgroup apply in the order they were
  called); each caller's Future completes with its own result or its own
  exception: one failure fails no other caller. The in-memory backend is
  applied inline, on the actor, with no executor hop.
- A ``SimulatedCrash`` (fault injection) fails every caller of its batch.
- At termination, every queued or in-flight operation's Future fails with
  ``ProcessTerminated`` (a job already in its thread still finishes there;
  its effects stand but are not reported).
- ``DeviceControl`` is the handle. Its methods return Futures (await them).
  A cgroup is a relative path under the root (a container id, or
  ``"parent/child"``): empty, absolute or ``..`` paths are refused before
  anything is queued, and rules given as v1 lines are parsed there too (a
  tuple of rules seen before is recognised by identity: callers pass the
  same policy tuples again and again).
- ``DeviceControl.create`` picks the backend (``auto``: see
  ``detect_backend``) and builds it in the executor, or in the worker
  process (v2 reads its checkpoint there, so a bad checkpoint fails
  ``create`` either way). A device worker process that cannot be started
  (no ``sys.executable``, a child that dies at start) is logged as a
  warning and a thread is used instead; the backend's own errors (a bad
  hierarchy, a bad checkpoint) are raised.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable

from runtime import Executor, Future, Process, ProcessTerminated, Promise, dispatch, spawn, terminate, wait
from runtime import generate_id

from ._backend import DeviceBackend, DeviceOperation, SimulatedCrash, validate_cgroup, validate_cgroups_root
from ._cgroups_v1 import CgroupsV1Backend
from ._cgroups_v2 import CgroupsV2Backend
from ._detect import resolve_backend
from ._errors import DeviceControlError
from ._memory import MemoryBackend
from ._rules import CgroupDeviceAccess, DeviceRule, as_rules, check_diff
from ._worker import WorkerBackend, WorkerError

logger = logging.getLogger(__name__)


class DeviceControlProcess(Process):
    """The single writer of device rules (see module rules)."""

    def __init__(self, backend: DeviceBackend, executor: Executor | None = None) -> None:
        super().__init__(id=generate_id("device-control"))
        self.backend = backend
        self.executor = executor if executor is not None else Executor(1, name="device-control")
        self.inline = backend.name == "memory"
        self.remote = isinstance(backend, WorkerBackend)
        self._queued: list[tuple[DeviceOperation, Promise]] = []
        self._in_flight: list[tuple[DeviceOperation, Promise]] = []
        self._draining = False
        self._sent: deque[list[tuple[DeviceOperation, Promise]]] = deque()
        """Worker process: the batches sent to it, oldest first."""
        self.window = WINDOW
        self._reading = False
        self._flush_scheduled = False
        self._flushing = False
        self._restarting = False
        self.batches = 0
        """Executor jobs run so far (each one drained batch)."""
        self.operations = 0
        """Operations submitted so far."""

    def submit(self, op: DeviceOperation) -> Any:
        """Queue ``op``; a Future of its result (inline value for in-memory)."""
        self.operations += 1
        if self.inline:
            try:
                result = self.backend.apply_batch([op])[0]
            except SimulatedCrash as crash:
                return Future.failed(crash)
            if isinstance(result, BaseException):
                raise result
            return result
        promise: Promise = Promise()
        self._queued.append((op, promise))
        if self.remote:
            if not self._sent:
                self._pump()  # the worker is idle: at once
            elif len(self._sent) < self.window and not self._flush_scheduled:
                self._flush_scheduled = True  # with what else comes in this drain
                dispatch(self.pid, DeviceControlProcess._flush)
        elif not self._draining:
            self._draining = True
            dispatch(self.pid, DeviceControlProcess._run_batches)
        return promise.future

    async def _run_batches(self) -> None:
        try:
            while self._queued:
                batch = self._take()
                try:
                    results = await self.executor.run(self.backend.apply_batch, [op for op, _ in batch])
                except (Exception, SimulatedCrash) as error:  # the job broke: every caller hears it
                    results = [error] * len(batch)
                self._in_flight = []
                _resolve(batch, results)
        finally:
            self._draining = False

    def _take(self) -> list[tuple[DeviceOperation, Promise]]:
        batch, self._queued = self._queued, []
        self._in_flight = batch
        self.batches += 1
        return batch

    # -- worker process: at most ``window`` batches in the worker -------------
    def _pump(self) -> None:
        """Send what is queued now (the worker has room); start a new worker
        first if the last one went away."""
        worker: WorkerBackend = self.backend  # type: ignore[assignment]
        if worker.process is None:
            if not self._restarting:
                self._restarting = True
                dispatch(self.pid, DeviceControlProcess._restart)
            return
        if len(self._queued) > MAX_WORKER_BATCH:  # frames stay far below the worker's limit
            batch, self._queued = self._queued[:MAX_WORKER_BATCH], self._queued[MAX_WORKER_BATCH:]
            self.batches += 1
        else:
            batch = self._take()
        self._in_flight = []
        try:
            complete = worker.send([op for op, _ in batch])
        except Exception as error:
            _resolve(batch, [error] * len(batch))
            return
        self._sent.append(batch)
        if not complete and not self._flushing:
            self._flushing = True
            dispatch(self.pid, DeviceControlProcess._flush_outbox)
        if self._queued and len(self._sent) < self.window:
            self._pump()
        if not self._reading:
            self._reading = True
            dispatch(self.pid, DeviceControlProcess._read)

    async def _flush_outbox(self) -> None:
        """Write what did not fit in the pipe; a worker that went away is
        reported by ``_read`` (end of file), with its batches."""
        worker: WorkerBackend = self.backend  # type: ignore[assignment]
        try:
            await worker.flush()
        except Exception:
            pass
        finally:
            self._flushing = False

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._queued and len(self._sent) < self.window:
            self._pump()

    async def _restart(self) -> None:
        worker: WorkerBackend = self.backend  # type: ignore[assignment]
        try:
            await worker.restart()
        except Exception as error:  # what waited for it hears why
            batch = self._take()
            self._in_flight = []
            _resolve(batch, [error] * len(batch))
            return
        finally:
            self._restarting = False
        if self._queued and len(self._sent) < self.window:
            self._pump()

    async def _read(self) -> None:
        """Results of the batches in the worker, oldest first, as they come
        (a batch's results may come in parts); what queued meanwhile is sent
        before the callers are told, so the worker and the event loop work
        at the same time."""
        worker: WorkerBackend = self.backend  # type: ignore[assignment]
        told = 0  # callers of the oldest batch told so far
        try:
            while self._sent:
                batch = self._sent[0]
                try:
                    done, results = await worker.receive_part(len(batch))
                except Exception as error:  # the worker went away: every batch in it fails
                    lost, self._sent = list(self._sent), deque()
                    lost[0] = lost[0][told:]
                    told = 0
                    for each in lost:
                        _resolve(each, [error] * len(each))
                    if self._queued:
                        self._pump()
                    continue
                part = batch[told:told + len(results)]
                if done:
                    self._sent.popleft()
                    told = 0
                    if self._queued and len(self._sent) < self.window:
                        self._pump()
                else:
                    told += len(results)
                _resolve(part, results)
        finally:
            self._reading = False

    def finalize(self) -> None:
        error = ProcessTerminated(f"Device control {self.pid} terminated before the operation completed")
        for _op, promise in [*self._in_flight, *(item for batch in self._sent for item in batch), *self._queued]:
            promise.fail(error)
        idle = not self._in_flight
        self._in_flight, self._queued, self._sent = [], [], deque()
        self.executor.shutdown(wait=False)
        close = getattr(self.backend, "close", None)
        if (idle or self.remote) and close is not None:
            close()  # releases what the backend holds open (v2: cached programs; a worker: its pipes)


WINDOW = 2
"""Batches in a device worker process at once: one it applies, one waiting,
so that it goes straight on to the next."""

MAX_WORKER_BATCH = 4096
"""Operations in one frame to a device worker process at most (a longer
queue goes as several batches)."""

WORKERS = ("thread", "process")
"""Where a kernel backend runs: a thread of this process, or a device worker
process of its own (see ``_worker``)."""


def _resolve(batch: list[tuple[DeviceOperation, Promise]], results: list[Any]) -> None:
    for (_op, promise), result in zip(batch, results):
        if isinstance(result, BaseException):
            promise.fail(result)
        else:
            promise.set_value(result)


async def _build_backend(
    executor: Executor, backend: str, hierarchy: str | None, cgroups_root: str, work_dir: str | None,
    worker: str = "thread",
) -> Any:
    validate_cgroups_root(cgroups_root)
    if worker not in WORKERS:
        raise DeviceControlError(f"Unknown device worker {worker!r}: expected one of {', '.join(WORKERS)}")
    kind, hierarchy = resolve_backend(backend, hierarchy)
    if kind == "memory":
        return MemoryBackend(f"memory:{hierarchy or ''}/{cgroups_root}", shared=True)
    if kind == "cgroups_v2" and work_dir is None:
        raise DeviceControlError("cgroups v2 device control needs a work_dir for its checkpoint")
    assert hierarchy is not None
    if worker == "process":
        try:
            return await WorkerBackend.start(kind, hierarchy, cgroups_root, work_dir)
        except WorkerError as error:  # no child process here (not the backend's own error): a thread
            logger.warning("%s; device control for %s uses a thread of this process instead", error, kind)
    if kind == "cgroups_v1":
        return await executor.run(CgroupsV1Backend, hierarchy, cgroups_root)
    return await executor.run(CgroupsV2Backend, hierarchy, cgroups_root, work_dir)


class DeviceControl:
    """Handle of a ``DeviceControlProcess``; every method returns a Future."""

    def __init__(self, process: DeviceControlProcess) -> None:
        self._process = process
        self.pid = process.pid
        self._checked: dict[int, tuple[tuple, tuple[DeviceRule, ...]]] = {}
        self.backend_name: str = process.backend.name
        self.root: str = process.backend.root

    @classmethod
    async def create(
        cls,
        backend: str = "auto",
        hierarchy: str | None = None,
        cgroups_root: str = "gpu-isolator",
        work_dir: str | None = None,
        backend_impl: DeviceBackend | None = None,
        worker: str = "thread",
    ) -> "DeviceControl":
        """Build the backend and spawn the actor (inside a ``runtime.Runtime``).

        ``worker``: ``thread`` runs a kernel backend in this process's
        executor; ``process`` in a device worker process (``_worker``: the
        kernel work then overlaps the event loop's). Ignored for in-memory
        and for ``backend_impl``."""
        executor = Executor(1, name="device-control")
        if backend_impl is None:
            try:
                backend_impl = await _build_backend(executor, backend, hierarchy, cgroups_root, work_dir, worker)
            except BaseException:
                executor.shutdown(wait=False)
                raise
        process = DeviceControlProcess(backend_impl, executor)
        spawn(process)
        logger.info("Device control %s uses %s at %s", process.pid, backend_impl.name, backend_impl.root)
        return cls(process)

    def _submit(self, kind: str, *args: Any) -> Future:
        return dispatch(self.pid, DeviceControlProcess.submit, DeviceOperation(kind, args))

    def _rules(self, rules: Iterable[DeviceRule | str]) -> tuple[DeviceRule, ...]:
        """``as_rules(rules)``; a tuple seen before (callers pass the same
        policy tuples again and again) is found by identity, unchecked."""
        if type(rules) is not tuple:
            return as_rules(rules)
        hit = self._checked.get(id(rules))
        if hit is not None and hit[0] is rules:
            return hit[1]
        checked = as_rules(rules)
        if len(self._checked) >= 256:
            self._checked.clear()
        self._checked[id(rules)] = (rules, checked)  # keeps ``rules`` alive: its id stays its own
        return checked

    def configure(
        self, cgroup: str, allow: Iterable[DeviceRule | str], deny: Iterable[DeviceRule | str] = ()
    ) -> Future[CgroupDeviceAccess]:
        """Create ``cgroup`` if missing and make its policy ``(allow, deny)``; the normalised policy."""
        try:
            return self._submit("configure", validate_cgroup(cgroup), self._rules(allow), self._rules(deny))
        except DeviceControlError as error:
            return Future.failed(error)

    def reconfigure(
        self, cgroup: str, add: Iterable[DeviceRule | str] = (), remove: Iterable[DeviceRule | str] = ()
    ) -> Future[CgroupDeviceAccess]:
        """Grant ``add`` and revoke ``remove`` (exact rules); the new policy."""
        try:
            return self._submit("reconfigure", validate_cgroup(cgroup), *check_diff(add, remove))
        except DeviceControlError as error:
            return Future.failed(error)

    def remove(self, cgroup: str) -> Future[bool]:
        """Delete ``cgroup``; False (with a warning) while processes remain in it."""
        try:
            return self._submit("remove", validate_cgroup(cgroup))
        except DeviceControlError as error:
            return Future.failed(error)

    def state(self, cgroup: str) -> Future[CgroupDeviceAccess | None]:
        """The cgroup's policy (v1: read from the kernel), None when unknown."""
        try:
            return self._submit("state", validate_cgroup(cgroup))
        except DeviceControlError as error:
            return Future.failed(error)

    def exists(self, cgroup: str) -> Future[bool]:
        """Whether the cgroup exists."""
        try:
            return self._submit("exists", validate_cgroup(cgroup))
        except DeviceControlError as error:
            return Future.failed(error)

    def list_cgroups(self) -> Future[list[str]]:
        """Every cgroup below the root (relative paths, sorted)."""
        return self._submit("list_cgroups")

    def reconcile(
        self, cgroup: str, allow: Iterable[DeviceRule | str], deny: Iterable[DeviceRule | str] = ()
    ) -> Future[list[str]]:
        """Repair drift: make the kernel enforce ``(allow, deny)``; the repairs, in words."""
        try:
            desired = CgroupDeviceAccess.create(as_rules(allow), as_rules(deny))
            return self._submit("reconcile", validate_cgroup(cgroup), desired)
        except DeviceControlError as error:
            return Future.failed(error)

    def remove_root(self) -> Future[bool]:
        """Delete the root itself once no cgroup is left below it."""
        return self._submit("remove_root")

    def path(self, cgroup: str) -> str:
        """The absolute path of ``cgroup`` (for tests and logs)."""
        return self._process.backend.path(validate_cgroup(cgroup))

    @property
    def batches(self) -> int:
        """Executor jobs run so far (one per drained batch)."""
        return self._process.batches

    @property
    def operations(self) -> int:
        """Operations submitted so far."""
        return self._process.operations

    async def close(self) -> None:
        """Terminate the actor and wait for it (and for its worker process to exit)."""
        terminate(self.pid)
        await wait(self.pid)
        if self._process.remote:
            await self._process.backend.wait_closed()
