"""Network: a runtime reachable over HTTP/1.1 in libprocess' wire form.

Rules (libprocess' process manager and socket manager, R-NW-1..5):
- ``Runtime(listen="host:port")`` binds a listener (port 0: any free one);
  ``runtime.address`` is the bound ``host:port`` and every process spawned
  in it has a PID carrying it (``id@host:port``). A wildcard host
  (``0.0.0.0``, ``::``) is advertised as this host's name's address.
- Incoming ``POST /<id>/<name>`` carrying ``Libprocess-From: <pid>`` (or
  the legacy ``User-Agent: libprocess/<pid>``) is a message: answered
  ``202 Accepted`` once it is in the process's mailbox, where it is the same
  event a local ``send`` makes (filters see it; its body is decoded on
  delivery -- a body that does not decode is logged and counted there,
  never a 5xx). Unknown process, or a message name it has no handler for
  (once its ``initialize`` has run) -> 404. A sender header that does not
  parse as ``id@host:port`` -> 400, as is a POST to a message name without
  any sender header.
- A process with an ``admit`` check (``Process.admit``) sees none of
  these requests unless the check lets it through; the check's answer
  (e.g. 401) goes back otherwise, before anything is delivered.
- Any other request goes to the process's route (``Process.route``) with
  the longest matching path, dispatched to that process like any event,
  or to the runtime's own endpoints: ``GET /__processes__``, ``GET
  /metrics/snapshot``, ``GET /metrics`` (Prometheus text), ``GET /help``.
  No match -> 404; a built-in endpoint with another method -> 405.
- Outgoing: ``send`` to a PID at another address goes through that
  address's ``Peer`` (see ``_peers``); bytes bodies unchanged, ``str`` as
  UTF-8, ``None`` empty, anything else as msgspec JSON. ``link`` to such a
  PID opens the connection; ``exited(pid)`` comes when it breaks or cannot
  be made. A PID at our own address is local.
- Incoming connections are capped in all and per client address (a client
  over the cap gets ``503`` and is closed at once); what one connection may
  cost is bounded by ``Limits`` (see ``_server``).
- Closing (the runtime's scope ends, after its processes): the listener
  stops, peers get up to one second to write what is queued, then every
  connection is closed.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import anyio
from anyio.abc import SocketAttribute

from ._errors import Failure
from ._http import Limits, Request, Response
from ._metrics import Metrics
from ._peers import Peer, RequestEncoder, host_header
from ._pid import PID
from ._process import DROPPED, DROPPED_HELP, RUNNING, Process, _exited_event, _initialize_event, wire_bytes
from ._server import ACCEPTED, ServerConnection

if TYPE_CHECKING:
    from ._runtime import Runtime

logger = logging.getLogger(__name__)

_BUSY_TEXT = b"503 Service Unavailable: too many connections\n"
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT)
BUILTINS = {
    "/__processes__": "JSON list of this runtime's processes: id, pid, state, queue depth, events handled, failures, messages rejected",
    "/metrics/snapshot": "every metric as a flat JSON object (libprocess' shape; timers in ms with /count and percentiles)",
    "/metrics": "every metric in the Prometheus text format",
    "/help": "this list",
}


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"Invalid address {text!r}: expected 'host:port', e.g. '127.0.0.1:5050' (port 0: any free port)")
    return host, int(port)


class NetworkStats:
    """The network's counters in the runtime's metrics registry."""

    def __init__(self, metrics: Metrics) -> None:
        self.requests = metrics.counter("runtime/http/requests", "HTTP requests read")
        self.refused = metrics.counter("runtime/http/refused", "requests refused by a limit or as malformed HTTP")
        self.connections_refused = metrics.counter("runtime/http/connections_refused", "connections refused over the connection caps")
        self.received = metrics.counter("runtime/messages/received", "messages from other runtimes put in a mailbox")
        self.not_found = metrics.counter("runtime/messages/not_found", "messages for an unknown process or message name (404)")
        self.no_sender = metrics.counter("runtime/messages/no_sender", "messages without a sender that parses (400)")
        self.sent = metrics.counter("runtime/messages/sent", "messages written to other runtimes")
        self.dropped = metrics.counter(DROPPED, DROPPED_HELP)
        self.refused_by_peers = metrics.counter("runtime/messages/refused_by_peers", "messages a peer answered with 4xx/5xx")


class Network:
    """The HTTP side of one runtime (see module rules)."""

    def __init__(self, rt: "Runtime", listen: str, limits: Limits) -> None:
        self.rt = rt
        self.limits = limits
        self.listen_host, self.listen_port = parse_address(listen)
        self.host = ""
        self.port = 0
        self.address = ""
        self.stats = NetworkStats(rt.metrics)
        self._encoder = RequestEncoder()
        self._peers: dict[tuple[str, int], Peer] = {}
        self._open = 0
        self._per_client: dict[str, int] = {}
        self._listener: Any = None
        self._scope: anyio.CancelScope | None = None
        self._accepting: anyio.CancelScope | None = None
        self._task_group: Any = None
        self._starting: deque[tuple[Callable[..., Any], tuple]] = deque()
        self._spawn_wake: Any = None
        self._last_warning = 0.0
        rt.metrics.gauge("runtime/http/connections", lambda: self._open, "open incoming connections")
        rt.metrics.gauge("runtime/peers", lambda: len(self._peers), "open outgoing connections")

    # -- life -------------------------------------------------------------
    @staticmethod
    def check(listen: str | None, limits: Limits | None) -> Limits:
        """Validate a runtime's network settings; the limits to use."""
        if listen is not None:
            parse_address(listen)
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(f"limits must be a runtime.Limits, got {type(limits).__name__}")
        return limits or Limits()

    @classmethod
    async def start(cls, rt: "Runtime", listen: str, limits: Limits, task_group: Any) -> "Network":
        """Bind the listener and serve in ``task_group``."""
        network = cls(rt, listen, limits)
        await network._bind(task_group)
        return network

    async def _bind(self, task_group: Any) -> None:
        try:
            self._listener = await anyio.create_tcp_listener(local_host=self.listen_host, local_port=self.listen_port)
        except OSError as e:
            raise OSError(e.errno, f"Cannot listen on {self.listen_host}:{self.listen_port}: {e.strerror or e}; pick a free port (0: any)") from e
        bound = self._listener.extra(SocketAttribute.local_address)
        host, self.port = bound[0], bound[1]
        if host in ("0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        self.host = host
        self.address = host_header(host, self.port)
        await task_group.start(self._serve)

    async def _serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as tg:
                    self._task_group = tg
                    tg.start_soon(self._accept_loop)
                    task_status.started()
                    while True:
                        while self._starting:
                            fn, args = self._starting.popleft()
                            tg.start_soon(fn, *args)
                        wake = self._spawn_wake = anyio.Event()
                        await wake.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()

    async def _accept_loop(self) -> None:
        with anyio.CancelScope() as scope:
            self._accepting = scope
            await self._listener.serve(self._accept, self._task_group)

    def _start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start a task in the network's task group (callable from a drain,
        where no task is current under asyncio)."""
        self._starting.append((fn, args))
        wake = self._spawn_wake
        if wake is not None:
            self._spawn_wake = None
            wake.set()

    async def aclose(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()  # no new connections; the listener closes with the scope
        peers = list(self._peers.values())
        for peer in peers:
            peer.close()
        with anyio.move_on_after(1.0):
            while any(peer.state == "open" and not peer.idle() for peer in peers):
                await anyio.sleep(0.005)
        if self._scope is not None:
            self._scope.cancel()

    # -- outgoing ---------------------------------------------------------
    def is_remote(self, pid: PID) -> bool:
        return pid.host is not None and (pid.port != self.port or pid.host != self.host)

    def local(self, pid: PID) -> PID:
        """``pid`` as this runtime keys its processes (with our address)."""
        return PID(pid.id, self.host, self.port)

    def send(self, to: PID, name: str, body: Any, from_: PID | None) -> None:
        """A message to a PID at another address (test filters see it first)."""
        if from_ is None:
            raise Failure(f"Message {name!r} to {to} needs a sender the peer can answer: send it from a process (self.send) or pass from_")
        if from_.host is None:
            from_ = self.local(from_)
        rt = self.rt
        if rt._filters and rt._filter_message(to, name, body, from_):
            return
        self._peer(to).post(self._encoder.encode(to, name, wire_bytes(body), from_))

    def link(self, linker: PID, remote: PID) -> None:
        self._peer(remote).link(remote, linker)

    def _peer(self, pid: PID) -> Peer:
        key = (pid.host, pid.port)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = Peer(self, pid.host, pid.port)
            self._start(peer.run)
        return peer

    def _peer_gone(self, peer: Peer) -> None:
        key = (peer.host, peer.port)
        if self._peers.get(key) is peer:
            del self._peers[key]

    def _exited(self, linker: PID, remote: PID) -> None:
        proc = self.rt._processes.get(linker)
        if proc is not None and proc._state is RUNNING:
            self.rt._enqueue(proc, _exited_event, (remote,), None, None)

    # -- incoming ---------------------------------------------------------
    async def _accept(self, stream: Any) -> None:
        try:
            remote = stream.extra(SocketAttribute.remote_address)
            client_host = str(remote[0]) if isinstance(remote, tuple) else str(remote)
            client = host_header(client_host, remote[1]) if isinstance(remote, tuple) else client_host
        except Exception:  # noqa: BLE001 - a socket already gone
            await anyio.aclose_forcefully(stream)
            return
        limits = self.limits
        count = self._per_client.get(client_host, 0)
        if self._open >= limits.max_connections or count >= limits.max_connections_per_client:
            self.stats.connections_refused.inc()
            self._warn(f"Refused a connection from {client}: {self._open} open, {count} from {client_host} (limits {limits.max_connections} / {limits.max_connections_per_client})")
            with anyio.move_on_after(0.1):
                try:
                    await stream.send(_BUSY)
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            await anyio.aclose_forcefully(stream)
            return
        self._open += 1
        self._per_client[client_host] = count + 1
        try:
            await ServerConnection(stream, client, limits, self.respond, self.stats).run()
        finally:
            self._open -= 1
            left = self._per_client[client_host] - 1
            if left:
                self._per_client[client_host] = left
            else:
                del self._per_client[client_host]

    def _warn(self, text: str) -> None:
        """A warning at most once a second (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            logger.warning("%s", text)

    def respond(self, request: Request) -> Any:
        """The router (see module rules): a Response, or an awaitable one."""
        path = request.path
        builtin = BUILTINS.get(path)
        if builtin is not None:
            if request.method not in ("GET", "HEAD"):
                return Response(f"405 Method Not Allowed: {path} answers GET\n", 405, headers={"Allow": "GET, HEAD"})
            return self._builtin(path)
        ident, _, rest = path[1:].partition("/")
        proc = self.rt._processes.get(PID(ident, self.host, self.port)) if ident else None
        if proc is not None and proc._remote_check is not None:
            refusal = proc._remote_check(request)
            if refusal is not None:
                return refusal
        headers = request.headers
        if request.method == "POST" and ("libprocess-from" in headers or headers.get("user-agent", "").startswith("libprocess/")):
            return self._message(proc, ident, rest, request)
        if proc is not None:
            route = _find_route(proc, "/" + rest)
            if route is not None:
                return self.rt.dispatch(proc.pid, route, (request,), {})
            if request.method == "POST" and rest in proc._handlers:
                self.stats.no_sender.inc()
                return Response.error(400, f"message {rest!r} to {ident} has no sender: add a 'Libprocess-From: id@host:port' header")
        return Response.error(404, f"nothing at {path}; GET /help lists the endpoints")

    def _message(self, proc: Process | None, ident: str, name: str, request: Request) -> Response:
        if proc is None or proc._state is not RUNNING:
            self.stats.not_found.inc()
            return Response.error(404, f"no process {ident!r} here")
        if not name or (name not in proc._handlers and not _initializing(proc)):
            self.stats.not_found.inc()
            return Response.error(404, f"process {ident!r} has no handler for message {name!r}")
        sender = parse_sender(request.headers)
        if sender is None:
            self.stats.no_sender.inc()
            return Response.error(400, "the message has no sender: 'Libprocess-From' must be a PID 'id@host:port'")
        self.rt.send(proc.pid, name, request.body, sender)
        self.stats.received.inc()
        return ACCEPTED

    def _builtin(self, path: str) -> Response:
        rt = self.rt
        if path == "/__processes__":
            return Response.json([{"id": pid.id, "pid": str(pid), **proc.stats()} for pid, proc in sorted(rt._processes.items())])
        if path == "/metrics/snapshot":
            return Response.json(rt.metrics.snapshot())
        if path == "/metrics":
            return Response(rt.metrics.prometheus().encode(), 200, "text/plain; version=0.0.4; charset=utf-8")
        lines = [f"{name}\n    {text}" for name, text in BUILTINS.items()]
        lines.append("POST /<id>/<name>\n    a message to process <id> (header 'Libprocess-From: id@host:port'); 202 Accepted")
        for pid, proc in sorted(rt._processes.items()):
            for route_path, (_fn, help_text) in sorted(proc._routes.items()):
                lines.append(f"/{pid.id}{route_path}\n    {help_text or '(no help)'}")
        return Response("\n".join(lines) + "\n")


def _initializing(proc: Process) -> bool:
    """True while ``initialize`` has not finished (handlers may still come)."""
    return proc._held or bool(proc._mailbox and proc._mailbox[0][0] is _initialize_event)


def _find_route(proc: Process, path: str) -> Any:
    """The route with the longest path that is ``path`` or a parent of it."""
    routes = proc._routes
    while True:
        entry = routes.get(path)
        if entry is not None:
            return entry[0]
        if path in ("", "/"):
            return None
        path = path.rsplit("/", 1)[0] or "/"


def parse_sender(headers: dict[str, str]) -> PID | None:
    """The sender of a message: ``Libprocess-From``, else the legacy
    ``User-Agent: libprocess/<pid>``; None when absent or not a PID with
    an address."""
    text = headers.get("libprocess-from")
    if text is None:
        agent = headers.get("user-agent", "")
        if not agent.startswith("libprocess/"):
            return None
        text = agent[len("libprocess/"):]
    try:
        pid = PID.parse(text.strip())
    except ValueError:
        return None
    if pid.host is None or not 0 < pid.port < 65536 or any(c in pid.id for c in " /\t"):
        return None
    return pid
