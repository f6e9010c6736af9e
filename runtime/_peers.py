"""Peer: the one persistent outgoing connection to a remote address.

Rules (libprocess' socket manager):
- Messages to every PID at one ``host:port`` travel over one connection,
  written in the order they were sent; what is queued when the writer
  wakes goes out in one write.
- The connection opens on the first message or link to that address;
  connecting may take ``Limits.connect_timeout``.
- A peer that cannot be reached, or whose connection breaks (end of
  stream, reset, a write that does not finish in ``send_timeout``, an
  answer that is not HTTP), is forgotten: messages still queued are
  dropped (logged and counted), every process linked to a PID at that
  address gets ``exited(pid)``, and the next message opens a new
  connection. Nothing is retried behind the sender's back.
- Answers are read as they come and parsed with h11: a refusal (4xx/5xx)
  is logged with the peer's explanation and counted. A peer that never
  answers (libprocess answers no libprocess message) is fine.
- A request is ``POST /<id>/<name> HTTP/1.1`` with ``Host``,
  ``User-Agent: libprocess/<from>``, ``Libprocess-From: <from>``,
  ``Connection: Keep-Alive`` and ``Content-Length`` -- libprocess' own
  message encoding; id and name are percent-encoded where a URL needs it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import anyio
import h11

from ._pid import PID

if TYPE_CHECKING:
    from ._network import Network

logger = logging.getLogger(__name__)

_SAFE = "()@:!$&'*+,;=-._~"
_HEADS_MAX = 4096
_PRIMER = h11.Request(method="POST", target="/", headers=[("Host", "peer"), ("Content-Length", "0")])
_END = h11.EndOfMessage()


def host_header(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RequestEncoder:
    """libprocess' message encoding, with the request head cached per
    (to, name, from): a message costs one format and one join."""

    def __init__(self) -> None:
        self._heads: dict[tuple[PID, str, PID], bytes] = {}

    def encode(self, to: PID, name: str, body: bytes, from_: PID) -> bytes:
        key = (to, name, from_)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= _HEADS_MAX:
                self._heads.clear()
            sender = str(from_)
            head = self._heads[key] = (
                f"POST /{quote(to.id, safe=_SAFE)}/{quote(name, safe=_SAFE + '/')} HTTP/1.1\r\n"
                f"Host: {host_header(to.host, to.port)}\r\n"
                f"User-Agent: libprocess/{sender}\r\n"
                f"Libprocess-From: {sender}\r\n"
                "Connection: Keep-Alive\r\n"
                "Content-Length: "
            ).encode("latin-1")
        return b"%s%d\r\n\r\n%s" % (head, len(body), body)


class _Answers:
    """Reads a peer's answers with h11. An h11 client only parses the answer
    to a request it has sent, so one stand-in request is 'sent' (never
    written) per answer; the real requests are pipelined by the writer.
    A chunk that is only repeats of the last lone 202 answer already parsed
    (as a busy peer's answers are, byte for byte) is counted, not reparsed."""

    def __init__(self) -> None:
        self.conn = h11.Connection(h11.CLIENT)
        self.accepted = b""  # the bytes of one 202 answer, once seen alone

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Refusals (status, body) among the answers completed by ``data``."""
        unit = self.accepted
        if unit and len(data) % len(unit) == 0 and data == unit * (len(data) // len(unit)):
            return []
        conn = self.conn
        conn.receive_data(data)
        refusals: list[tuple[int, bytes]] = []
        status = 0
        body = b""
        answers = 0
        while True:
            if conn.our_state is h11.IDLE:
                conn.send(_PRIMER)
                conn.send(_END)
            event = conn.next_event()
            kind = type(event)
            if event is h11.NEED_DATA or kind is h11.ConnectionClosed:
                break
            if kind is h11.Response:
                status = event.status_code
                body = b""
            elif kind is h11.Data:
                if status >= 400 and len(body) < 512:
                    body += event.data
            elif kind is h11.EndOfMessage:
                answers += 1
                if status >= 400:
                    refusals.append((status, body[:512]))
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return refusals
                conn.start_next_cycle()
        if answers == 1 and status == 202 and not unit and not conn.trailing_data[0]:
            self.accepted = data  # one whole answer, nothing left over
        return refusals


class Peer:
    """The connection to one remote address (see module rules)."""

    def __init__(self, network: "Network", host: str, port: int) -> None:
        self.network = network
        self.host = host
        self.port = port
        self.address = host_header(host, port)
        self.outbox: deque[bytes] = deque()
        self.links: dict[PID, set[PID]] = {}
        self.state = "connecting"
        self.closing = False
        self._wake: Any = None
        self._reason = ""

    def post(self, data: bytes) -> None:
        """Queue one encoded request; the writer sends it in order."""
        self.outbox.append(data)
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    def link(self, remote: PID, linker: PID) -> None:
        self.links.setdefault(remote, set()).add(linker)

    def close(self) -> None:
        """Stop once what is queued is written (the runtime is ending)."""
        self.closing = True
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    def idle(self) -> bool:
        return not self.outbox

    async def run(self) -> None:
        """Connect, then write and read until the connection ends."""
        try:
            with anyio.fail_after(self.network.limits.connect_timeout):
                stream = await anyio.connect_tcp(self.host, self.port)
        except (OSError, TimeoutError) as e:
            self._gone(f"cannot connect: {e or type(e).__name__}")
            return
        self.state = "open"
        self._reason = "the runtime closed it"
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, stream, tg.cancel_scope)
                await self._write(stream, tg.cancel_scope)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(stream)
            self._gone(self._reason)

    async def _write(self, stream: Any, scope: anyio.CancelScope) -> None:
        outbox = self.outbox
        send_timeout = self.network.limits.send_timeout
        sent = self.network.stats.sent
        try:
            while True:
                if not outbox:
                    if self.closing:
                        break
                    wake = self._wake = anyio.Event()
                    await wake.wait()
                    continue
                count = len(outbox)
                data = outbox.popleft() if count == 1 else b"".join([outbox.popleft() for _ in range(count)])
                with anyio.move_on_after(send_timeout):
                    await stream.send(data)
                    sent.inc(count)
                    continue
                self._reason = f"writing {count} message(s) took longer than {send_timeout:g}s"
                break
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            self._reason = f"writing failed: {e or type(e).__name__}"
        scope.cancel()

    async def _read(self, stream: Any, scope: anyio.CancelScope) -> None:
        answers = _Answers()
        refused = self.network.stats.refused_by_peers
        try:
            while True:
                data = await stream.receive(65536)
                for status, body in answers.feed(data):
                    refused.inc()
                    logger.warning("Peer %s refused a message: %s %s", self.address, status, body.decode("latin-1", "replace").strip())
        except anyio.EndOfStream:
            self._reason = "the peer closed the connection"
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            self._reason = f"reading failed: {e or type(e).__name__}"
        except h11.RemoteProtocolError as e:
            self._reason = f"the peer's answer is not HTTP: {e}"
        scope.cancel()

    def _gone(self, reason: str) -> None:
        """Forget this connection: drop what is queued, tell linked processes."""
        self.state = "closed"
        self.network._peer_gone(self)
        dropped = len(self.outbox)
        self.outbox.clear()
        if dropped:
            self.network.stats.dropped.inc(dropped)
            logger.warning("Peer %s: %s; %d queued message(s) dropped", self.address, reason, dropped)
        elif self.links or not self.closing:
            logger.info("Peer %s: %s", self.address, reason)
        links, self.links = self.links, {}
        for remote in sorted(links):
            for linker in sorted(links[remote]):
                self.network._exited(linker, remote)
