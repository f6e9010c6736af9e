"""R-NW-5: hostile clients. Each is refused with a bounded cost (its own
connection, a status that says why), others are served meanwhile, and
nothing crashes. Small limits keep every wait short; every wait is bounded."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from runtime import Limits, Process, Runtime, spawn

pytestmark = pytest.mark.anyio

LIMITS = Limits(
    max_header_bytes=1024,
    max_target_bytes=256,
    max_body_bytes=1000,
    header_timeout=0.3,
    body_timeout=0.3,
    send_timeout=0.5,
    max_connections=8,
    max_connections_per_client=4,
)


class Inbox(Process):
    def __init__(self) -> None:
        super().__init__("inbox")
        self.count = 0

    def initialize(self) -> None:
        self.install("note", self.note, bytes)

    def note(self, sender: Any, body: bytes) -> None:
        self.count += 1


@pytest.fixture
async def server() -> AsyncIterator[Runtime]:
    async with Runtime(listen="127.0.0.1:0", limits=LIMITS) as rt:
        spawn(Inbox())
        yield rt


def _port(rt: Runtime) -> int:
    return int(rt.address.rsplit(":", 1)[1])


async def _connect(rt: Runtime, local_host: str | None = None) -> anyio.abc.SocketStream:
    """A TCP connection to ``rt``'s listening port (from ``local_host``)."""
    return await anyio.connect_tcp("127.0.0.1", _port(rt), local_host=local_host)


async def _exchange(rt: Runtime, data: bytes, local_host: str | None = None, timeout: float = 3.0) -> bytes:
    """Send ``data`` and read until the server closes (bounded)."""
    with anyio.fail_after(timeout):
        async with await _connect(rt, local_host) as stream:
            await stream.send(data)
            return await _read_all(stream)


async def _read_all(stream: Any) -> bytes:
    chunks = []
    try:
        while True:
            chunks.append(await stream.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
        return b"".join(chunks)


async def _open_connections(rt: Runtime, count: int) -> None:
    """Wait (bounded) until the server holds exactly ``count`` incoming connections."""
    with anyio.fail_after(5):
        while rt.metrics.snapshot()["runtime/http/connections"] != count:
            await anyio.sleep(0.005)


async def _served(rt: Runtime) -> None:
    """A well-behaved client still gets an answer (bounded wait)."""
    with anyio.fail_after(5):
        async with httpx.AsyncClient() as http:
            answer = await http.get(f"http://{rt.address}/__processes__")
    assert answer.status_code == 200 and answer.json()[0]["id"] == "inbox"


async def test_an_oversized_header_is_refused_with_431(server: Runtime) -> None:
    answer = await _exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    await _served(server)


async def test_an_oversized_request_line_is_refused_431_or_414_by_size(server: Runtime) -> None:
    endless = await _exchange(server, b"GET /" + b"a" * 4000)  # never ends: over the head limit
    long = await _exchange(server, b"GET /" + b"a" * 400 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert endless.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert re.match(rb"HTTP/1\.1 414 (Request-)?URI Too Long\r\n", long)
    assert b"request target of 401 bytes is over the limit of 256" in long
    await _served(server)


async def test_a_declared_oversized_body_is_refused_before_it_is_read(server: Runtime) -> None:
    # the client sends no byte of the body: the answer comes all the same
    answer = await _exchange(server, b"POST /inbox/note HTTP/1.1\r\nHost: x\r\nLibprocess-From: p@127.0.0.1:1\r\nContent-Length: 100000000\r\n\r\n")
    assert re.match(rb"HTTP/1\.1 413 (Content|Request Entity) Too Large\r\n", answer)
    assert b"body of 100000000 bytes is over the limit of 1000" in answer
    await _served(server)


async def test_a_chunked_body_that_grows_over_the_limit_is_refused(server: Runtime) -> None:
    chunk = b"%x\r\n%s\r\n" % (600, b"x" * 600)
    answer = await _exchange(server, b"POST /inbox/note HTTP/1.1\r\nHost: x\r\nLibprocess-From: p@127.0.0.1:1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2 + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"body is over the limit of 1000 bytes" in answer


@pytest.mark.parametrize("garbage", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header Without Colon\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS hello
])
async def test_malformed_http_is_refused_with_400(server: Runtime, garbage: bytes) -> None:
    answer = await _exchange(server, garbage)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    await _served(server)


async def test_a_slowloris_client_is_cut_off_while_others_are_served(server: Runtime) -> None:
    request = b"GET /__processes__ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 200
    sent: list[int] = []

    async def slowloris() -> None:
        async with await _connect(server) as stream:
            count = 0
            try:
                for byte in request:  # 240 bytes at 20/s would take 12 s
                    await stream.send(bytes([byte]))
                    count += 1
                    await anyio.sleep(0.05)
            except (anyio.BrokenResourceError, ConnectionResetError):
                pass
            sent.append(count)
            answer = await _read_all(stream)
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n") or answer == b""

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(slowloris)
            await _open_connections(server, 1)
            for _ in range(5):  # served meanwhile
                await _served(server)
    assert sent and sent[0] < len(request)  # cut off by the header timeout, not waited out
    assert server.metrics.snapshot()["runtime/http/refused"] >= 1


async def test_a_body_that_trickles_in_is_cut_off_with_408(server: Runtime) -> None:
    answer: list[bytes] = []
    trickled = [0]

    async def trickle(stream: Any) -> None:
        try:
            for _ in range(200):  # 200 bytes at 20/s would take 10 s
                if answer:
                    return
                await stream.send(b"x")
                trickled[0] += 1
                await anyio.sleep(0.05)
        except (anyio.BrokenResourceError, ConnectionResetError):
            pass

    with anyio.fail_after(15):
        async with await _connect(server) as stream:
            await stream.send(b"POST /inbox/note HTTP/1.1\r\nHost: x\r\nLibprocess-From: p@127.0.0.1:1\r\nContent-Length: 200\r\n\r\n")
            async with anyio.create_task_group() as tg:
                tg.start_soon(trickle, stream)
                answer.append(await stream.receive())
                answer.append(await _read_all(stream))
    assert trickled[0] < 200  # cut off by the body timeout, not waited out
    assert answer[0].startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"request body not complete within 0.3s" in b"".join(answer)


async def test_too_many_connections_from_one_client_get_503_and_others_still_get_in(server: Runtime) -> None:
    port = _port(server)
    with anyio.fail_after(5):
        hogs = [await anyio.connect_tcp("127.0.0.1", port, local_host="127.0.0.2") for _ in range(LIMITS.max_connections_per_client)]
        await _open_connections(server, LIMITS.max_connections_per_client)
        refused = await _exchange(server, b"", local_host="127.0.0.2")
        await _served(server)  # from 127.0.0.1
        for hog in hogs:
            await hog.aclose()
    assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    head, body = refused.split(b"\r\n\r\n", 1)
    assert b"Content-Length: %d" % len(body) in head and body == b"503 Service Unavailable: too many connections\n"
    assert server.metrics.snapshot()["runtime/http/connections_refused"] == 1


async def test_a_full_server_keeps_serving_the_connections_it_has(server: Runtime) -> None:
    port = _port(server)
    with anyio.fail_after(5):
        async with httpx.AsyncClient() as http:  # connected before the flood: kept alive
            assert (await http.get(f"http://{server.address}/__processes__")).status_code == 200
            flood = []
            for i in range(LIMITS.max_connections + 4):
                flood.append(await anyio.connect_tcp("127.0.0.1", port, local_host=f"127.0.1.{i}"))
            refused = await _read_all(flood[-1])  # the server closes it: it is over the cap
            assert (await http.get(f"http://{server.address}/__processes__")).status_code == 200
            for stream in flood:
                await stream.aclose()
    assert refused.startswith(b"HTTP/1.1 503 ")
    assert server.metrics.snapshot()["runtime/http/connections_refused"] >= 4
    await _open_connections(server, 0)  # the slots come back once the flood leaves
    await _served(server)


async def test_a_client_that_never_reads_its_answers_is_closed_after_send_timeout(server: Runtime) -> None:
    request = b"GET /help HTTP/1.1\r\nHost: x\r\n\r\n"
    with anyio.fail_after(10):
        async with await _connect(server) as stream:
            try:
                for _ in range(4000):  # ~2 MB of answers piling up, never read
                    await stream.send(request * 10)
            except (anyio.BrokenResourceError, ConnectionResetError, BrokenPipeError):
                pass
            # still open on this side: the server closed it, its answers could
            # not go out within the send timeout
            await _open_connections(server, 0)
    await _served(server)


async def test_messages_to_processes_that_do_not_exist_cost_a_404_each(server: Runtime) -> None:
    request = b"POST /ghost(%d)/note HTTP/1.1\r\nHost: x\r\nLibprocess-From: p@127.0.0.1:1\r\nContent-Length: 1\r\n\r\nx"
    with anyio.fail_after(5):
        async with await _connect(server) as stream:
            await stream.send(b"".join(request % i for i in range(200)) + b"GET /__processes__ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await _read_all(stream)
    assert answer.count(b"HTTP/1.1 404 Not Found\r\n") == 200
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 1 and answer.endswith(b"]")
    assert server.metrics.snapshot()["runtime/messages/not_found"] == 200


async def test_an_idle_connection_closes_after_idle_timeout_when_one_is_set() -> None:
    async with Runtime(listen="127.0.0.1:0", limits=Limits(idle_timeout=0.2)) as rt:
        with anyio.fail_after(3):
            async with await _connect(rt) as stream:
                assert await _read_all(stream) == b""


async def test_http_1_0_keep_alive_messages_pipelined_on_one_connection_all_arrive() -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        inbox = Inbox()
        spawn(inbox)
        request = b"POST /inbox/note HTTP/1.0\r\nConnection: Keep-Alive\r\nLibprocess-From: p@127.0.0.1:1\r\nContent-Length: 1\r\n\r\nx"
        with anyio.fail_after(5):
            async with await _connect(rt) as stream:
                await stream.send(request * 50)
                while inbox.count < 50:  # the first 50 are in before the next 50 are sent
                    await anyio.sleep(0.01)
                await stream.send(request * 50)
                while inbox.count < 100:
                    await anyio.sleep(0.01)
    assert inbox.count == 100


async def test_limits_reject_values_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match="Limits.header_timeout must be > 0, got 0"):
        Limits(header_timeout=0)


async def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body(server: Runtime) -> None:
    with anyio.fail_after(5):
        async with await _connect(server) as stream:
            await stream.send(b"POST /inbox/note HTTP/1.1\r\nHost: x\r\nLibprocess-From: p@127.0.0.1:1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            interim = await stream.receive()
            await stream.send(b"body")
            final = await stream.receive()
    assert interim.startswith(b"HTTP/1.1 100 ")
    assert final.startswith(b"HTTP/1.1 202 Accepted\r\n")
