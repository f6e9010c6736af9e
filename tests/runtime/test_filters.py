"""R-RT-11: runtime.testing filters -- expect/drop dispatch and message."""

from __future__ import annotations

from typing import Any

import pytest

from runtime import PID, Clock, Failure, Process, Runtime, dispatch, send, spawn
from runtime.testing import Dispatched, Messaged, drop_dispatch, drop_message, expect_dispatch, expect_message

pytestmark = pytest.mark.asyncio


class Target(Process):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[Any] = []

    def initialize(self) -> None:
        self.install("note", lambda sender, body: self.log.append(("note", body)))

    def record(self, value: Any, *, tag: str = "") -> Any:
        self.log.append(value)
        return value

    def other(self) -> str:
        return "other"


async def test_expect_dispatch_is_ready_with_the_arguments_and_the_dispatch_goes_on() -> None:
    async with Runtime():
        proc = Target()
        pid = spawn(proc)
        seen = expect_dispatch(pid, Target.record)
        assert seen.is_pending()
        dispatch(pid, Target.other)
        assert seen.is_pending()
        result = dispatch(pid, Target.record, 7, tag="t")
        assert seen.is_ready()
        assert await seen == Dispatched(pid, "record", (7,), {"tag": "t"})
        assert await result == 7
        assert proc.log == [7]


async def test_drop_dispatch_fails_the_dispatch_as_dropped_and_the_method_never_runs() -> None:
    async with Runtime():
        proc = Target()
        pid = spawn(proc)
        dropped = drop_dispatch(pid, Target.record)
        future = dispatch(pid, Target.record, 1)
        assert (await dropped).args == (1,)
        with pytest.raises(Failure, match=r"Dispatch of record to .* was dropped by a test filter"):
            await future
        await Clock.settle()
        assert proc.log == []


async def test_a_filter_matches_once() -> None:
    async with Runtime():
        proc = Target()
        pid = spawn(proc)
        drop_dispatch(pid, Target.record)
        first = dispatch(pid, Target.record, "first")
        second = dispatch(pid, Target.record, "second")
        assert first.is_failed()
        assert await second == "second"
        assert proc.log == ["second"]


async def test_the_newest_matching_filter_wins() -> None:
    async with Runtime():
        proc = Target()
        pid = spawn(proc)
        older = expect_dispatch(pid, Target.record)
        newer = drop_dispatch(pid, Target.record)
        first = dispatch(pid, Target.record, 1)
        assert newer.is_ready() and older.is_pending()
        assert first.is_failed()
        second = dispatch(pid, Target.record, 2)
        assert (await older).args == (2,)
        assert await second == 2


async def test_filters_match_any_process_and_method_names() -> None:
    async with Runtime():
        a, b = spawn(Target()), spawn(Target())
        any_pid = expect_dispatch(None, "record")
        other_pid = expect_dispatch(a, Target.record)
        dispatch(b, Target.record, "to b")
        assert any_pid.is_ready() and (await any_pid).pid == b
        assert other_pid.is_pending()
        dispatch(a, Target.record, "to a")
        assert (await other_pid).pid == a


async def test_expect_message_sees_the_message_and_it_is_delivered() -> None:
    async with Runtime():
        proc = Target()
        pid = spawn(proc)
        sender = PID("sender(1)")
        seen = expect_message(pid, "note")
        send(pid, "note", "hello", from_=sender)
        assert await seen == Messaged(pid, "note", "hello", sender)
        await Clock.settle()
        assert proc.log == [("note", "hello")]


async def test_drop_message_drops_it_once() -> None:
    async with Runtime():
        proc = Target()
        pid = spawn(proc)
        await Clock.settle()
        dropped = drop_message(None, "note")
        send(pid, "note", "dropped")
        send(pid, "note", "delivered")
        assert (await dropped).body == "dropped"
        await Clock.settle()
        assert proc.log == [("note", "delivered")]


async def test_filters_need_a_runtime() -> None:
    with pytest.raises(RuntimeError, match="No runtime is running"):
        expect_dispatch(None, "x")
