"""R-NW-1..3, R-NW-5: the runtime on the network, two runtimes in one OS
process talking over loopback (asyncio and trio). Other OS processes and
compactor: test_network_processes.py; hostile clients: test_network_hostile.py."""

from __future__ import annotations

import logging
import re
from typing import Any

import anyio
import h11
import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime import PID, Failure, Process, Response, Runtime, dispatch, send, spawn, terminate, wait
from runtime.testing import expect_dispatch

pytestmark = pytest.mark.anyio


class Allocate(msgspec.Struct, frozen=True):
    container: str
    gpus: int


class Receiver(Process):
    """Records what each handler got; ``expect(n)`` waits for n more."""

    def __init__(self, id: str = "receiver") -> None:
        super().__init__(id)
        self.got: list[tuple[str, PID | None, Any]] = []
        self._want = 0
        self._event = anyio.Event()

    def initialize(self) -> None:
        self.install("allocate", self.on("allocate"), Allocate)
        self.install("raw", self.on("raw"), bytes)
        self.install("any", self.on("any"))
        self.install("ping", self.ping, bytes)

    def on(self, name: str) -> Any:
        def handler(sender: PID | None, body: Any) -> None:
            self.got.append((name, sender, body))
            if len(self.got) >= self._want:
                self._event.set()
        return handler

    def ping(self, sender: PID, body: bytes) -> None:
        self.send(sender, "raw", b"pong:" + body)

    async def expect(self, count: int, timeout: float = 5.0) -> list[tuple[str, PID | None, Any]]:
        self._want = count
        with anyio.fail_after(timeout):
            while len(self.got) < count:
                self._event = anyio.Event()
                await self._event.wait()
        return self.got


class Sender(Process):
    def __init__(self, id: str = "sender") -> None:
        super().__init__(id)
        self.exits: list[PID] = []
        self.exited_event = anyio.Event()

    def tell(self, to: PID, name: str, body: Any) -> None:
        self.send(to, name, body)

    def tell_many(self, to: PID, bodies: list[Allocate]) -> None:
        for body in bodies:
            self.send(to, "allocate", body)

    def watch(self, pid: PID) -> None:
        self.link(pid)

    def exited(self, pid: PID) -> None:
        self.exits.append(pid)
        self.exited_event.set()


async def test_a_listening_runtime_has_an_address_and_its_pids_carry_it() -> None:
    async with Runtime() as quiet:
        assert quiet.address is None
        assert str(spawn(Receiver("local"))) == "local"
    async with Runtime(listen="127.0.0.1:0") as rt:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", rt.address)
        receiver = Receiver("r")
        pid = spawn(receiver)
        assert str(pid) == f"r@{rt.address}" and receiver.pid == pid
        assert PID.parse(str(pid)) == pid
        # a PID without an address still names the local process
        assert await dispatch(PID("r"), Receiver.on, "x") is not None
        with pytest.raises(Failure, match=r"A process with id r@127\.0\.0\.1:\d+ is already running"):
            spawn(Receiver("r"))


async def test_bad_listen_addresses_and_limits_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="Invalid address 'nowhere': expected 'host:port'"):
        Runtime(listen="nowhere")
    with pytest.raises(TypeError, match="limits must be a runtime.Limits, got dict"):
        Runtime(listen="127.0.0.1:0", limits={"max_body_bytes": 1})  # type: ignore[arg-type]


async def test_listening_on_a_port_in_use_fails_with_the_address_and_what_to_do() -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        with pytest.raises(OSError, match=rf"Cannot listen on 127\.0\.0\.1:{rt.address.split(':')[1]}: .*pick a free port"):
            async with Runtime(listen=rt.address):
                pass


async def test_messages_to_another_runtime_arrive_in_order_with_the_senders_pid() -> None:
    async with Runtime(listen="127.0.0.1:0") as a:
        receiver = Receiver()
        to = spawn(receiver)
        async with Runtime(listen="127.0.0.1:0") as b:
            sender = b.spawn(Sender())
            bodies = [Allocate(f"c{i}", i % 8) for i in range(300)]
            await dispatch(sender, Sender.tell_many, to, bodies)
            got = await receiver.expect(300)
            assert [body for _, _, body in got] == bodies
            assert {who for _, who, _ in got} == {sender}
            assert str(sender) == f"sender@{b.address}"
            assert a.metrics.snapshot()["runtime/messages/received"] == 300
            assert b.metrics.snapshot()["runtime/messages/sent"] == 300
            assert b.metrics.snapshot()["runtime/peers"] == 1  # one connection for all of them


async def test_an_actor_cannot_tell_a_remote_sender_from_a_local_one() -> None:
    cases = [
        ("allocate", Allocate("c1", 2)),
        ("allocate", {"container": "c2", "gpus": 1}),
        ("allocate", b'{"container": "c3", "gpus": 0}'),
        ("raw", b"\x00\xffraw bytes"),
        ("raw", "text"),
        ("raw", Allocate("c4", 4)),
        ("raw", None),
    ]
    async with Runtime(listen="127.0.0.1:0"):
        receiver = Receiver()
        to = spawn(receiver)
        local = spawn(Sender("local-sender"))
        for name, body in cases:
            await dispatch(local, Sender.tell, to, name, body)
        local_got = await receiver.expect(len(cases))
        async with Runtime(listen="127.0.0.1:0") as b:
            remote = b.spawn(Sender("remote-sender"))
            for name, body in cases:
                await dispatch(remote, Sender.tell, to, name, body)
            got = await receiver.expect(2 * len(cases))
        remote_got = got[len(cases):]
        assert [(n, body) for n, _, body in remote_got] == [(n, body) for n, _, body in local_got[: len(cases)]]
        assert [body for _, _, body in remote_got][3:] == [b"\x00\xffraw bytes", b"text", b'{"container":"c4","gpus":4}', b""]
        assert {who for _, who, _ in local_got[: len(cases)]} == {local}
        assert {who for _, who, _ in remote_got} == {remote}


async def test_a_handler_answers_the_remote_sender() -> None:
    async with Runtime(listen="127.0.0.1:0"):
        echo = Receiver("echo")
        echo_pid = spawn(echo)
        async with Runtime(listen="127.0.0.1:0") as b:
            asker = Receiver("asker")
            asker_pid = b.spawn(asker)
            await dispatch(asker_pid, Receiver.send, echo_pid, "ping", b"hello")
            [(name, who, body)] = await asker.expect(1)
            assert (name, who, body) == ("raw", echo_pid, b"pong:hello")


async def test_outgoing_requests_are_libprocess_wire_form_on_one_persistent_connection() -> None:
    seen: list[tuple[h11.Request, bytes]] = []
    connections = 0
    done = anyio.Event()

    async def peer(stream: Any) -> None:  # plays a libprocess peer, parsing with h11
        nonlocal connections
        connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while len(seen) < 2:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive())
                elif type(event) is h11.Request:
                    head, body = event, b""
                elif type(event) is h11.Data:
                    body += event.data
                elif type(event) is h11.EndOfMessage:
                    seen.append((head, bytes(body)))
                    await stream.send(conn.send(h11.Response(status_code=202, headers=[("Content-Length", "0")])) + conn.send(h11.EndOfMessage()))
                    conn.start_next_cycle()
            done.set()
            await anyio.sleep(1)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, peer)
        async with Runtime(listen="127.0.0.1:0"):
            sender = spawn(Sender("s(1)"))
            them = PID("them(7)", "127.0.0.1", port)
            await dispatch(sender, Sender.tell, them, "allocate", Allocate("c1", 2))
            await dispatch(sender, Sender.tell, them, "raw/with/slashes", b"\x01\x02")
            with anyio.fail_after(5):
                await done.wait()
        tg.cancel_scope.cancel()
    assert connections == 1
    (first, body1), (second, body2) = seen
    assert (first.method, first.target, first.http_version) == (b"POST", b"/them(7)/allocate", b"1.1")
    headers = dict(first.headers)
    assert headers[b"host"] == f"127.0.0.1:{port}".encode()
    assert headers[b"libprocess-from"] == str(sender).encode()
    assert headers[b"user-agent"] == f"libprocess/{sender}".encode()
    assert body1 == msgspec.json.encode(Allocate("c1", 2))
    assert (second.target, body2) == (b"/them(7)/raw/with/slashes", b"\x01\x02")


async def test_incoming_messages_get_202_404_or_400_and_a_bad_body_never_a_5xx(caplog: pytest.LogCaptureFixture) -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        receiver = Receiver()
        spawn(receiver)
        base = f"http://{rt.address}/receiver"
        sender = {"Libprocess-From": "peer(1)@127.0.0.1:1"}
        async with httpx.AsyncClient() as http:
            ok = await http.post(f"{base}/allocate", content=b'{"container": "c1", "gpus": 1}', headers=sender)
            legacy = await http.post(f"{base}/allocate", content=b'{"container": "c2", "gpus": 1}', headers={"User-Agent": "libprocess/old(2)@127.0.0.1:2"})
            with caplog.at_level(logging.ERROR, logger="runtime._process"):
                garbage = await http.post(f"{base}/allocate", content=b"\xff not json", headers=sender)
                wrong_type = await http.post(f"{base}/allocate", content=b'{"container": 5}', headers=sender)
            no_process = await http.post(f"http://{rt.address}/nobody/allocate", content=b"{}", headers=sender)
            no_handler = await http.post(f"{base}/unknown", content=b"{}", headers=sender)
            no_sender = await http.post(f"{base}/allocate", content=b"{}")
            bad_sender = await http.post(f"{base}/allocate", content=b"{}", headers={"Libprocess-From": "not a pid"})
            no_address = await http.post(f"{base}/allocate", content=b"{}", headers={"Libprocess-From": "peer(1)"})
            got = await receiver.expect(2)
            processes = (await http.get(f"http://{rt.address}/__processes__")).json()
    assert [r.status_code for r in (ok, legacy, garbage, wrong_type)] == [202, 202, 202, 202]
    assert ok.reason_phrase == "Accepted"
    assert (no_process.status_code, no_process.text) == (404, "404 Not Found: no process 'nobody' here\n")
    assert (no_handler.status_code, no_handler.text) == (404, "404 Not Found: process 'receiver' has no handler for message 'unknown'\n")
    assert no_sender.status_code == 400 and "has no sender" in no_sender.text
    assert bad_sender.status_code == 400 and no_address.status_code == 400
    assert bad_sender.text == "400 Bad Request: the message has no sender: 'Libprocess-From' must be a PID 'id@host:port'\n"
    assert got == [("allocate", PID("peer(1)", "127.0.0.1", 1), Allocate("c1", 1)), ("allocate", PID("old(2)", "127.0.0.1", 2), Allocate("c2", 1))]
    [entry] = processes
    assert entry["id"] == "receiver" and entry["messages_rejected"] == 2 and entry["state"] == "running"
    assert "message 'allocate' rejected: body does not decode" in caplog.text


async def test_a_message_sent_before_initialize_ran_waits_for_its_handler() -> None:
    class Late(Receiver):
        async def initialize(self) -> None:
            await anyio.sleep(0.2)
            super().initialize()

    async with Runtime(listen="127.0.0.1:0") as rt:
        late = Late("late")
        spawn(late)
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"http://{rt.address}/late/raw", content=b"early", headers={"Libprocess-From": "p@127.0.0.1:1"})
        assert answer.status_code == 202
        assert await late.expect(1) == [("raw", PID("p", "127.0.0.1", 1), b"early")]


async def test_a_link_to_an_unreachable_address_gives_exited() -> None:
    async with Runtime(listen="127.0.0.1:0"):
        sender = Sender()
        spawn(sender)
        gone = PID("ghost", "127.0.0.1", 1)
        await dispatch(sender.pid, Sender.watch, gone)
        with anyio.fail_after(5):
            await sender.exited_event.wait()
        assert sender.exits == [gone]


async def test_a_link_to_another_runtime_gives_exited_when_its_connection_breaks() -> None:
    async with Runtime(listen="127.0.0.1:0") as a:
        watcher = Sender("watcher")
        spawn(watcher)
        async with Runtime(listen="127.0.0.1:0") as b:
            target = b.spawn(Receiver("target"))
            await a.dispatch(watcher.pid, Sender.watch, (target,), {})
            await a.dispatch(watcher.pid, Sender.tell, (target, "raw", b"hi"), {})  # the link's connection is in use
            await anyio.sleep(0.1)
            assert watcher.exits == []
        with anyio.fail_after(5):
            await watcher.exited_event.wait()
        assert watcher.exits == [target]


async def test_remote_pids_without_listening_or_a_sender_are_errors_that_say_what_to_do() -> None:
    remote = PID("x", "127.0.0.1", 1)
    async with Runtime():
        sender = Sender()
        spawn(sender)
        with pytest.raises(Failure, match=r"Cannot send to x@127\.0\.0\.1:1: this runtime is not on the network; create it with Runtime\(listen='host:port'\)"):
            send(remote, "raw", b"")
        failed = dispatch(sender.pid, Sender.watch, remote)
        with pytest.raises(Failure, match="Cannot link to x@127.0.0.1:1: this runtime is not on the network"):
            await failed
    async with Runtime(listen="127.0.0.1:0"):
        with pytest.raises(Failure, match=r"Message 'raw' to x@127\.0\.0\.1:1 needs a sender the peer can answer: send it from a process"):
            send(remote, "raw", b"")


class Web(Process):
    def __init__(self) -> None:
        super().__init__("web")
        self.hits = 0

    def initialize(self) -> None:
        self.route("/state", Web.state, help="the counter as JSON")
        self.route("/state/deep", lambda request: Response("deeper", status=203, headers={"X-Depth": "2"}))
        self.route("/slow", self.slow)
        self.route("/broken", lambda request: 1 / 0)

    def state(self, request: Any) -> Any:
        self.hits += 1
        return {"hits": self.hits, "path": request.path, "query": request.query, "method": request.method}

    async def slow(self, request: Any) -> str:
        await anyio.sleep(0.05)
        return f"slow {request.body.decode()}"


async def test_process_routes_run_as_events_of_the_process() -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        web = Web()
        pid = spawn(web)
        seen = expect_dispatch(pid, "state")
        async with httpx.AsyncClient(base_url=f"http://{rt.address}") as http:
            state = await http.get("/web/state?verbose=1&x=%2F")
            below = await http.get("/web/state/other/thing")  # no longer route: the parent's
            deep = await http.get("/web/state/deep")
            slow = await http.post("/web/slow", content=b"body")
            broken = await http.get("/web/broken")
            missing = await http.get("/web/none")
            head = await http.head("/web/state")
    assert (await seen).method == "state"
    assert state.status_code == 200 and state.headers["content-type"] == "application/json"
    assert state.json() == {"hits": 1, "path": "/web/state", "query": {"verbose": "1", "x": "/"}, "method": "GET"}
    assert below.json()["path"] == "/web/state/other/thing"
    assert (deep.status_code, deep.text, deep.headers["x-depth"]) == (203, "deeper", "2")
    assert (slow.status_code, slow.text) == (200, "slow body")
    assert broken.status_code == 500 and "ZeroDivisionError" in broken.text
    assert missing.status_code == 404
    assert head.status_code == 200 and head.content == b""
    assert web.hits == 3  # state, below, head


async def test_a_route_path_must_start_with_a_slash() -> None:
    with pytest.raises(ValueError, match="Route path must start with '/', got 'state'"):
        Web().route("state", lambda request: "")


async def test_the_runtimes_endpoints_processes_metrics_and_help() -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        spawn(Web())
        spawn(Receiver())
        rt.metrics.timer("web/latency", "how long").record(0.004)
        async with httpx.AsyncClient(base_url=f"http://{rt.address}") as http:
            await http.post("/receiver/raw", content=b"x", headers={"Libprocess-From": "p@127.0.0.1:1"})
            processes = (await http.get("/__processes__")).json()
            snapshot = (await http.get("/metrics/snapshot")).json()
            text = await http.get("/metrics")
            help_text = (await http.get("/help")).text
            wrong_method = await http.post("/metrics")
            nothing = await http.get("/nothing/here")
    assert [p["id"] for p in processes] == ["receiver", "web"]
    assert set(processes[0]) >= {"id", "pid", "queue_depth", "events_handled", "failures", "messages_rejected"}
    assert processes[0]["pid"] == f"receiver@{rt.address}"
    assert all(isinstance(value, (int, float)) for value in snapshot.values())
    assert snapshot["runtime/processes"] == 2 and snapshot["runtime/messages/received"] == 1
    assert snapshot["web/latency_ms"] == pytest.approx(4.0) and snapshot["web/latency_ms/count"] == 1
    assert snapshot["web/latency_ms/p99"] == pytest.approx(4.0)
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(text.text)}
    assert families["runtime_processes"].samples[0].value == 2
    assert families["runtime_messages_received"].type == "counter"
    assert families["web_latency_seconds"].type == "summary"
    assert "/web/state\n    the counter as JSON" in help_text and "/__processes__" in help_text
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET, HEAD"
    assert nothing.status_code == 404 and "GET /help lists the endpoints" in nothing.text


async def test_terminated_processes_leave_the_routing_table() -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        pid = spawn(Web())
        terminate(pid)
        await wait(pid)  # finalized: its routes are gone
        async with httpx.AsyncClient(base_url=f"http://{rt.address}") as http:
            assert (await http.get("/web/state")).status_code == 404
            answer = await http.post("/web/state", content=b"", headers={"Libprocess-From": "p@127.0.0.1:1"})
            assert answer.status_code == 404


async def test_an_admit_check_sees_every_remote_request_first_and_its_refusal_delivers_nothing() -> None:
    """``Process.admit`` (the service's bearer credential, SPEC R-SC-6): a
    refused message is not delivered and a refused route does not run;
    the runtime's own endpoints and other processes are not asked."""
    async with Runtime(listen="127.0.0.1:0") as rt:
        guarded, open_ = Receiver("guarded"), Receiver("open")
        spawn(guarded)
        spawn(open_)
        guarded.route("/state", lambda request: {"seen": True})
        asked: list[str] = []

        def check(request: Any) -> Response | None:
            asked.append(request.path)
            return None if request.headers.get("authorization") == "Bearer yes" else Response("no\n", 401)

        guarded.admit(check)
        sender = {"Libprocess-From": "peer(1)@127.0.0.1:1"}
        body = b'{"container": "c1", "gpus": 1}'
        async with httpx.AsyncClient(base_url=f"http://{rt.address}") as http:
            refused = await http.post("/guarded/allocate", content=body, headers=sender)
            route_refused = await http.get("/guarded/state")
            unknown = await http.post("/guarded/unknown", content=body, headers=sender)
            other = await http.post("/open/allocate", content=body, headers=sender)
            metrics = await http.get("/metrics")
            admitted = await http.post("/guarded/allocate", content=b'{"container": "c2", "gpus": 1}',
                                       headers={**sender, "Authorization": "Bearer yes"})
            route = await http.get("/guarded/state", headers={"Authorization": "Bearer yes"})
            await guarded.expect(1)
            await open_.expect(1)
    assert [r.status_code for r in (refused, route_refused, unknown)] == [401, 401, 401]
    assert (other.status_code, metrics.status_code, admitted.status_code, route.json()) == (202, 200, 202, {"seen": True})
    assert [body for _name, _sender, body in guarded.got] == [Allocate("c2", 1)]  # the refused one never arrived
    assert asked == ["/guarded/allocate", "/guarded/state", "/guarded/unknown", "/guarded/allocate", "/guarded/state"]
