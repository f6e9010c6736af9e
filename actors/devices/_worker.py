"""Device worker: a kernel backend run in a child process of its own.

Why: the kernel work of a container (mkdir, one ``write(2)`` per rule,
rmdir ...) is ~20 short syscalls. In a thread of the agent's process each
one gives up the GIL and must take it back from the event loop, so the
loop's Python and the kernel work alternate instead of overlapping. In a
child process they run side by side, on two cores.

Rules:
- ``WorkerBackend.start(kind, hierarchy, cgroups_root, work_dir)`` spawns
  the child (``sys.executable`` in isolated mode, in a session of its own so
  that a terminal's Ctrl-C does not stop it mid-batch) and waits for its
  first frame: ready (the backend's name and root), or the error that
  building the backend raised there (a bad hierarchy, a garbled v2
  checkpoint ...), which ``start`` raises unchanged.
- The child holds the one real backend (v1 or v2) and applies what it is
  sent, batch by batch, in the order sent: one value or exception per
  operation, exactly as in a thread. A backend with ``applies_each`` (v1:
  operations are independent) is given the operations one at a time and
  its results go back at least every ``SLICE`` seconds, so the event loop
  goes on with the first containers of a batch while the rest are applied;
  v2 applies a batch whole (one checkpoint write per batch). Warnings and
  errors logged there come back with the results and are logged here under
  the same logger names (the child logs at this process's level for
  ``actors.devices``).
- ``send(ops)`` / ``flush()`` / ``receive_part(n)`` are used by the device
  control actor only (it keeps at most ``WINDOW`` batches in the child, see
  ``_control``). The pipe to
  the child is never written blocking: what does not fit waits in an outbox
  that ``flush`` writes as the child reads. Frames (``_FrameCodec``) are a
  4-byte length and a pickle, over two private pipes: the only input the
  child reads. It exits when the parent's end closes (the parent exiting
  included). Policies repeat: each goes over once and by number after.
- The child exiting (killed, crashed) fails the batches in it with a
  ``WorkerError`` saying so; the next batch starts a new child (v1 keeps
  all its state in the kernel; v2 reloads its checkpoint); if that fails,
  its callers get the error.
- ``path`` is computed here, without a round trip; ``kernel_hook`` cannot be
  set (fault injection runs the backend in a thread: pass ``backend_impl``).
- ``close()`` closes the pipes: the child exits at its next result frame
  (or read) after the operation it is applying; effects so far stand.
  ``await wait_closed()`` then waits for it (``DeviceControl.close`` does).
- Start-up: the child imports only the device backend modules (a stub
  stands in for the ``actors``, ``actors.devices`` and ``runtime``
  packages, whose ``__init__`` would import the whole agent): ~0.1 s.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from ._backend import DeviceOperation, apply_one, validate_cgroup
from ._errors import DeviceControlError
from ._rules import CgroupDeviceAccess, DeviceRule

if TYPE_CHECKING:
    import asyncio
    import subprocess

# asyncio and subprocess are imported where the parent uses them: the child
# never does, and importing asyncio alone would double its start-up time.

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
SLICE = 0.0005
"""Seconds between result frames while an ``applies_each`` backend works
through a batch."""
MAX_FRAME = 64 << 20
"""Frames larger than this are refused (a broken peer, not a batch)."""

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BOOT = """\
import json, sys, types
spec = json.loads(sys.argv[1])
sys.path[:0] = spec["path"]
def stub(name, path):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
    return module
runtime = stub("runtime", spec["root"] + "/runtime")
from runtime._errors import Failure
runtime.Failure = Failure
stub("actors", spec["root"] + "/actors")
stub("actors.devices", spec["root"] + "/actors/devices")
from actors.devices._worker import serve
serve(spec)
"""


class WorkerError(DeviceControlError):
    """The device worker process could not be started or went away."""


# -- frames ---------------------------------------------------------------------
def _interned(value: object) -> bool:
    """Sent once, then by number: policies (rule tuples, ``CgroupDeviceAccess``)."""
    kind = type(value)
    return kind is CgroupDeviceAccess or (kind is tuple and len(value) > 0 and type(value[0]) is DeviceRule)  # type: ignore[arg-type,index]


class _FrameCodec:
    """One direction's frames, each way (see module rules).

    An object ``_interned`` picks goes whole the first time, with a number,
    and as that number after: the receiver gets the very same object back,
    which the backends' caches recognise by identity. At most ``CAPACITY``
    numbers are in use; then numbering starts again from 0 (the receiver
    overwrites what it had under a number when a whole object comes)."""

    CAPACITY = 4096

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, object]] = {}  # id -> (number, the object, kept alive)
        self._received: dict[int, object] = {}
        self._defining: object = None
        self.buffer = bytearray()

    def _persistent_id(self, obj: object) -> Any:
        if obj is self._defining:  # inside the (number, obj) just returned: whole
            self._defining = None
            return None
        if not _interned(obj):
            return None
        known = self._sent.get(id(obj))
        if known is not None:
            return known[0]
        if len(self._sent) >= self.CAPACITY:
            self._sent.clear()
        number = len(self._sent)
        self._sent[id(obj)] = (number, obj)
        self._defining = obj
        return (number, obj)

    def _persistent_load(self, pid: Any) -> object:
        if type(pid) is int:
            return self._received[pid]
        number, obj = pid
        self._received[number] = obj
        return obj

    def encode(self, value: Any) -> bytes:
        out = io.BytesIO()
        out.write(b"\0\0\0\0")
        pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._persistent_id  # type: ignore[method-assign]
        pickler.dump(value)
        data = out.getbuffer()
        _HEADER.pack_into(data, 0, len(data) - 4)
        return bytes(data)

    def write(self, fd: int, value: Any) -> None:
        """Write one frame of ``value`` (blocking until it is all written)."""
        view = memoryview(self.encode(value))
        while view:
            view = view[os.write(fd, view) :]

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next(self) -> Any | None:
        """The next whole frame's value, or None when it has not all arrived."""
        buffer = self.buffer
        if len(buffer) < 4:
            return None
        (size,) = _HEADER.unpack_from(buffer)
        if size > MAX_FRAME:
            raise WorkerError(f"Device worker frame of {size} bytes (at most {MAX_FRAME}): the peer is broken")
        if len(buffer) < 4 + size:
            return None
        with memoryview(buffer) as view:
            unpickler = pickle.Unpickler(io.BytesIO(view[4 : 4 + size]))
            unpickler.persistent_load = self._persistent_load  # type: ignore[method-assign]
            value = unpickler.load()
        del buffer[: 4 + size]
        return value


# -- the child ------------------------------------------------------------------
class _Collect(logging.Handler):
    """Keeps the records logged while a batch is applied."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.name, record.levelno, record.getMessage()))
        except Exception:  # a record that cannot be formatted is not worth the batch
            pass


def _build(spec: dict) -> Any:
    kind = spec["kind"]
    if kind == "cgroups_v1":
        from ._cgroups_v1 import CgroupsV1Backend

        return CgroupsV1Backend(spec["hierarchy"], spec["cgroups_root"])
    if kind == "cgroups_v2":
        from ._cgroups_v2 import CgroupsV2Backend

        return CgroupsV2Backend(spec["hierarchy"], spec["cgroups_root"], spec["work_dir"])
    raise DeviceControlError(f"A device worker runs cgroups_v1 or cgroups_v2, not {kind!r}")


def serve(spec: dict) -> None:
    """The child's main loop (see module rules)."""
    read_fd, write_fd = spec["fds"]
    collect = _Collect()
    root = logging.getLogger()
    root.handlers[:] = [collect]
    root.setLevel(spec["log_level"])
    codec = _FrameCodec()
    try:
        backend = _build(spec)
    except Exception as error:
        codec.write(write_fd, ("error", error, collect.records))
        return
    codec.write(write_fd, ("ready", (backend.name, backend.root), collect.records))
    collect.records = []
    each = bool(getattr(backend, "applies_each", False))
    clock = time.perf_counter
    try:
        while True:
            frame = codec.next()
            if frame is None:
                data = os.read(read_fd, 1 << 20)
                if not data:
                    return  # the parent closed its end
                codec.feed(data)
                continue
            ops = [DeviceOperation(kind, args) for kind, args in frame]
            if not each:
                results = backend.apply_batch(ops)
                codec.write(write_fd, ("done", results, collect.records))
                collect.records = []
                continue
            results = []
            sent = clock()
            last = len(ops) - 1
            for index, op in enumerate(ops):
                results.append(apply_one(backend, op))
                if index == last or clock() - sent >= SLICE:
                    codec.write(write_fd, ("done" if index == last else "part", results, collect.records))
                    results, collect.records = [], []
                    sent = clock()
    except BrokenPipeError:
        return
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


# -- the parent -----------------------------------------------------------------
def _relay(records: Sequence[tuple[str, int, str]]) -> None:
    for name, level, message in records:
        logging.getLogger(name).log(level, "%s", message)


class WorkerBackend:
    """A kernel backend in a device worker process (see module rules)."""

    kernel_hook = None

    def __init__(self, kind: str, hierarchy: str, cgroups_root: str, work_dir: str | None) -> None:
        self.kind = kind
        self.spec = {"kind": kind, "hierarchy": hierarchy, "cgroups_root": cgroups_root, "work_dir": work_dir}
        self.name = kind
        self.root = os.path.join(hierarchy, cgroups_root)
        self._prefix = self.root.rstrip("/") + "/"
        self.process: "subprocess.Popen | None" = None
        self._read_fd = -1
        self._write_fd = -1
        self._to_child = _FrameCodec()
        self._from_child = _FrameCodec()
        self._loop: "asyncio.AbstractEventLoop | None" = None
        self._eof = False
        self._waiter: Any = None
        self._write_waiter: Any = None
        self._outbox = bytearray()
        self._exiting: list[subprocess.Popen] = []
        self.starts = 0
        """Children started so far (1 + restarts)."""

    @classmethod
    async def start(cls, kind: str, hierarchy: str, cgroups_root: str, work_dir: str | None) -> "WorkerBackend":
        """Spawn the child and wait until its backend is built (its error raised here)."""
        worker = cls(kind, hierarchy, cgroups_root, work_dir)
        await worker._spawn()
        return worker

    def path(self, cgroup: str) -> str:
        return self._prefix + validate_cgroup(cgroup)

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        return self.process.pid if self.process is not None else None

    async def _spawn(self) -> None:
        import asyncio
        import subprocess

        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        spec = dict(
            self.spec,
            fds=[to_child_r, from_child_w],
            path=[p for p in sys.path if p],
            root=_PACKAGE_ROOT,
            log_level=logging.getLogger("actors.devices").getEffectiveLevel(),
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(spec)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as error:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise WorkerError(f"Failed to start the device worker process: {error}") from error
        os.close(to_child_r)
        os.close(from_child_w)
        os.set_blocking(from_child_r, False)
        os.set_blocking(to_child_w, False)
        self.process, self._read_fd, self._write_fd = process, from_child_r, to_child_w
        self._to_child, self._from_child = _FrameCodec(), _FrameCodec()
        self._outbox = bytearray()
        self._eof = False
        self._loop = asyncio._get_running_loop()
        if self._loop is not None:  # one reader for the child's life, not one per wait
            self._loop.add_reader(from_child_r, self._on_readable)
        self.starts += 1
        try:
            tag, value, records = await self._receive(0)
        except BaseException:
            self.close()
            raise
        _relay(records)
        if tag == "error":
            self.close()
            raise value
        self.name, self.root = value
        logger.debug("Device worker process %d runs %s at %s", process.pid, self.name, self.root)

    async def restart(self) -> None:
        """Start a new child after the last one went away."""
        logger.info("Starting a new device worker process for %s at %s", self.name, self.root)
        await self._spawn()

    def send(self, ops: Sequence[DeviceOperation]) -> bool:
        """Send a batch (the child applies batches in the order sent). True
        when it is all in the pipe; False when part of it waits for room:
        then ``await flush()`` (the pipe is never written blocking)."""
        if self.process is None:
            raise WorkerError("The device worker process is not running")
        data = self._to_child.encode([(op.kind, op.args) for op in ops])  # plain tuples pickle twice as fast
        if self._outbox:
            self._outbox += data
            return False
        try:
            written = os.write(self._write_fd, data)
        except BlockingIOError:
            written = 0
        except OSError:
            raise self._gone(len(ops), applying=False) from None
        if written < len(data):
            self._outbox += memoryview(data)[written:]
            return False
        return True

    async def flush(self) -> None:
        """Write what ``send`` left waiting, as the child makes room."""
        while self._outbox and self._write_fd >= 0:
            try:
                written = os.write(self._write_fd, self._outbox)
            except BlockingIOError:
                await self._wait_writable()
                continue
            except OSError:
                raise self._gone(0, applying=False) from None
            del self._outbox[:written]

    async def receive_part(self, batch: int) -> tuple[bool, list[Any]]:
        """The next results of the oldest batch sent: ``(done, results)``."""
        tag, results, records = await self._receive(batch)
        _relay(records)
        return tag == "done", results

    async def _receive(self, batch: int) -> Any:
        codec = self._from_child
        while True:
            value = codec.next()
            if value is not None:
                return value
            if self._read_fd < 0:
                raise WorkerError("The device worker process was closed before it answered")
            if self._loop is not None:  # asyncio: the reader callback fills the codec
                if self._eof:
                    raise self._gone(batch)
                self._waiter = _promise()
                try:
                    await self._waiter.future
                finally:
                    self._waiter = None
                continue
            try:
                data = os.read(self._read_fd, 1 << 20)
            except BlockingIOError:
                await _trio_wait_readable(self._read_fd)
                continue
            if not data:
                raise self._gone(batch)
            codec.feed(data)

    async def _wait_writable(self) -> None:
        """Until the pipe to the child has room, or ``close``."""
        fd, loop = self._write_fd, self._loop
        if loop is None:
            import trio

            await trio.lowlevel.wait_writable(fd)
            return
        promise = self._write_waiter = _promise()

        def writable() -> None:
            loop.remove_writer(fd)
            promise.set_value(None)

        loop.add_writer(fd, writable)
        try:
            await promise.future
        finally:
            self._write_waiter = None
            if not loop.is_closed():
                loop.remove_writer(fd)  # a no-op once it fired

    def _on_readable(self) -> None:
        """asyncio reader callback: take what the child wrote; wake ``_receive``."""
        try:
            while True:
                data = os.read(self._read_fd, 1 << 20)
                if not data:
                    self._eof = True
                    self._loop.remove_reader(self._read_fd)  # type: ignore[union-attr]
                    break
                self._from_child.feed(data)
                if len(data) < 1 << 20:
                    break
        except BlockingIOError:
            pass
        except OSError:
            self._eof = True
            self._loop.remove_reader(self._read_fd)  # type: ignore[union-attr]
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set_value(None)

    def _gone(self, batch: int, applying: bool = True) -> WorkerError:
        import subprocess

        process = self.process
        pid = process.pid if process is not None else "?"
        status = process.poll() if process is not None else None
        if process is not None and status is None:
            try:  # its pipe closed as it exited: the status follows within moments
                status = process.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                status = None
        self.close()
        how = f"exited with status {status}" if status is not None else "stopped answering"
        if not batch:
            what = ""
        elif applying:
            what = f" while applying a batch of {batch} device operations (their effects are unknown)"
        else:
            what = f" before it got a batch of {batch} device operations (none of them was applied)"
        logger.error("Device worker process %s %s%s; the next operation starts a new one", pid, how, what)
        return WorkerError(f"Device worker process {pid} {how}{what}; the next operation starts a new one")

    def close(self) -> None:
        """Close the pipes; the child exits after the operation it applies (if any)."""
        loop = self._loop
        if loop is not None and self._read_fd >= 0 and not loop.is_closed():
            loop.remove_reader(self._read_fd)
            loop.remove_writer(self._write_fd)
        elif loop is None and self._read_fd >= 0:
            _trio_notify_closing(self._read_fd, self._write_fd)
        self._loop = None
        self._outbox = bytearray()
        for waiter in (self._waiter, self._write_waiter):  # wake them: they see the end
            if waiter is not None:
                waiter.set_value(None)
        self._waiter = self._write_waiter = None
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._read_fd = self._write_fd = -1
        if self.process is not None:
            self._exiting.append(self.process)
        self.process = None

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """After ``close``: wait until the children have exited (killed after
        ``timeout`` seconds, with a warning: one stuck in the kernel)."""
        import anyio

        deadline = time.monotonic() + timeout
        for process in self._exiting:
            while process.poll() is None:
                if time.monotonic() >= deadline:
                    logger.warning("Device worker process %d did not exit after close; killing it", process.pid)
                    process.kill()
                    process.wait()
                    break
                await anyio.sleep(0.002)
        self._exiting.clear()

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:  # the port, for a thread
        raise DeviceControlError("A WorkerBackend is driven by device control (send/receive_part), not in a thread")


def _promise() -> Any:
    from runtime import Promise  # here: the child does not import the runtime

    return Promise()


def _trio_notify_closing(*fds: int) -> None:
    """Tell trio tasks waiting on ``fds`` that they close (they get ClosedResourceError)."""
    try:
        import trio

        for fd in fds:
            trio.lowlevel.notify_closing(fd)
    except (ImportError, RuntimeError):
        pass


async def _trio_wait_readable(fd: int) -> None:
    import trio

    await trio.lowlevel.wait_readable(fd)


