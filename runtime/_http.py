"""HTTP values of the network runtime: a request as a route sees it, the
response it gives back, and the server's limits.

Rules:
- A route handler (``Process.route``) gets a ``Request``: ``method``,
  ``path`` (decoded, without the query), ``query`` (decoded pairs, last one
  wins), ``headers`` (names lower-cased; a repeated header's values joined
  by ``", "``), ``body`` (bytes) and ``client`` (``host:port`` of the peer).
- It returns a ``Response`` (status, body, content type, extra headers),
  or, for short: ``str`` (text/plain), ``bytes``
  (application/octet-stream), or a ``dict``/``list``/msgspec Struct
  (JSON) -- or a Future/awaitable of any of these. ``Response.json(value)``
  builds a JSON response.
- ``Limits`` bounds what one client can cost the server (sizes in bytes,
  times in seconds); every refusal answers with the HTTP status named on
  its field and closes that connection only.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec

__all__ = ["Limits", "Request", "Response"]


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What one client may cost the server (``Runtime(listen=..., limits=...)``)."""

    max_header_bytes: int = 16 * 1024
    """Request line plus headers; more -> 431 (h11's incomplete-event limit)."""
    max_target_bytes: int = 8 * 1024
    """The request target (path and query); longer -> 414."""
    max_body_bytes: int = 16 * 1024 * 1024
    """A request body; larger -> 413 (Content-Length checked before reading)."""
    max_connections: int = 1024
    """Open incoming connections in all; more -> 503 and closed."""
    max_connections_per_client: int = 256
    """Open incoming connections from one client address; more -> 503."""
    header_timeout: float = 10.0
    """From a request's first byte until its headers are complete; -> 408."""
    body_timeout: float = 60.0
    """From the end of the headers until the body is complete; -> 408."""
    idle_timeout: float | None = None
    """A connection waiting for its next request; None: no limit (libprocess
    peers keep their connections open between messages and for links)."""
    send_timeout: float = 30.0
    """Writing one response (or one batch of messages to a peer)."""
    connect_timeout: float = 5.0
    """Connecting to a peer; an unreachable peer's links get ``exited``."""

    def __post_init__(self) -> None:
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"Limits.{field} must be > 0, got {value!r}")


class Request:
    """An HTTP request as a route handler sees it."""

    __slots__ = ("method", "path", "query", "headers", "body", "client")

    def __init__(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes, client: str) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.client = client

    def json(self, type: Any = Any) -> Any:
        """The body decoded as JSON (msgspec), optionally to ``type``."""
        return msgspec.json.decode(self.body, type=type)

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path} from {self.client}>"


class Response:
    """An HTTP response: ``Response(body, status=200, content_type=..., headers=...)``."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(
        self,
        body: bytes | str = b"",
        status: int = 200,
        content_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if isinstance(body, str):
            body = body.encode()
            content_type = content_type or "text/plain; charset=utf-8"
        self.body = bytes(body)
        self.status = int(status)
        self.content_type = content_type or ("application/octet-stream" if body else None)
        self.headers = dict(headers or {})

    @classmethod
    def json(cls, value: Any, status: int = 200) -> "Response":
        """``value`` encoded with msgspec as ``application/json``."""
        return cls(msgspec.json.encode(value), status, "application/json")

    @classmethod
    def error(cls, status: int, text: str | None = None) -> "Response":
        """A plain-text error: the reason phrase and what went wrong."""
        reason = reason_phrase(status)
        return cls(f"{status} {reason}: {text}\n" if text else f"{status} {reason}\n", status)

    @classmethod
    def of(cls, value: Any) -> "Response":
        """What a route handler returned, as a Response (see module rules)."""
        if isinstance(value, Response):
            return value
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            return cls(value if isinstance(value, str) else bytes(value))
        if value is None:
            return cls(b"", 200)
        return cls.json(value)

    def __repr__(self) -> str:
        return f"<Response {self.status} {len(self.body)} bytes>"


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
