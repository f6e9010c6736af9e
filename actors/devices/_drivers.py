"""Drivers: how device control runs a backend's work (in line or in a thread).

A driver (``Driver``, a ``typing.Protocol``) takes each operation with
``submit(op)`` and returns a Future of its result. There are three:
``InlineDriver`` and ``ThreadDriver`` here, ``WorkerDriver`` (a device
worker process) in ``_worker``. Device control picks one when it is created
and only ever calls these methods:

- ``bind(later)``: from now on ``later(fn)`` runs ``fn()`` on the device
  control actor (a coroutine it returns runs as one of its async methods).
- ``submit(op) -> Future``: one value or one exception per operation; one
  failure fails no other caller; operations apply in the order submitted.
- ``path(cgroup)``, ``name``, ``root``, ``batches``, ``worker_batches``
  (batches sent to a device worker process: each a round trip the event
  loop waits on; 0 here), ``pid`` (of a worker process; None here).
- ``stop(error)``: fail what is queued or in flight with ``error`` (work
  already in a thread still finishes there; its effects stand but are not
  reported) and release what the driver holds. ``await wait_stopped()``
  waits until nothing of it can touch the kernel any more.

Rules:
- Every driver applies an operation through the backend's one function
  (``_backend.applier``; a batch through ``apply_batch``, which uses it), as
  the device worker process does.
- ``InlineDriver``: a backend that never blocks (in memory) is applied at
  once, on the actor, with no hop.
- ``ThreadDriver``: group commit. An operation that arrives while an
  executor job runs is queued; when the job ends, ALL queued operations go
  to the backend as ONE batch in ONE executor job (``apply_batch``).
- Either way, an exception that is not an ``Exception`` (fault injection's
  simulated crash) fails every caller of its batch with it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

from runtime import Executor, Future, Promise

from ._backend import DeviceBackend, DeviceOperation, applier
from ._lock import WorkDirLock

Entry = tuple[DeviceOperation, Promise]


class Driver(Protocol):
    """How device control runs a backend's work (see module rules)."""

    name: str
    root: str
    batches: int
    """Batches handed to the backend so far (one per operation in line)."""
    worker_batches: int
    """Batches sent to a device worker process so far (0 in line or in a thread)."""

    @property
    def pid(self) -> int | None:
        """The device worker process's id while one runs (None otherwise)."""

    def bind(self, later: Callable[[Callable[[], Any]], Any]) -> None:
        """From now on ``later(fn)`` runs ``fn()`` on the device control actor."""

    def path(self, cgroup: str) -> str:
        """The absolute path of ``cgroup``."""

    def submit(self, op: DeviceOperation) -> Future:
        """A Future of ``op``'s result (see module rules)."""

    def stop(self, error: BaseException) -> None:
        """Fail what is queued or in flight with ``error``; release what it holds."""

    async def wait_stopped(self) -> None:
        """Until nothing of it can touch the kernel any more."""


def apply_batch(backend: DeviceBackend, ops: Sequence[DeviceOperation]) -> list[Any]:
    """``backend.apply_batch(ops)`` (each through its applier); a batch that
    broke (a non-``Exception``) gives its error to every operation."""
    try:
        return backend.apply_batch(ops)
    except BaseException as error:  # noqa: BLE001 - the job broke: every caller hears it
        return [error] * len(ops)


def resolve(entries: Sequence[Entry], results: Sequence[Any]) -> None:
    """Complete each caller's Future with its own result or exception."""
    for (_op, promise), result in zip(entries, results):
        if isinstance(result, BaseException):
            promise.fail(result)
        else:
            promise.set_value(result)


class InlineDriver:
    """Applies each operation at once, on the actor (see module rules)."""

    pid = None
    worker_batches = 0

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.root = backend.root
        self.batches = 0
        self._apply = applier(backend)

    def bind(self, later: Callable[[Callable[[], Any]], Any]) -> None:
        pass

    def path(self, cgroup: str) -> str:
        return self.backend.path(cgroup)

    def submit(self, op: DeviceOperation) -> Future:
        self.batches += 1
        try:
            result = self._apply(op.kind, op.args)
        except BaseException as error:  # noqa: BLE001 - a simulated crash, as apply_batch gives it
            result = error
        if isinstance(result, BaseException):
            return Future.failed(result)
        return Future.ready(result)

    def stop(self, error: BaseException) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    async def wait_stopped(self) -> None:
        pass


class ThreadDriver:
    """Group commit into one executor job at a time (see module rules)."""

    pid = None
    worker_batches = 0

    def __init__(self, backend: DeviceBackend, executor: Executor, lock: WorkDirLock | None = None) -> None:
        self.backend = backend
        self.name = backend.name
        self.root = backend.root
        self.executor = executor
        self.lock = lock
        self.batches = 0
        """Executor jobs run so far (each one drained batch)."""
        self._later: Callable[[Callable[[], Any]], Any] | None = None
        self._queued: list[Entry] = []
        self._in_flight: list[Entry] = []
        self._draining = False
        self._state = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._stopped = False

    def bind(self, later: Callable[[Callable[[], Any]], Any]) -> None:
        self._later = later

    def path(self, cgroup: str) -> str:
        return self.backend.path(cgroup)

    def submit(self, op: DeviceOperation) -> Future:
        promise: Promise = Promise()
        self._queued.append((op, promise))
        if not self._draining and self._later is not None:
            self._draining = True
            self._later(self._run_batches)
        return promise.future

    async def _run_batches(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                self._in_flight = batch
                self.batches += 1
                self._idle.clear()
                results = await self.executor.run(self._job, [op for op, _ in batch])
                self._in_flight = []
                resolve(batch, results)
        finally:
            self._draining = False

    def _job(self, ops: list[DeviceOperation]) -> list[Any]:
        """In the executor's thread: the batch, then the resources back if
        device control stopped meanwhile."""
        try:
            return apply_batch(self.backend, ops)
        finally:
            with self._state:
                self._idle.set()
                stopped = self._stopped
            if stopped:
                self._release()

    def stop(self, error: BaseException) -> None:
        entries = [*self._in_flight, *self._queued]
        self._in_flight, self._queued = [], []
        for _op, promise in entries:
            promise.fail(error)
        self.executor.shutdown(wait=False)
        with self._state:
            self._stopped = True
            idle = self._idle.is_set()
        if idle:  # else the job releases them when it ends
            self._release()

    def _release(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()  # v2: the cached program descriptors
        if self.lock is not None:
            self.lock.release()

    async def wait_stopped(self) -> None:
        if not self._idle.is_set():
            await self.executor.run(self._idle.wait, STOP_TIMEOUT)
            self.executor.shutdown(wait=False)


STOP_TIMEOUT = 5.0
"""Seconds ``wait_stopped`` waits for a job still in its thread."""
