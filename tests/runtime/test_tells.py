"""R-RT-9, R-RT-11, R-RT-13: tells -- fire-and-forget named messages (and
dispatches whose Future nobody keeps) -- keep libprocess' semantics on the
runtime's fast path: one sender's order across sends and dispatches, test
filters see every one, a process that is not running drops them and the
runtime counts what it dropped, and every delivered one is an event handled."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest

from runtime import PID, Clock, Process, Runtime, current_runtime, dispatch, send, snapshot, spawn, terminate, wait
from runtime.testing import Messaged, drop_message, expect_message

pytestmark = pytest.mark.anyio

BOUND = 10.0  # seconds any one test may take: a lost message fails it instead of hanging


class Note(msgspec.Struct, frozen=True):
    n: int


class Other:
    """A handler that is a method of some other object, not of the process."""

    def __init__(self) -> None:
        self.got: list[Any] = []

    def on_note(self, sender: PID | None, body: Any) -> None:
        self.got.append(("other", sender, body))


class Receiver(Process):
    def __init__(self, other: Other | None = None) -> None:
        super().__init__()
        self.log: list[Any] = []
        self.other = other

    def initialize(self) -> None:
        self.install("class", Receiver.on_class)  # a function of the class
        self.install("bound", self.on_bound)  # a method of this process
        self.install("lambda", lambda sender, body: self.log.append(("lambda", body)))
        self.install("typed", self.on_typed, Note)  # decoded on delivery
        self.install("boom", Receiver.on_boom)
        self.install("later", Receiver.on_later)  # an async handler
        if self.other is not None:
            self.install("other", self.other.on_note)

    def on_class(self, sender: PID | None, body: Any) -> None:
        self.log.append(("class", body))

    def on_bound(self, sender: PID | None, body: Any) -> None:
        self.log.append(("bound", sender, body))

    def on_typed(self, sender: PID | None, body: Note) -> None:
        self.log.append(("typed", body.n))

    def on_boom(self, sender: PID | None, body: Any) -> None:
        raise RuntimeError(f"handler bug for {body}")

    async def on_later(self, sender: PID | None, body: Any) -> None:
        self.log.append(("later", "start", body))
        await dispatch(self.pid, Receiver.record, ("inside later", body))
        self.log.append(("later", "end", body))

    def record(self, value: Any) -> Any:
        self.log.append(value)
        return value


class Mixer(Process):
    """Sends and dispatches to ``to`` in one given order."""

    def mix(self, to: PID, count: int) -> None:
        for i in range(count):
            if i % 3 == 0:
                self.send(to, "class", i)
            elif i % 3 == 1:
                dispatch(to, Receiver.record, ("dispatch", i))  # its Future dropped
            else:
                self.send(to, "typed", Note(i))


def spawned_with_mixer() -> tuple[Receiver, PID, PID]:
    """A spawned Receiver, its PID, and a spawned Mixer's PID to send to it."""
    receiver = Receiver()
    return receiver, spawn(receiver), spawn(Mixer())


async def test_one_senders_sends_and_dispatches_arrive_in_the_order_they_were_made() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            receiver, to, mixer = spawned_with_mixer()
            await dispatch(mixer, Mixer.mix, to, 60)
            await Clock.settle()
            expected = []
            for i in range(60):
                expected.append(("class", i) if i % 3 == 0 else ("dispatch", i) if i % 3 == 1 else ("typed", i))
            assert receiver.log == expected


async def test_tells_from_outside_interleaved_with_dispatches_keep_their_order() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            receiver = Receiver()
            pid = spawn(receiver)  # tells sent before initialize ran still find its handlers
            for i in range(5):
                send(pid, "lambda", i)
                dispatch(pid, Receiver.record, i)
                send(pid, "bound", i, from_=PID("peer(1)"))
            assert await dispatch(pid, Receiver.record, "sync") == "sync"
            expected: list[Any] = []
            for i in range(5):
                expected += [("lambda", i), i, ("bound", PID("peer(1)"), i)]
            assert receiver.log == expected + ["sync"]


async def test_every_kind_of_handler_gets_the_sender_and_the_body() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            other = Other()
            receiver = Receiver(other)
            pid = spawn(receiver)
            sender = PID("sender(7)")
            send(pid, "class", 1, from_=sender)
            send(pid, "bound", 2, from_=sender)
            send(pid, "other", 3, from_=sender)
            send(pid, "typed", b'{"n": 4}', from_=sender)
            await dispatch(pid, Receiver.record, "sync")
            assert receiver.log == [("class", 1), ("bound", sender, 2), ("typed", 4), "sync"]
            assert other.got == [("other", sender, 3)]


async def test_an_async_handler_runs_to_its_end_and_later_tells_run_while_it_waits() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            receiver = Receiver()
            pid = spawn(receiver)
            send(pid, "later", 1)
            send(pid, "class", 2)
            await Clock.settle()
            assert receiver.log[0] == ("later", "start", 1)
            assert receiver.log[-1] == ("later", "end", 1)
            assert ("class", 2) in receiver.log and ("inside later", 1) in receiver.log


async def test_a_raising_handler_without_a_body_type_is_logged_and_counted_and_the_receiver_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            receiver = Receiver()
            pid = spawn(receiver)
            with caplog.at_level(logging.ERROR, logger="runtime._process"):
                send(pid, "boom", "b1")
                send(pid, "class", "after")
                await dispatch(pid, Receiver.record, "sync")
            assert "handler of message 'boom' from None raised" in caplog.text
            assert "handler bug for b1" in caplog.text
            assert receiver.log == [("class", "after"), "sync"]
            stats = snapshot()[str(pid)]
            assert stats["failures"] == 1
            assert stats["state"] == "running"


@asynccontextmanager
async def running_receiver(first: str) -> AsyncIterator[tuple[Runtime, Receiver, PID]]:
    """In a Runtime, within BOUND: a spawned Receiver that has recorded
    ``first`` (its initialize is done)."""
    with anyio.fail_after(BOUND):
        async with Runtime() as rt:
            receiver = Receiver()
            pid = spawn(receiver)
            await dispatch(pid, Receiver.record, first)
            yield rt, receiver, pid


async def test_every_delivered_tell_counts_as_an_event_handled() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            pid = spawn(Receiver())
            await dispatch(pid, Receiver.record, "ready")
            before = snapshot()[str(pid)]["events_handled"]
            for i in range(50):
                send(pid, "class", i)
            for i in range(20):
                dispatch(pid, Receiver.record, i)
            await dispatch(pid, Receiver.record, "sync")
            assert snapshot()[str(pid)]["events_handled"] == before + 50 + 20 + 1


async def test_a_tell_to_a_terminated_process_is_dropped_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_receiver("alive") as (rt, receiver, pid):
        assert "runtime/messages/dropped" not in rt.metrics.snapshot()  # nothing dropped yet
        terminate(pid)
        await wait(pid)
        with caplog.at_level(logging.WARNING, logger="runtime._runtime"):
            send(pid, "class", "too late")
            send(PID("ghost(1)"), "class", "nobody")
        assert f"Message 'class' to {pid} dropped: process is not running" in caplog.text
        assert "Message 'class' to ghost(1) dropped: process is not running" in caplog.text
        assert rt.metrics.snapshot()["runtime/messages/dropped"] == 2
        assert receiver.log == ["alive"]


async def test_tells_still_queued_when_their_process_terminates_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_receiver("alive") as (rt, receiver, pid):
        for i in range(3):
            send(pid, "class", i)
        queued = dispatch(pid, Receiver.record, "queued")
        with caplog.at_level(logging.WARNING, logger="runtime._process"):
            terminate(pid, inject=True)  # before the queued events
            await wait(pid)
        assert receiver.log == ["alive"]
        assert queued.is_failed()  # a dispatch's Future fails; a tell has none: it is counted
        assert rt.metrics.snapshot()["runtime/messages/dropped"] == 3
        assert f"Process {pid} terminated: 3 queued message(s) dropped" in caplog.text


async def test_tells_queued_before_a_terminate_without_inject_are_delivered() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime() as rt:
            receiver = Receiver()
            pid = spawn(receiver)
            for i in range(3):
                send(pid, "class", i)
            terminate(pid, inject=False)  # after the queued events
            send(pid, "class", "after terminate")  # not running any more: dropped
            await wait(pid)
            assert receiver.log == [("class", 0), ("class", 1), ("class", 2)]
            assert rt.metrics.snapshot()["runtime/messages/dropped"] == 1


async def test_filters_see_every_tell_and_the_rest_arrive_in_order() -> None:
    async with running_receiver("ready") as (_rt, receiver, pid):
        seen = expect_message(pid, "class")
        dropped = drop_message(pid, "bound")
        sender = PID("sender(2)")
        for i in range(4):
            send(pid, "class", i, from_=sender)
            send(pid, "bound", i, from_=sender)
        assert await seen == Messaged(pid, "class", 0, sender)  # the first one matched, once
        assert await dropped == Messaged(pid, "bound", 0, sender)
        await dispatch(pid, Receiver.record, "sync")
        assert receiver.log == ["ready", ("class", 0)] + [
            entry for i in range(1, 4) for entry in (("class", i), ("bound", sender, i))
        ] + ["sync"]


async def test_a_filter_sees_a_tell_a_process_sends() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime():
            receiver, to, mixer = spawned_with_mixer()
            seen = expect_message(to, "typed")
            await dispatch(mixer, Mixer.mix, to, 3)
            assert await seen == Messaged(to, "typed", Note(2), mixer)


async def test_dropped_counts_go_to_the_runtime_that_dropped_them() -> None:
    with anyio.fail_after(BOUND):
        async with Runtime() as first:
            send(PID("ghost(2)"), "class", 1)
            assert current_runtime() is first
        async with Runtime() as second:
            assert "runtime/messages/dropped" not in second.metrics.snapshot()
        assert first.metrics.snapshot()["runtime/messages/dropped"] == 1
