"""Server connection: one incoming HTTP/1.1 connection, parsed with h11.

Rules:
- Requests on a connection are answered in the order they came (HTTP/1.1
  pipelining); answers to requests already read are written in one send
  before the connection waits for more bytes or for an async handler.
- ``respond(request)`` (the router) returns a ``Response`` or an awaitable
  of one; a handler that raises is logged and answered 500 (a message
  request never gets there: its router answers synchronously).
- Every limit of ``Limits`` is enforced here and costs the offender its
  connection only: a head over ``max_header_bytes`` -> 431, a target over
  ``max_target_bytes`` -> 414, a body over ``max_body_bytes`` -> 413
  (``Content-Length`` is checked before reading), a head not complete
  ``header_timeout`` after its first byte or a body not complete
  ``body_timeout`` after its head -> 408, malformed HTTP -> 400 (h11's
  status hint where it has one); then the connection closes. A response
  that cannot be written within ``send_timeout`` closes it. With
  ``idle_timeout`` a connection quiet that long between requests closes.
  A refused connection closes gently: our side ends, what the client still
  sends is read and dropped for half a second, then it closes.
- HTTP/1.0 requests that ask for ``Connection: keep-alive`` (compactor's
  messages) keep the connection: h11 does not do 1.0 keep-alive, so a fresh
  parser takes over the bytes already received. Nothing pipelined behind
  them is lost.
- Nothing a client sends raises out of here; the connection is closed
  when the task ends, cancelled or not.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable
from urllib.parse import parse_qsl, unquote

import anyio
import h11

from ._http import Limits, Request, Response, reason_phrase

logger = logging.getLogger(__name__)

_TIMEOUT = object()
_RECEIVE_SIZE = 65536
_LINGER = 0.5
_OUT_ITEMS = 64  # answers waiting to be written (3 items each) before a write


class Refused(Exception):
    """A request refused by a limit: answered with ``status`` and closed."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class ServerConnection:
    """Serves one accepted connection until it closes (see module rules)."""

    def __init__(self, stream: Any, client: str, limits: Limits, respond: Callable[[Request], Any], stats: Any) -> None:
        self.stream = stream
        self.client = client
        self.limits = limits
        self.respond = respond
        self.stats = stats  # .requests, .refused counters (Counter-like)
        self.conn = self._parser()
        self.out: list[bytes] = []

    def _parser(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)

    async def run(self) -> None:
        try:
            await self._serve()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
            logger.debug("Connection from %s broke: %s", self.client, e)
        except h11.LocalProtocolError as e:  # our own bug: never the client's to see
            logger.error("Connection from %s: response not valid HTTP (%s); closing", self.client, e)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(self.stream)

    async def _serve(self) -> None:
        while True:
            try:
                event = await self._read_head()
                if event is None or type(event) is h11.ConnectionClosed:
                    return
                if type(event) is not h11.Request:
                    raise Refused(400, f"unexpected {type(event).__name__}")
                request = self._request(event)
                request.body = await self._read_body(request)
            except h11.RemoteProtocolError as e:
                await self._refuse(e.error_status_hint, str(e))
                return
            except Refused as e:
                await self._refuse(e.status, str(e))
                return
            self.stats.requests.inc()
            response = self._call(request)
            if not isinstance(response, Response):
                if not await self._flush():
                    return
                response = await self._await(request, response)
            self._write(event, response)
            if len(self.out) >= _OUT_ITEMS and not await self._flush():  # pipelined answers: bounded
                return
            if not await self._next_cycle(event, request):
                return

    # -- reading ------------------------------------------------------------
    async def _receive(self, timeout: float | None) -> Any:
        if timeout is None:
            try:
                return await self.stream.receive(_RECEIVE_SIZE)
            except anyio.EndOfStream:
                return b""
        if timeout <= 0:
            return _TIMEOUT
        with anyio.move_on_after(timeout):
            try:
                return await self.stream.receive(_RECEIVE_SIZE)
            except anyio.EndOfStream:
                return b""
        return _TIMEOUT

    async def _read_head(self) -> Any:
        deadline = None
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if not await self._flush():
                return None
            if deadline is None:
                data = await self._receive(self.limits.idle_timeout)
                if data is _TIMEOUT:
                    logger.debug("Connection from %s idle for %ss; closing", self.client, self.limits.idle_timeout)
                    return None
                deadline = time.monotonic() + self.limits.header_timeout
            else:
                data = await self._receive(deadline - time.monotonic())
                if data is _TIMEOUT:
                    raise Refused(408, f"request headers not complete within {self.limits.header_timeout:g}s")
            conn.receive_data(data)

    def _request(self, event: h11.Request) -> Request:
        target = event.target
        if len(target) > self.limits.max_target_bytes:
            raise Refused(414, f"request target of {len(target)} bytes is over the limit of {self.limits.max_target_bytes}")
        size = len(target) + 16
        headers: dict[str, str] = {}
        for name, value in list(event.headers):  # one pass: h11's Headers iterate item by item
            size += len(name) + len(value) + 4
            key = name.decode("latin-1")
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if size > self.limits.max_header_bytes:  # h11 bounds only a head still incomplete
            raise Refused(431, f"request head of about {size} bytes is over the limit of {self.limits.max_header_bytes}")
        raw_path, _, raw_query = target.decode("latin-1").partition("?")
        query = dict(parse_qsl(raw_query, keep_blank_values=True)) if raw_query else {}
        return Request(event.method.decode("ascii"), unquote(raw_path), query, headers, b"", self.client)

    async def _read_body(self, request: Request) -> bytes:
        conn = self.conn
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        declared = int(declared) if declared.isdigit() else None
        if declared is not None and declared > limit:
            raise Refused(413, f"body of {declared} bytes is over the limit of {limit}")
        chunks: list[bytes] = []
        size = 0
        deadline = None
        while True:
            event = conn.next_event()
            kind = type(event)
            if kind is h11.Data:
                size += len(event.data)
                if size > limit:
                    raise Refused(413, f"body is over the limit of {limit} bytes")
                chunks.append(event.data)
            elif kind is h11.EndOfMessage:
                return bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
            elif event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    self.out.append(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                    if not await self._flush():
                        raise anyio.BrokenResourceError
                if deadline is None:
                    deadline = time.monotonic() + self.limits.body_timeout
                data = await self._receive(deadline - time.monotonic())
                if data is _TIMEOUT:
                    raise Refused(408, f"request body not complete within {self.limits.body_timeout:g}s")
                conn.receive_data(data)
            elif kind is h11.ConnectionClosed:
                raise anyio.BrokenResourceError
            else:
                raise Refused(400, f"unexpected {kind.__name__} in a request body")

    # -- answering ----------------------------------------------------------
    def _call(self, request: Request) -> Any:
        try:
            return self.respond(request)
        except Exception:  # noqa: BLE001 - a router bug answers 500, never kills the server
            logger.exception("Request %s %s from %s: the handler raised", request.method, request.path, self.client)
            return Response.error(500, "the handler raised; see the server's log")

    async def _await(self, request: Request, pending: Any) -> Response:
        try:
            return Response.of(await pending)
        except Exception as e:  # noqa: BLE001
            logger.error("Request %s %s from %s failed: %s", request.method, request.path, self.client, e, exc_info=e)
            return Response.error(500, f"{type(e).__name__}: {e}")

    def _write(self, head: h11.Request, response: Response) -> None:
        conn = self.conn
        if response is ACCEPTED:  # a message's answer: h11 events built once
            self.out.append(conn.send(_ACCEPTED_HEAD))
            self.out.append(conn.send(_END))
            return
        headers = [("Content-Length", str(len(response.body)))]
        if response.content_type:
            headers.append(("Content-Type", response.content_type))
        headers.extend(response.headers.items())
        out = self.out
        out.append(conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason_phrase(response.status))))
        if response.body and head.method != b"HEAD":
            out.append(conn.send(h11.Data(data=response.body)))
        out.append(conn.send(_END))

    async def _next_cycle(self, head: h11.Request, request: Request) -> bool:
        conn = self.conn
        if conn.our_state is h11.MUST_CLOSE:
            if head.http_version == b"1.0" and "keep-alive" in request.headers.get("connection", "").lower():
                data, closed = conn.trailing_data
                self.conn = conn = self._parser()  # h11 has no 1.0 keep-alive: go on with a fresh parser
                if data:
                    conn.receive_data(data)
                if closed:
                    conn.receive_data(b"")  # empty means end of stream to h11
                return True
            await self._flush()
            return False
        conn.start_next_cycle()
        return True

    async def _refuse(self, status: int, text: str) -> None:
        self.stats.refused.inc()
        logger.warning("Refused a request from %s: %s %s", self.client, status, text)
        response = Response.error(status, text)
        try:
            self._write(_ERROR_HEAD, Response(response.body, status, response.content_type, {"Connection": "close"}))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: nothing more is said
            self.out.clear()
        if await self._flush():
            await self._linger()

    async def _linger(self) -> None:
        """Close gently: end our side, then drop what the client still sends
        for a moment (at most ``_LINGER`` seconds), so that closing does not
        reset the connection before the client has read the refusal."""
        try:
            await self.stream.send_eof()
            with anyio.move_on_after(_LINGER):
                while await self.stream.receive(_RECEIVE_SIZE):
                    pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    async def _flush(self) -> bool:
        if not self.out:
            return True
        data = b"".join(self.out)
        self.out.clear()
        with anyio.move_on_after(self.limits.send_timeout):
            await self.stream.send(data)
            return True
        logger.warning("Connection from %s: a response could not be written within %gs; closing", self.client, self.limits.send_timeout)
        return False


ACCEPTED = Response(b"", 202)
_ACCEPTED_HEAD = h11.Response(status_code=202, headers=[("Content-Length", "0")], reason=b"Accepted")
_END = h11.EndOfMessage()
_ERROR_HEAD = h11.Request(method="GET", target="/", headers=[("Host", "-")])  # errors always carry their body


__all__ = ["ACCEPTED", "ServerConnection", "Refused"]
