"""One device worker process as the agent sees it: starting it, its pipes, its frames.

Rules:
- ``start_process(spec, lock)`` (blocking: run it in an executor) makes the
  two pipes and starts the child from a thread of its own that then waits
  for it: that thread reaps the child (no zombie) and lives exactly as long
  as it, so the child's ``PR_SET_PDEATHSIG`` fires when the agent dies, not
  when some pool thread exits. The child runs in a session of its own (a
  terminal's Ctrl-C does not stop it mid-batch) and inherits the
  work-directory lock (``_lock``). No pipes (EMFILE ...) or no child is a
  ``WorkerError`` saying so.
- ``WorkerProcess`` holds one child's pipes. Reading: ``next_frame()`` gives
  its frames in order (asyncio: one reader callback for the child's life;
  trio: ``wait_readable``); ``ChildGone`` once none is to come. Once its
  reader calls ``listen(on_frame, on_end)`` (after the ready frame), every
  frame goes to ``on_frame(frame)`` as it arrives, in order, from the
  reader callback itself (asyncio: no task and no extra loop turn between
  the child's answer and its callers; trio: ``read_frames()``, run as a
  task, does the reading), and the end once to ``on_end(error)``:
  ``ChildGone`` at the end of its pipe, or the error that a frame raised
  (one that cannot be read, or that ``on_frame`` refused). Writing:
  ``send(entries)`` frames a batch and writes what the pipe takes now,
  never blocking; the rest waits in an outbox that ``flush()`` writes as
  the child reads. It counts the bytes made and the bytes the pipe took, so
  ``reached(batch)`` tells whether any byte of a batch got to the child.
- While a batch is in the child, for up to ``AWAKE`` seconds after it was
  sent, the event loop is kept from sleeping (asyncio: a callback that
  queues itself again each turn, so the loop polls its descriptors
  without waiting): the child's answer is then read as it comes, and the
  child's ``write(2)`` wakes no sleeping CPU. Nothing waits on the loop
  meanwhile: every other callback and descriptor is served each turn.
  Only where this process may run on two CPUs or more (on one, the loop
  would keep the child from its answer).
- ``close()`` closes the pipes (the child exits after the operation it
  applies) and wakes whatever waits on them; a listener is dropped without
  being told (whoever closes knows).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from runtime import Promise

from ._backend import DeviceOperation
from ._errors import WorkerError
from ._frames import READ_SIZE, FrameReader, encode, wire
from ._lock import WorkDirLock
from ._worker_child import BOOT, FENCED_EXIT

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Entry = tuple[DeviceOperation, Promise]

AWAKE = 0.0005
"""Seconds the event loop is kept from sleeping while a batch is in the child
(see the module rules)."""

_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ChildGone(Exception):
    """The child's pipe closed, broke or was closed here."""


class Batch:
    """Operations sent to a child in one frame, and where that frame starts."""

    __slots__ = ("entries", "start")

    def __init__(self, entries: list[Entry], start: int) -> None:
        self.entries = entries
        self.start = start
        """Offset of the batch's first byte in the stream to the child."""


def start_process(
    spec: dict[str, Any], lock: WorkDirLock | None, boot: str = BOOT
) -> tuple[subprocess.Popen, threading.Thread, int, int]:
    """Pipes and the child, started from a thread that then waits for it
    (blocking: run in an executor). ``(process, thread, read_fd, write_fd)``."""
    fds: list[int] = []
    try:
        try:
            to_child = os.pipe()
            fds += to_child
            from_child = os.pipe()
            fds += from_child
        except OSError as error:
            raise WorkerError(f"Failed to start the device worker process: cannot create its pipes: {error}") from error
        keep = [to_child[0], from_child[1]] + ([lock.fd] if lock is not None else [])
        spec = dict(spec, fds=[to_child[0], from_child[1]])
        path = [_PACKAGE_ROOT, *(p for p in sys.path if p)]
        argv = [sys.executable, "-I", "-S", "-c", boot, json.dumps(spec), *path]
        started = threading.Event()
        outcome: list[Any] = []

        def parent() -> None:  # the child's parent thread: it lives as long as the child
            try:
                process = subprocess.Popen(
                    argv, pass_fds=keep, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
                )
            except BaseException as error:  # told to the starter below
                outcome.append(error)
                started.set()
                return
            outcome.append(process)
            started.set()
            process.wait()

        thread = threading.Thread(target=parent, name="device-worker-parent", daemon=True)
        try:
            thread.start()
        except RuntimeError as error:  # no thread to be its parent
            raise WorkerError(f"Failed to start the device worker process: {error}") from error
        started.wait()
        if isinstance(outcome[0], BaseException):
            error = outcome[0]
            raise WorkerError(f"Failed to start the device worker process: {error}") from error
        process = outcome[0]
        os.close(to_child[0])
        os.close(from_child[1])
        os.set_blocking(from_child[0], False)
        os.set_blocking(to_child[1], False)
        fds = []
        if lock is not None:
            lock.record(worker=process.pid)
        return process, thread, from_child[0], to_child[1]
    finally:
        for fd in fds:
            os.close(fd)


class WorkerProcess:
    """One device worker process as the agent sees it: pipes, frames, batches."""

    def __init__(self, process: subprocess.Popen, thread: threading.Thread, read_fd: int, write_fd: int) -> None:
        self.process = process
        self.thread = thread
        self.pid = process.pid
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.frames = FrameReader()
        self.outbox = bytearray()
        self.offset = 0
        """Bytes of frames made for this child so far."""
        self.written = 0
        """Bytes the pipe to the child has accepted so far."""
        self.sent: deque[Batch] = deque()
        self.told = 0
        """Callers of the oldest batch told so far."""
        self.ready = False
        self.answered = False
        """Whether it sent the results of a batch."""
        self.flushing = False
        self.eof = False
        self.closed = False
        self.timed_out = False
        self._waiter: Promise | None = None
        self._write_waiter: Promise | None = None
        self._awake = False
        self._awake_until = 0.0
        self._on_frame: Callable[[Any], None] | None = None
        self._on_end: Callable[[BaseException], None] | None = None
        self._loop = asyncio._get_running_loop()
        if self._loop is not None:  # one reader callback for the child's life
            self._loop.add_reader(read_fd, self._on_readable)

    # -- reading ----------------------------------------------------------------
    def _on_readable(self) -> None:
        """asyncio: take what the child wrote; wake the reader."""
        try:
            while True:
                data = os.read(self.read_fd, READ_SIZE)
                if not data:
                    self._end()
                    break
                self.frames.feed(data)
                if len(data) < READ_SIZE:
                    break
        except BlockingIOError:
            pass
        except OSError:
            self._end()
        if self._on_frame is not None:
            self._deliver()
            return
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set_value(None)

    def listen(self, on_frame: Callable[[Any], None], on_end: Callable[[BaseException], None]) -> None:
        """From now on each frame goes to ``on_frame`` as it arrives, and the
        end to ``on_end`` (see module rules); frames already read go now."""
        self._on_frame, self._on_end = on_frame, on_end
        self._deliver()

    def _deliver(self) -> None:
        """Hand every whole frame read so far to the listener; then the end, if it came."""
        try:
            while self._on_frame is not None:
                frame = self.frames.next()
                if frame is None:
                    break
                self._on_frame(frame)
        except Exception as error:  # a frame this agent cannot read, or one its listener refused
            self._finish(error)
            return
        if self.eof:
            self._finish(ChildGone())

    def _finish(self, error: BaseException) -> None:
        on_end = self._on_end
        self._on_frame = self._on_end = None
        if on_end is not None:
            on_end(error)

    async def read_frames(self) -> None:
        """trio: read the pipe for the listener until the end (see ``listen``)."""
        while self._on_frame is not None and not self.closed and not self.eof:
            data = await self._read_trio()
            if data is None:
                break
            if data:
                self.frames.feed(data)
            else:
                self.eof = True
            self._deliver()
        if not self.closed:
            self._finish(ChildGone())

    def _end(self) -> None:
        self.eof = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.read_fd)

    async def next_frame(self) -> Any:
        """The child's next frame; ``ChildGone`` once there is none to come."""
        while True:
            frame = self.frames.next()
            if frame is not None:
                return frame
            if self.closed or self.eof:
                raise ChildGone()
            if self._loop is not None:
                self._waiter = Promise()
                await self._waiter.future
                continue
            data = await self._read_trio()
            if not data:  # closed here (None), or the end of its pipe (b"")
                if data is not None:
                    self.eof = True
                raise ChildGone()
            self.frames.feed(data)

    async def _read_trio(self) -> bytes | None:
        """trio: the child's next bytes once there are some; b"" at the end
        of its pipe (or when it broke), None once it was closed here."""
        import trio

        while True:
            try:
                return os.read(self.read_fd, READ_SIZE)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self.read_fd)
                except trio.ClosedResourceError:
                    return None
            except OSError:
                return b""

    # -- writing ----------------------------------------------------------------
    def send(self, entries: list[Entry]) -> bool:
        """Frame a batch and write what the pipe takes now; True when all of
        it is written (else ``flush``). ``ChildGone`` when the pipe is broken
        (the batch is kept: its offsets tell whether any of it got through)."""
        data = encode([(op.kind, wire(op.args)) for op, _ in entries])
        self.sent.append(Batch(entries, self.offset))
        self.offset += len(data)
        if self.outbox:
            self.outbox += data
            return False
        try:
            written = os.write(self.write_fd, data)
        except BlockingIOError:
            written = 0
        except OSError:
            raise ChildGone() from None
        self.written += written
        if self._loop is not None and _CPUS > 1:
            self._awake_until = time.perf_counter() + AWAKE
            if not self._awake:
                self._awake = True
                self._loop.call_soon(self._keep_awake)
        if written < len(data):
            self.outbox += memoryview(data)[written:]
            return False
        return True

    def _keep_awake(self) -> None:
        """One loop turn more without sleeping, while a batch waits for its answer (see module rules)."""
        if self.sent and not self.closed and time.perf_counter() < self._awake_until:
            self._loop.call_soon(self._keep_awake)
        else:
            self._awake = False

    async def flush(self) -> None:
        """Write the outbox as the child reads (``ChildGone`` if it goes)."""
        while self.outbox:
            if self.closed:
                raise ChildGone()
            try:
                written = os.write(self.write_fd, self.outbox)
            except BlockingIOError:
                await self._writable()
                continue
            except OSError:
                raise ChildGone() from None
            self.written += written
            del self.outbox[:written]

    async def _writable(self) -> None:
        fd, loop = self.write_fd, self._loop
        if loop is None:
            import trio

            try:
                await trio.lowlevel.wait_writable(fd)
            except trio.ClosedResourceError:
                raise ChildGone() from None
            return
        promise = self._write_waiter = Promise()

        def writable() -> None:
            loop.remove_writer(fd)
            promise.set_value(None)

        loop.add_writer(fd, writable)
        try:
            await promise.future
        finally:
            self._write_waiter = None
            if not loop.is_closed() and not self.closed:
                loop.remove_writer(fd)

    # -- the end ------------------------------------------------------------------
    def reached(self, batch: Batch) -> bool:
        """Whether any byte of ``batch`` got into the pipe to the child."""
        return self.written > batch.start

    def close(self) -> None:
        """Close the pipes: the child exits after the operation it applies."""
        if self.closed:
            return
        self.closed = True
        self._on_frame = self._on_end = None
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.read_fd)
            loop.remove_writer(self.write_fd)
        elif loop is None:
            try:
                import trio

                trio.lowlevel.notify_closing(self.read_fd)
                trio.lowlevel.notify_closing(self.write_fd)
            except (ImportError, RuntimeError):
                pass
        for waiter in (self._waiter, self._write_waiter):
            if waiter is not None:
                waiter.set_value(None)
        self._waiter = self._write_waiter = None
        self.outbox = bytearray()
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL the child if it still runs."""
        try:
            self.process.kill()
        except OSError:
            pass

    def expire(self) -> None:
        """The start-up bound passed without a ready frame."""
        if not self.ready and not self.closed:
            self.timed_out = True
            self.kill()

    def how(self) -> str:
        status = self.process.returncode
        if status is None:
            return "closed its pipe"
        if status == FENCED_EXIT:
            return "exited: its agent had gone (fenced)"
        return f"exited with status {status}"
