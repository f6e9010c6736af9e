"""The service's front door: the unix socket users reach it through (SPEC R-SC-1, R-SC-4).

Rules:
- ``bind_socket(path, group)`` (blocking) makes the socket: its directory
  is made root's, mode 0755, when missing and must be trusted
  (``_trust``); a stale socket there is replaced (one another service still
  answers on is refused, and so is anything that is not a socket); the
  socket is bound while only root may use it, then opened to everyone
  (0666) or, with ``group``, to root and that group (0660).
- ``FrontDoor(sock, service_pid, limits)`` accepts connections. Who is at
  the other end comes from the kernel (``_caller.peer_caller``), once,
  when it connects; nothing it sends can change that. Each connection
  reads frames (``_frames``) and hands each request to the service
  (``GpuIsolatorService.request``), which answers on the same connection
  (``Connection.send``).
- Limits, each costing the offender its own connection only (a refusal
  is an ``error`` frame, then the connection closes; each is counted):
  more than ``max_connections_per_user`` open connections of one uid
  (root is not limited); nothing received for ``idle_timeout`` seconds
  while no request of the connection is unanswered; a frame not complete
  ``idle_timeout`` seconds after its first byte; a frame that is not one
  (``FrameError``), an unknown verb, descriptors with anything but an
  exec request, a second request on a connection that asked for an exec
  container; answers a client does not read (``MAX_UNSENT`` queued, or
  one not written within ``SEND_TIMEOUT``).
- A ``signal`` on an exec connection before it is handed on goes to the
  service (``GpuIsolatorService.signal``: the request is withdrawn).
- An exec connection is handed to the command's supervisor
  (``detach``): reading stops, what is queued is written, and the
  service gets a duplicate descriptor of the connection to pass on; the
  front door then forgets it (it is no longer the service's to close).
- A connection that closes otherwise is reported to the service
  (``GpuIsolatorService.disconnected``): its waiting requests go.
- ``close()`` stops accepting and closes every connection after writing
  what is queued for it (bounded), so the service's last answers (it is
  stopping) reach the clients.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from collections import deque
from typing import Any

import anyio
import msgspec

from runtime import Future, MetricSet, Promise, current_runtime, dispatch

from ._caller import Caller, peer_caller, user_name
from ._frames import MAX_FDS, FrameError, FrameReader, encode, received_fds
from ._trust import check_trusted_dir

__all__ = ["DEFAULT_SOCKET", "Connection", "DoorLimits", "FrontDoor", "bind_socket"]

logger = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/gpu-isolator/gpu-isolator.sock"
SEND_TIMEOUT = 10.0
MAX_UNSENT = 64
REQUESTS = frozenset({"prepare", "update", "usage", "cleanup", "state"})
FINAL = frozenset({"prepared", "updated", "statistics", "cleaned_up", "state", "exited", "error"})
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)


class DoorLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_connections_per_user: int = 32
    idle_timeout: float = 10.0


def bind_socket(path: str, group: int | None = None) -> socket.socket:
    """The listening socket at ``path`` (see module rules; blocking)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        os.makedirs(directory, 0o755, exist_ok=True)
        os.chmod(directory, 0o755)
    check_trusted_dir(directory, "socket directory")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None:
        if not stat.S_ISSOCK(info.st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket: remove it or choose another --socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: nobody answers there
            else:
                raise OSError(errno.EADDRINUSE, f"another service answers on {path}: stop it or choose another"
                                                " --socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chown(path, 0 if os.geteuid() == 0 else -1, group if group is not None else -1)
    os.chmod(path, 0o660 if group is not None else 0o666)
    sock.listen(4096)
    return sock


class Connection:
    """One user's connection (see module rules)."""

    def __init__(self, door: "FrontDoor", sock: socket.socket, caller: Caller) -> None:
        self.door = door
        self.sock = sock
        self.caller = caller
        self.pending = 0
        """Requests not answered yet (while any is, the connection is not idle)."""
        self.exec = False
        self.closed = False
        self._detached = False
        self._out: deque[bytes] = deque()
        self._wake = anyio.Event()
        self._handed: Promise | None = None
        self._waiting: anyio.CancelScope | None = None
        self._rearm = False
        self._reading: anyio.CancelScope | None = None
        self._scope: anyio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"<connection of {self.caller.describe()}>"

    # -- answers (called on the loop by the service) ------------------------------
    def send(self, verb: str, body: Any) -> None:
        """Queue one answer; a client that does not read loses its connection."""
        if self.closed or self._detached:
            return
        if verb in FINAL and self.pending:
            self.pending -= 1
            if not self.pending and self._waiting is not None:  # the reader waits with no limit: set one
                self._rearm = True
                self._waiting.cancel()
        self._out.append(encode(verb, body if isinstance(body, dict) else msgspec.json.encode(body)))
        if len(self._out) > MAX_UNSENT:
            self.door.count("slow")
            self._close(f"{MAX_UNSENT} answers it did not read")
        self._wake.set()

    def refuse(self, error: str) -> None:
        """An ``error`` frame, then the connection closes."""
        self.send("error", {"error": error})
        self._finish = True
        self._wake.set()
        if self._reading is not None:
            self._reading.cancel()

    _finish = False

    def detach(self) -> Future:
        """Hand the connection on (see module rules): a Future of a duplicate
        of its descriptor once what is queued is written, or of None when it
        closed meanwhile."""
        if self.closed:
            return Future.ready(None)
        self._detached = True
        self._handed = Promise()
        if self._reading is not None:
            self._reading.cancel()
        self._wake.set()
        return self._handed.future

    def _hand_over(self) -> None:
        """Everything queued is written: the duplicate goes to whoever detached."""
        try:
            fd = os.dup(self.sock.fileno())
        except OSError:
            fd = None
        if self._handed is not None:
            self._handed.set_value(fd)
            self._handed = None
        self._close(None)

    # -- the connection's task -----------------------------------------------------
    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                self._scope = tasks.cancel_scope
                tasks.start_soon(self._writer)
                await self._reader()
                if self._detached:  # the writer writes what is queued, hands it over and closes this
                    await anyio.sleep_forever()
                if self._finish:
                    with anyio.move_on_after(1.0):
                        while self._out and not self.closed:
                            await self._write_some()
                tasks.cancel_scope.cancel()
        finally:
            self._close(None)

    async def _reader(self) -> None:
        reader = FrameReader()
        limits = self.door.limits
        started = 0.0
        try:
            with anyio.CancelScope() as scope:
                self._reading = scope
                while not self.closed and not self._finish:
                    if reader.partial:
                        timeout = max(0.0, started + limits.idle_timeout - time.monotonic())
                    else:
                        timeout = None if self.pending else limits.idle_timeout
                    with anyio.CancelScope() as waited:
                        if timeout is not None:
                            waited.deadline = anyio.current_time() + timeout
                        self._waiting = waited
                        await anyio.wait_readable(self.sock)
                    self._waiting = None
                    if waited.cancelled_caught and self._rearm:  # its last answer went out: idle from now
                        self._rearm = False
                        continue
                    if waited.cancelled_caught:
                        self.door.count("idle")
                        what = "a frame it did not finish" if reader.partial else "nothing"
                        self.refuse(f"closed after {limits.idle_timeout:g} s of {what} (idle connections are closed)")
                        return
                    try:
                        data, ancillary, flags, _ = self.sock.recvmsg(65536, _FD_SPACE)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        return
                    try:
                        fds = received_fds(ancillary, flags)
                    except FrameError as error:
                        self._bad(str(error))
                        return
                    if not data:
                        for fd in fds:
                            os.close(fd)
                        return
                    if not reader.partial:
                        started = time.monotonic()
                    reader.feed(data, fds)
                    try:
                        while (frame := reader.next()) is not None:
                            if not self._take(frame):
                                return
                    except FrameError as error:
                        self._bad(str(error))
                        return
        finally:
            reader.close()
            self._reading = None

    def _take(self, frame: Any) -> bool:
        """Hand one frame on; False when it ends the connection."""
        if frame.verb == "signal" and self.exec and not frame.fds:
            dispatch(self.door.service, _service_signal(), self, frame)  # before the command started
            return True
        if self.exec:
            self._bad("one exec request per connection: nothing more is read on it", frame.fds)
            return False
        if frame.verb not in REQUESTS:
            self._bad(f"unknown request {frame.verb!r} (expected one of {', '.join(sorted(REQUESTS))})", frame.fds)
            return False
        if frame.fds and frame.verb != "prepare":
            self._bad(f"descriptors came with a {frame.verb!r} request", frame.fds)
            return False
        if frame.verb == "prepare" and frame.body.get("command") is not None:
            self.exec = True
        self.pending += 1
        dispatch(self.door.service, _service_request(), self, frame)
        return True

    def _bad(self, why: str, fds: tuple[int, ...] = ()) -> None:
        for fd in fds:
            os.close(fd)
        self.door.count("bad")
        self.door.warn(f"Connection of {self.caller.describe()}: {why}; closed")
        self.refuse(f"not a request the service takes: {why}")

    async def _writer(self) -> None:
        while not self.closed:
            if self._out:
                await self._write_some()
                continue
            if self._detached:
                self._hand_over()
                return
            self._wake = anyio.Event()
            await self._wake.wait()

    async def _write_some(self) -> None:
        data = self._out[0]
        with anyio.move_on_after(SEND_TIMEOUT):
            while data:
                try:
                    sent = self.sock.send(data)
                    data = data[sent:]
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_writable(self.sock)
                except OSError:
                    self._close(None)
                    return
            self._out.popleft()
            return
        self.door.count("slow")
        self._close(f"an answer not read within {SEND_TIMEOUT:g} s")

    def _close(self, why: str | None) -> None:
        if self.closed:
            return
        self.closed = True
        if why:
            self.door.warn(f"Connection of {self.caller.describe()} closed: {why}")
        self._out.clear()
        self._wake.set()
        if self._handed is not None:
            self._handed.set_value(None)
            self._handed = None
        if self._reading is not None:
            self._reading.cancel()
        if self._scope is not None:
            self._scope.cancel()
        try:
            self.sock.close()
        except OSError:
            pass
        self.door.gone(self, detached=self._detached)


def _service_request() -> Any:
    from ._service import GpuIsolatorService

    return GpuIsolatorService.request


def _service_signal() -> Any:
    from ._service import GpuIsolatorService

    return GpuIsolatorService.signal


class FrontDoor:
    """Accepts users' connections on the unix socket (see module rules)."""

    def __init__(self, sock: socket.socket, service: Any, limits: DoorLimits, path: str = "") -> None:
        self.sock = sock
        self.service = service
        self.limits = limits
        self.path = path
        self.connections: set[Connection] = set()
        self.per_user: dict[int, int] = {}
        self.counts = {"accepted": 0, "refused": 0, "idle": 0, "bad": 0, "slow": 0}
        self._last_warning = 0.0
        self._scope: anyio.CancelScope | None = None
        self._metrics: MetricSet | None = None

    def count(self, what: str) -> None:
        self.counts[what] += 1

    def warn(self, text: str) -> None:
        """A warning at most once a second (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            logger.warning("%s", text)

    def _publish(self) -> None:
        metrics = self._metrics = MetricSet(current_runtime().metrics)
        metrics.gauge("service/connections", lambda: len(self.connections), "open connections on the unix socket")
        for name, text in (("accepted", "connections accepted on the unix socket"),
                           ("refused", "connections refused: over --max_connections_per_user"),
                           ("idle", "connections closed: idle, or a frame not finished in time"),
                           ("bad", "connections closed: a frame that is not a request"),
                           ("slow", "connections closed: answers the client did not read")):
            metrics.counter(f"service/connections_{name}", text, read=lambda name=name: self.counts[name])

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self._publish()
        try:
            async with anyio.create_task_group() as tasks:
                self._scope = tasks.cancel_scope
                task_status.started()
                while True:
                    await anyio.wait_readable(self.sock)
                    try:
                        client, _ = self.sock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as error:  # EMFILE and the like: the next accept may succeed
                        self.warn(f"Cannot accept a connection on {self.path}: {error.strerror}")
                        await anyio.sleep(0.05)
                        continue
                    client.setblocking(False)
                    tasks.start_soon(self._serve_one, client)
        finally:
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None

    async def _serve_one(self, client: socket.socket) -> None:
        try:
            caller = peer_caller(client, {})
        except OSError:
            client.close()
            return
        if caller.uid != 0 and self.per_user.get(caller.uid, 0) >= self.limits.max_connections_per_user:
            self.count("refused")
            self.warn(f"Refused a connection of uid {caller.uid} ({caller.peer}): {self.per_user[caller.uid]} open,"
                      f" the limit is {self.limits.max_connections_per_user} (--max_connections_per_user)")
            try:
                client.send(encode("error", {"error": f"too many connections of uid {caller.uid}:"
                                                      f" {self.limits.max_connections_per_user} are open"
                                                      " (--max_connections_per_user); close some"}))
            except OSError:
                pass
            client.close()
            return
        self.count("accepted")
        self.per_user[caller.uid] = self.per_user.get(caller.uid, 0) + 1
        connection = Connection(self, client, caller)
        self.connections.add(connection)
        try:
            name = await anyio.to_thread.run_sync(user_name, caller.uid)  # NSS may block: not on the loop
        except BaseException:
            connection._close(None)
            raise
        connection.caller = msgspec.structs.replace(caller, user=name)
        await connection.run()

    def gone(self, connection: Connection, detached: bool) -> None:
        if connection not in self.connections:
            return
        self.connections.discard(connection)
        uid = connection.caller.uid
        left = self.per_user.get(uid, 1) - 1
        if left:
            self.per_user[uid] = left
        else:
            self.per_user.pop(uid, None)
        if not detached:
            from ._service import GpuIsolatorService

            dispatch(self.service, GpuIsolatorService.disconnected, connection)

    async def close(self, timeout: float = 2.0) -> None:
        """Stop accepting; write what is queued for each connection (bounded), then close them."""
        try:
            self.sock.close()
        except OSError:
            pass
        with anyio.move_on_after(timeout):
            while any(c._out and not c.closed for c in self.connections):
                await anyio.sleep(0.01)
        for connection in list(self.connections):
            connection._close(None)
        if self._scope is not None:
            self._scope.cancel()

