"""R-RT-4: dispatch -- ordering, sync/async methods, first-await atomicity,
suspended methods not holding the mailbox, Futures returned by methods,
failures, and every Future completing (both backends)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from runtime import PID, Clock, Discarded, Future, Process, ProcessTerminated, Promise, Runtime, dispatch
from runtime import snapshot, spawn, terminate, wait

pytestmark = pytest.mark.anyio


class Worker(Process):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[Any] = []
        self.cancelled: list[str] = []

    def record(self, value: Any) -> Any:
        self.log.append(value)
        return value

    def add(self, a: int, b: int = 0, *, scale: int = 1) -> int:
        return (a + b) * scale

    def fail(self, message: str) -> None:
        raise ValueError(message)

    async def async_add(self, a: int, b: int) -> int:
        await anyio.sleep(0)
        return a + b

    async def async_fail(self, message: str) -> None:
        await anyio.sleep(0)
        raise KeyError(message)

    async def steps(self, name: str, gate: anyio.Event) -> str:
        # everything up to the first await runs as one piece
        self.log.append(f"{name}:1")
        self.log.append(f"{name}:2")
        try:
            await gate.wait()
        except BaseException:
            self.cancelled.append(name)
            raise
        self.log.append(f"{name}:3")
        return name

    def returns_future(self, future: Future) -> Future:
        return future


async def test_events_start_in_the_order_they_were_queued() -> None:
    async with Runtime():
        proc = Worker()
        pid = spawn(proc)
        futures = [dispatch(pid, Worker.record, i) for i in range(200)]
        assert [await f for f in futures] == list(range(200))
        assert proc.log == list(range(200))


async def test_sync_and_async_methods_with_args_and_kwargs() -> None:
    async with Runtime():
        pid = spawn(Worker())
        assert await dispatch(pid, Worker.add, 2) == 2
        assert await dispatch(pid, Worker.add, 2, 3) == 5
        assert await dispatch(pid, Worker.add, 2, b=3, scale=10) == 50
        assert await dispatch(pid, Worker.async_add, 4, 5) == 9


async def test_code_up_to_the_first_await_never_interleaves() -> None:
    gates = [anyio.Event(), anyio.Event()]
    async with Runtime():
        try:
            proc = Worker()
            pid = spawn(proc)
            a = dispatch(pid, Worker.steps, "a", gates[0])
            x = dispatch(pid, Worker.record, "x")
            b = dispatch(pid, Worker.steps, "b", gates[1])
            y = dispatch(pid, Worker.record, "y")
            await x
            await y
            assert proc.log == ["a:1", "a:2", "x", "b:1", "b:2", "y"]
        finally:
            for gate in gates:
                gate.set()
        assert (await a, await b) == ("a", "b")


async def test_awaiting_does_not_hold_the_mailbox() -> None:
    first, second = anyio.Event(), anyio.Event()
    async with Runtime():
        try:
            proc = Worker()
            pid = spawn(proc)
            a = dispatch(pid, Worker.steps, "a", first)
            b = dispatch(pid, Worker.steps, "b", second)
            await Clock.settle()  # both suspended: the process counts as idle
            assert proc.log == ["a:1", "a:2", "b:1", "b:2"]
            assert await dispatch(pid, Worker.record, "while-waiting") == "while-waiting"
            second.set()  # the later one finishes first: neither blocks the other
            assert await b == "b"
            assert a.is_pending()
            first.set()
            assert await a == "a"
            assert proc.log == ["a:1", "a:2", "b:1", "b:2", "while-waiting", "b:3", "a:3"]
        finally:
            first.set()
            second.set()


async def test_a_method_returning_a_future_completes_the_dispatch_with_it() -> None:
    async with Runtime():
        pid = spawn(Worker())
        promise: Promise[str] = Promise()
        future = dispatch(pid, Worker.returns_future, promise.future)
        await Clock.settle()
        assert future.is_pending()
        promise.set_value("later")
        assert await future == "later"

        failed: Promise[str] = Promise()
        future = dispatch(pid, Worker.returns_future, failed.future)
        failed.fail(OSError("device busy"))
        with pytest.raises(OSError, match="device busy"):
            await future

        assert await dispatch(pid, Worker.returns_future, Future.ready(7)) == 7


async def test_discarding_a_dispatch_that_follows_a_future_reaches_its_producer() -> None:
    async with Runtime():
        pid = spawn(Worker())
        promise: Promise[str] = Promise()
        asked: list[str] = []
        promise.on_discard(lambda: asked.append("discard"))
        future = dispatch(pid, Worker.returns_future, promise.future)
        await Clock.settle()
        future.discard()
        assert asked == ["discard"]
        promise.discard()
        with pytest.raises(Discarded):
            await future


async def test_an_exception_fails_only_its_future_and_the_process_keeps_serving() -> None:
    async with Runtime():
        proc = Worker()
        pid = spawn(proc)
        before = dispatch(pid, Worker.record, "before")
        bad = dispatch(pid, Worker.fail, "bad input 42")
        bad_async = dispatch(pid, Worker.async_fail, "no such container")
        after = dispatch(pid, Worker.record, "after")
        assert await before == "before"
        with pytest.raises(ValueError, match="bad input 42"):
            await bad
        with pytest.raises(KeyError, match="no such container"):
            await bad_async
        assert await after == "after"
        assert await dispatch(pid, Worker.add, 1, 1) == 2
        stats = snapshot()[str(pid)]
        assert stats["failures"] == 2
        assert stats["state"] == "running"


async def test_the_failure_is_the_original_exception_object() -> None:
    class Boom(Exception):
        pass

    boom = Boom("x")

    class Thrower(Process):
        def throw(self) -> None:
            raise boom

    async with Runtime():
        future = dispatch(spawn(Thrower()), Thrower.throw)
        with pytest.raises(Boom) as info:
            await future
        assert info.value is boom
        assert future.failure() is boom


async def test_dispatch_to_an_unknown_or_terminated_process_fails() -> None:
    async with Runtime():
        ghost = PID("ghost(1)")
        future = dispatch(ghost, Worker.record, 1)
        assert future.is_failed()
        with pytest.raises(ProcessTerminated, match=r"Process ghost\(1\) is not running; cannot dispatch Worker.record"):
            await future
        pid = spawn(Worker())
        terminate(pid)
        await wait(pid)
        with pytest.raises(ProcessTerminated, match="is not running"):
            await dispatch(pid, Worker.record, 1)


async def test_dispatch_without_a_runtime_fails() -> None:
    with pytest.raises(ProcessTerminated, match="No runtime is running"):
        await dispatch(PID("x"), Worker.record, 1)


async def test_suspended_async_methods_are_cancelled_at_terminate() -> None:
    gate = anyio.Event()
    async with Runtime():
        proc = Worker()
        pid = spawn(proc)
        suspended = dispatch(pid, Worker.steps, "s", gate)
        queued_behind = dispatch(pid, Worker.record, "never")
        await Clock.settle()
        assert proc.log == ["s:1", "s:2", "never"]  # suspended: later events ran
        terminate(pid)
        await wait(pid)
        with pytest.raises(ProcessTerminated, match="terminated while the event was waiting"):
            await suspended
        assert await queued_behind == "never"
        await Clock.settle()
        assert proc.cancelled == ["s"]  # the coroutine saw the cancellation
        gate.set()
        await Clock.settle()
        assert "s:3" not in proc.log


async def test_every_future_completes_when_the_scope_exits() -> None:
    gate = anyio.Event()
    async with Runtime():
        pid = spawn(Worker())
        await Clock.settle()
        suspended = dispatch(pid, Worker.steps, "s", gate)
        await Clock.settle()
        queued = [dispatch(pid, Worker.record, i) for i in range(3)]
    for future in [suspended, *queued]:
        assert future.is_failed()
        assert isinstance(future.failure(), ProcessTerminated)


async def test_two_tasks_awaiting_one_future_both_get_the_value() -> None:
    gate = anyio.Event()
    results: list[str] = []
    async with Runtime():
        pid = spawn(Worker())
        future = dispatch(pid, Worker.steps, "shared", gate)

        async def consumer() -> None:
            results.append(await future)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            tg.start_soon(consumer)
            await Clock.settle()
            gate.set()
    assert results == ["shared", "shared"]


async def test_cancelling_the_awaiting_task_does_not_discard_the_future() -> None:
    gate = anyio.Event()
    async with Runtime():
        pid = spawn(Worker())
        future = dispatch(pid, Worker.steps, "s", gate)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await future
        assert scope.cancelled_caught
        assert future.is_pending() and not future.has_discard()
        gate.set()
        assert await future == "s"


async def test_an_async_method_that_is_cancelled_from_inside_still_completes_its_future(
    anyio_backend: str,
) -> None:
    class Canceller(Process):
        async def awaits_cancelled(self) -> None:
            if anyio_backend == "asyncio":
                doomed = asyncio.get_running_loop().create_future()
                doomed.cancel()
                await doomed
            else:
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await anyio.sleep(0)
                raise LookupError("cancelled by its own scope")

        def ping(self) -> str:
            return "pong"

    async with Runtime():
        pid = spawn(Canceller())
        future = dispatch(pid, Canceller.awaits_cancelled)
        with pytest.raises(Exception, match="was cancelled|cancelled by its own scope"):
            await future
        assert await dispatch(pid, Canceller.ping) == "pong"
