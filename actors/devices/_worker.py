"""Device worker driver: kernel work in a child process of the agent's own.

Why: the kernel work of a container (mkdir, one ``write(2)`` per rule,
rmdir ...) is ~20 short syscalls. In a thread of the agent's process each
one gives up the GIL and must take it back from the event loop, so the
loop's Python and the kernel work alternate instead of overlapping. In a
child process they run side by side, on two cores. The child's side is
``_worker_child``, the frames ``_frames``, one child's pipes and start-up
``_worker_process``.

Rules:
- ``WorkerDriver.start(...)`` starts a child and waits for its first frame:
  ready, or the error building the backend raised there (a bad hierarchy,
  a hierarchy of the wrong kind), which ``start`` raises unchanged. Anything that
  keeps a child from starting (no pipes, no ``sys.executable``, a child
  that dies or does not answer within ``START_TIMEOUT`` seconds) is a
  ``WorkerError`` saying so.
- Nothing blocks the event loop: a child is started in an executor job
  and reaped by a thread of its own (``_worker_process``); waiting for its
  exit is an executor job too, bounded.
- One child at a time, and one reader of its frames: the coroutine that
  started it reads its ready frame; then every result frame is handled, in
  order, as it arrives (``WorkerProcess.listen``: in the pipe's reader
  callback, so a caller's Future completes in the loop turn that read its
  answer), until the child goes. Nothing is sent to a child before its
  ready frame was read.
- ``submit(op)`` queues an operation. An idle child gets it at once; while
  the child works, what arrives is sent as one batch per drain (at most
  ``WINDOW`` batches in the child, at most ``MAX_WORKER_BATCH`` operations
  a batch). The pipe is never written blocking: what does not fit waits in
  an outbox written as the child reads. A batch's results may come in
  parts (v1); each caller hears its own result or its own error.
- A child that goes away (killed, crashed, fenced) fails every operation
  whose batch had reached it, even in part, with a ``WorkerError`` saying
  their effects are unknown: the kernel may hold any of them, so read it
  back before acting on them. A batch of which not one byte reached the
  child is certain not to be applied: it goes to the next child, in order.
  The next child starts when there is something to send; if it cannot
  start, what waited for it fails with the reason (nothing of it was sent).
  After ``MAX_QUICK_DEATHS`` children in a row that went away without
  answering a batch and before a byte of what was sent reached them, what
  waits fails instead of starting yet another: every restart ends.
- ``stop(error)`` (the actor's termination) fails what is queued or in the
  child with ``error`` and closes the pipes: the child exits after the
  operation it applies (its effects stand). ``await wait_stopped()`` waits
  for every child to exit (killed, with a warning, after a bound).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

from runtime import Clock, Executor, Future, Promise

from ._backend import DeviceOperation, validate_cgroup
from ._drivers import resolve
from ._errors import WorkerError
from ._frames import unwire
from ._lock import WorkDirLock
from ._worker_child import BOOT
from ._worker_process import Batch, ChildGone, Entry, WorkerProcess, start_process

logger = logging.getLogger(__name__)

WINDOW = 2
"""Batches in a device worker process at once: one it applies, one waiting,
so that it goes straight on to the next."""

MAX_WORKER_BATCH = 4096
"""Operations in one frame to a device worker process at most (a longer
queue goes as several batches)."""

START_TIMEOUT = 30.0
"""Seconds a new device worker process has to answer its first frame."""

EXIT_TIMEOUT = 5.0
"""Seconds to wait for a closed (or dead) device worker process to exit."""

MAX_QUICK_DEATHS = 3
"""Children in a row that may go away without answering and before anything
sent reached them, before what waits fails instead."""


def _unbound(fn: Callable[[], Any]) -> Any:
    raise RuntimeError("WorkerDriver.bind() was not called: the driver runs on the device control actor")


def _relay(records: Sequence[tuple[str, int, str]]) -> None:
    for name, level, message in records:
        logging.getLogger(name).log(level, "%s", message)


class WorkerDriver:
    """Runs device operations in a device worker process (see module rules)."""

    def __init__(self, kind: str, hierarchy: str, cgroups_root: str, work_dir: str | None,
                 lock: WorkDirLock | None = None) -> None:
        self.name = kind
        self.root = os.path.join(hierarchy, cgroups_root)
        self._prefix = self.root.rstrip("/") + "/"
        self.lock = lock
        self._spec = {"kind": kind, "hierarchy": hierarchy, "cgroups_root": cgroups_root, "work_dir": work_dir}
        self._executor = Executor(2, name="device-worker")
        self._later: Callable[[Callable[[], Any]], Any] = _unbound
        self._queue: list[Entry] = []
        self._child: WorkerProcess | None = None
        self._children: list[WorkerProcess] = []
        """Every child started and not yet seen to exit."""
        self._starting = False
        self._flush_scheduled = False
        self._quick_deaths = 0
        self._stopped: BaseException | None = None
        self._launched: list[tuple[Any, Any, int, int]] = []
        """Children started by an executor job and not yet taken over (see ``stop``)."""
        self._dying: dict[WorkerProcess, list[Entry]] = {}
        """What children that went away held, until they are reaped and it is failed."""
        self.batches = 0
        """Batches sent so far."""
        self.starts = 0
        """Children started so far (1 + restarts)."""

    @classmethod
    async def start(cls, kind: str, hierarchy: str, cgroups_root: str, work_dir: str | None,
                    lock: WorkDirLock | None = None) -> "WorkerDriver":
        """Start the first child; its backend's error raised here (see module rules)."""
        driver = cls(kind, hierarchy, cgroups_root, work_dir, lock)
        try:
            driver._child = await driver._start_child()
        except BaseException:
            driver._executor.shutdown(wait=False)
            raise
        return driver

    @property
    def worker_batches(self) -> int:
        """Every batch goes to a child: each one a round trip."""
        return self.batches

    @property
    def pid(self) -> int | None:
        """The running child's process id (None between children)."""
        child = self._child
        return child.pid if child is not None else None

    def path(self, cgroup: str) -> str:
        return self._prefix + validate_cgroup(cgroup)

    def bind(self, later: Callable[[Callable[[], Any]], Any]) -> None:
        """Run on the actor from now on: ``later(fn)`` calls ``fn()`` there."""
        self._later = later
        if self._child is not None:
            self._listen(self._child)

    # -- submitting -------------------------------------------------------------
    def submit(self, op: DeviceOperation) -> Future:
        promise: Promise = Promise()
        if self._stopped is not None:
            promise.fail(self._stopped)
            return promise.future
        self._queue.append((op, promise))
        child = self._child
        if child is None:
            if not self._starting:
                self._starting = True
                self._later(self._restart)
        elif child.ready:
            if not child.sent:
                self._pump(child)  # an idle child: at once
            elif len(child.sent) < WINDOW and not self._flush_scheduled:
                self._flush_scheduled = True  # with what else comes in this drain
                self._later(self._flush)
        return promise.future

    def _flush(self) -> None:
        self._flush_scheduled = False
        child = self._child
        if child is not None and child.ready and self._queue and len(child.sent) < WINDOW:
            self._pump(child)

    def _pump(self, child: WorkerProcess) -> None:
        """Send what is queued (the child has room), up to ``WINDOW`` batches."""
        while self._queue and len(child.sent) < WINDOW:
            entries, self._queue = self._queue[:MAX_WORKER_BATCH], self._queue[MAX_WORKER_BATCH:]
            self.batches += 1
            try:
                complete = child.send(entries)
            except ChildGone:
                child.ready = False  # its reader sees the end and sorts out what reached it
                return
            if not complete and not child.flushing:
                child.flushing = True
                self._later(lambda: self._flush_outbox(child))

    async def _flush_outbox(self, child: WorkerProcess) -> None:
        try:
            await child.flush()
        except ChildGone:
            child.ready = False  # the reader reports it
        finally:
            child.flushing = False

    # -- children -------------------------------------------------------------
    async def _start_child(self) -> WorkerProcess:
        spec = dict(
            self._spec,
            parent=os.getpid(),
            log_level=logging.getLogger("actors.devices").getEffectiveLevel(),
        )
        launched = await self._executor.run(self._launch, spec)
        self._launched.remove(launched)
        child = WorkerProcess(*launched)
        self._children.append(child)
        self.starts += 1
        timer = Clock.timer(START_TIMEOUT, child.expire)
        try:
            tag, value, records = await child.next_frame()
        except (ChildGone, WorkerError) as error:
            child.close()
            await self._reap(child)
            bound = f" (it did not answer within {START_TIMEOUT:g} s)" if child.timed_out else ""
            raise WorkerError(
                f"Device worker process {child.pid} {child.how()} before it was ready{bound}"
            ) from (error if isinstance(error, WorkerError) else None)
        finally:
            timer.cancel()
        _relay(records)
        if tag != "ready":
            child.close()
            await self._reap(child)
            raise value
        child.ready = True
        logger.debug("Device worker process %d runs %s at %s", child.pid, *value)
        return child

    def _launch(self, spec: dict[str, Any]) -> tuple[Any, Any, int, int]:
        """In an executor thread: start a child; remembered at once, so that
        ``stop`` closes it even when nobody awaits this job any more."""
        launched = start_process(spec, self.lock, BOOT)
        self._launched.append(launched)
        return launched

    async def _restart(self) -> None:
        """Start a new child for what is queued, then read its frames."""
        logger.info("Starting a new device worker process for %s at %s", self.name, self.root)
        try:
            child = await self._start_child()
        except Exception as error:  # no worker: what waited for one hears why (nothing of it was sent)
            self._starting = False
            waiting, self._queue = self._queue, []
            error.add_note("None of the waiting device operations was sent to a device worker process.")
            resolve(waiting, [error] * len(waiting))
            return
        self._starting = False
        if self._stopped is not None:
            child.close()
            return
        self._child = child
        self._listen(child)
        self._pump(child)

    def _listen(self, child: WorkerProcess) -> None:
        """From now on ``child``'s results are handled as they arrive (``_answered``)."""
        child.listen(lambda frame: self._answered(child, frame), lambda error: self._ended(child, error))
        if child._loop is None:  # trio: a task reads the pipe
            self._later(child.read_frames)

    def _answered(self, child: WorkerProcess, frame: Any) -> None:
        """One result frame of ``child``, for its oldest batch (raising: the child is broken)."""
        tag, wired, records = frame
        if records:
            _relay(records)
        results = unwire(wired)
        if not child.sent:
            raise WorkerError(f"Device worker process {child.pid} sent results for no batch")
        self._quick_deaths = 0  # it answered
        child.answered = True
        batch = child.sent[0]
        told = child.told
        part = batch.entries[told : told + len(results)] if told or tag != "done" else batch.entries
        if tag == "done":
            child.sent.popleft()
            child.told = 0
        else:
            child.told += len(results)
        if self._queue and child.ready and len(child.sent) < WINDOW:
            self._pump(child)  # the child goes on while the callers are told
        resolve(part, results)

    def _ended(self, child: WorkerProcess, error: BaseException) -> None:
        """``child``'s pipe ended, or a frame of it could not be handled."""
        if not isinstance(error, ChildGone):  # a frame this agent cannot read: the child is broken
            logger.error("Device worker process %d sent what this agent cannot read (%s); stopping it",
                         child.pid, error)
            child.kill()
        if self._stopped is None:
            self._later(lambda: self._lost(child))

    async def _lost(self, child: WorkerProcess) -> None:
        """``child`` went away: fail what reached it, keep what did not (see module rules)."""
        if self._child is child:
            self._child = None
        child.close()
        reached = [batch for batch in child.sent if child.reached(batch)]
        kept = [entry for batch in child.sent if not child.reached(batch) for entry in batch.entries]
        if reached:
            reached[0] = Batch(reached[0].entries[child.told :], reached[0].start)
        child.sent.clear()
        self._queue[:0] = kept  # not one byte of these reached it: the next child applies them, first
        self._quick_deaths = 0 if reached or child.answered else self._quick_deaths + 1
        if self._queue and self._stopped is None and not self._starting:
            if self._quick_deaths >= MAX_QUICK_DEATHS:
                waiting, self._queue = self._queue, []
                error = WorkerError(
                    f"{self._quick_deaths} device worker processes in a row went away before anything sent to"
                    f" them reached them (the last was process {child.pid}); these device operations were not"
                    " sent again (none of them reached a worker)"
                )
                self._quick_deaths = 0
                resolve(waiting, [error] * len(waiting))
            else:
                self._starting = True
                self._later(self._restart)
        held = self._dying[child] = [entry for batch in reached for entry in batch.entries]
        await self._reap(child)
        del self._dying[child]
        message = f"Device worker process {child.pid} {child.how()}{_holding(held)}; the next operation starts a new one"
        (logger.error if held else logger.warning)("%s", message)
        resolve(held, [WorkerError(message)] * len(held))

    async def _reap(self, child: WorkerProcess) -> None:
        """Wait (bounded, off the loop) until the child has exited."""
        await self._executor.run(child.thread.join, EXIT_TIMEOUT)
        if child.thread.is_alive():
            logger.warning("Device worker process %d did not exit in %g s; killing it", child.pid, EXIT_TIMEOUT)
            child.kill()
            await self._executor.run(child.thread.join, EXIT_TIMEOUT)
        if not child.thread.is_alive() and child in self._children:
            self._children.remove(child)

    # -- the end ----------------------------------------------------------------
    def stop(self, error: BaseException) -> None:
        """Fail what is queued or in the child with ``error``; close the pipes."""
        self._stopped = error
        entries = list(self._queue)
        self._queue = []
        child = self._child
        if child is not None:
            for index, batch in enumerate(child.sent):
                entries += batch.entries[child.told:] if index == 0 else batch.entries
            child.sent.clear()
        for _op, promise in entries:
            promise.fail(error)
        for dead, held in self._dying.items():
            lost = WorkerError(f"Device worker process {dead.pid} went away{_holding(held)}")
            resolve(held, [lost] * len(held))
        self._dying = {}
        for each in self._children:
            each.close()
        for _process, _thread, read_fd, write_fd in self._launched:  # started, never taken over
            os.close(read_fd)
            os.close(write_fd)
        self._executor.shutdown(wait=False)
        if self.lock is not None:
            self.lock.release()  # a child still running holds it until it exits

    async def wait_stopped(self) -> None:
        """After ``stop``: until every child has exited (killed after a bound)."""
        for child in list(self._children):
            await self._reap(child)
        for _process, thread, _read_fd, _write_fd in self._launched:
            await self._executor.run(thread.join, EXIT_TIMEOUT)
        self._executor.shutdown(wait=False)


def _holding(entries: list[Entry]) -> str:
    if not entries:
        return ""
    return f" holding {len(entries)} device operations (their effects are unknown: read the kernel state back)"
