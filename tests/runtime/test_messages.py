"""R-RT-9 (in-process): named messages with msgspec bodies."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from runtime import PID, Clock, Process, Runtime, dispatch, send, snapshot, spawn


class Allocate(msgspec.Struct, frozen=True):
    container: str
    gpus: int


class Receiver(Process):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[PID | None, Any]] = []

    def initialize(self) -> None:
        self.install("allocate", self.on_allocate, Allocate)
        self.install("raw", lambda sender, body: self.got.append((sender, ("raw", body))))
        self.install("method", Receiver.on_method, Allocate)
        self.install("broken", self.on_broken, Allocate)

    def on_allocate(self, sender: PID | None, body: Allocate) -> None:
        self.got.append((sender, body))

    def on_method(self, sender: PID | None, body: Allocate) -> None:
        self.got.append((sender, ("method", body)))

    def on_broken(self, sender: PID | None, body: Allocate) -> None:
        raise RuntimeError(f"handler bug for {body.container}")

    def ping(self) -> str:
        return "pong"


class Sender(Process):
    def tell(self, to: PID, body: Allocate) -> None:
        self.send(to, "allocate", body)


async def started_receiver() -> tuple[Receiver, PID]:
    """A spawned Receiver whose initialize has run (its handlers installed)."""
    receiver = Receiver()
    pid = spawn(receiver)
    await Clock.settle()
    return receiver, pid


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "messages, expected",
    [
        ([("allocate", b'{"container": "c1", "gpus": 2}'), ("allocate", '{"container": "c2", "gpus": 1}')],
         [(None, Allocate("c1", 2)), (None, Allocate("c2", 1))]),
        ([("allocate", Allocate("c1", 2)), ("allocate", {"container": "c2", "gpus": 4}), ("raw", [1, 2])],
         [(None, Allocate("c1", 2)), (None, Allocate("c2", 4)), (None, ("raw", [1, 2]))]),
        ([("method", b'{"container": "c1", "gpus": 1}')], [(None, ("method", Allocate("c1", 1)))]),
    ],
    ids=["a-json-body-decodes-to-the-installed-struct", "struct-and-dict-bodies-are-accepted",
         "a-class-function-handler-gets-the-process"],
)
async def test_a_body_reaches_its_handler_as_installed(messages: list[tuple[str, Any]], expected: list[Any]) -> None:
    async with Runtime():
        receiver, pid = await started_receiver()
        for name, body in messages:
            send(pid, name, body)
        await Clock.settle()
        assert receiver.got == expected


@pytest.mark.asyncio
async def test_a_message_sent_right_after_spawn_reaches_the_handler_installed_by_initialize() -> None:
    async with Runtime():
        receiver = Receiver()
        pid = spawn(receiver)
        send(pid, "allocate", b'{"container": "c1", "gpus": 2}')  # before initialize ran
        await Clock.settle()
        assert receiver.got == [(None, Allocate("c1", 2))]


@pytest.mark.asyncio
async def test_messages_and_dispatches_share_one_mailbox_order() -> None:
    async with Runtime():
        receiver, pid = await started_receiver()
        send(pid, "raw", 1)
        dispatch(pid, Receiver.install, "raw", lambda sender, body: receiver.got.append((sender, ("new", body))))
        send(pid, "raw", 2)
        await Clock.settle()
        assert receiver.got == [(None, ("raw", 1)), (None, ("new", 2))]


@pytest.mark.asyncio
async def test_the_sender_pid_travels_with_a_message_sent_from_a_process() -> None:
    async with Runtime():
        receiver = Receiver()
        to = spawn(receiver)
        sender = spawn(Sender())
        await dispatch(sender, Sender.tell, to, Allocate("c9", 8))
        await Clock.settle()
        assert receiver.got == [(sender, Allocate("c9", 8))]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [b'{"container": "c1"', b'{"container": "c1", "gpus": "two"}', {"container": "c1"}, 42],
    ids=["bad-json", "wrong-type", "missing-field", "not-an-object"],
)
async def test_a_body_that_does_not_decode_is_rejected_logged_and_counted(
    body: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with Runtime():
        receiver, pid = await started_receiver()
        with caplog.at_level(logging.ERROR, logger="runtime._process"):
            send(pid, "allocate", body)
            await Clock.settle()
        assert receiver.got == []
        assert f"Process {pid}: message 'allocate' rejected: body does not decode" in caplog.text
        stats = snapshot()[str(pid)]
        assert stats["messages_rejected"] == 1
        assert stats["state"] == "running"
        # the receiver keeps serving messages and dispatches
        send(pid, "allocate", b'{"container": "ok", "gpus": 1}')
        assert await dispatch(pid, Receiver.ping) == "pong"
        assert receiver.got == [(None, Allocate("ok", 1))]


@pytest.mark.asyncio
async def test_a_message_without_a_handler_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    async with Runtime():
        _receiver, pid = await started_receiver()
        send(pid, "unknown", b"{}")
        await Clock.settle()
        assert "no handler installed for message 'unknown'" in caplog.text
        assert snapshot()[str(pid)]["messages_rejected"] == 1


@pytest.mark.asyncio
async def test_a_raising_handler_is_logged_counted_and_the_receiver_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with Runtime():
        receiver, pid = await started_receiver()
        send(pid, "broken", {"container": "c1", "gpus": 1})
        await Clock.settle()
        assert "handler of message 'broken' from None raised" in caplog.text
        assert "handler bug for c1" in caplog.text
        assert snapshot()[str(pid)]["failures"] == 1
        assert await dispatch(pid, Receiver.ping) == "pong"


@pytest.mark.asyncio
async def test_a_message_to_a_process_that_is_not_running_is_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with Runtime():
        send(PID("ghost(1)"), "allocate", b"{}")
        assert "Message 'allocate' to ghost(1) dropped: process is not running" in caplog.text
