"""R-RT-5 under asyncio: a task awaiting a pending runtime Future waits on
the run queue's ``TaskWait`` and is resumed from the run queue when the
Future completes -- no loop callback of its own -- and a cancelled task is
never left waiting, while the Future stays pending for everyone else."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from runtime import Discarded, Future, Process, Promise, Runtime, dispatch, spawn
from runtime._run_queue import TaskWait

pytestmark = pytest.mark.asyncio

BOUND = 10.0  # seconds a step may take: a task never resumed fails the test instead of hanging


async def within(task: asyncio.Task) -> asyncio.Task:
    """``task`` once it ended, or the test fails after BOUND seconds (by
    asyncio.wait's timer, not by cancelling: cancellation is what is tested)."""
    done, _ = await asyncio.wait({task}, timeout=BOUND)
    assert task in done, f"{task!r} still not resumed after {BOUND} s"
    return task


class Echo(Process):
    def echo(self, value: Any) -> Any:
        return value

    def fail(self, message: str) -> None:
        raise KeyError(message)


async def waiting(task: asyncio.Task) -> Any:
    """What ``task`` waits on, once it waits (within BOUND seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while task._fut_waiter is None:
        assert loop.time() < deadline, f"{task!r} never waited"
        await asyncio.sleep(0)
    return task._fut_waiter


async def waiting_on(task: asyncio.Task, future: Future) -> None:
    """Until ``task`` waits on ``future``'s TaskWait."""
    wait = await waiting(task)
    assert isinstance(wait, TaskWait) and wait._future is future


async def test_a_round_trip_resumes_the_caller_with_no_loop_callback_for_it() -> None:
    async with Runtime():
        pid = spawn(Echo())
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        scheduled: list[Any] = []
        call_soon = loop.call_soon

        def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
            scheduled.append(callback)
            return call_soon(callback, *args, **kwargs)

        loop.call_soon = counting  # what a task calls to be stepped again
        try:
            for i in range(200):
                assert await dispatch(pid, Echo.echo, i) == i
        finally:
            del loop.call_soon
        assert [cb for cb in scheduled if getattr(cb, "__self__", None) is me] == []


async def test_the_awaiter_gets_the_original_exception_or_discarded() -> None:
    async with Runtime():
        pid = spawn(Echo())
        with pytest.raises(KeyError, match="no such GPU"):
            await dispatch(pid, Echo.fail, "no such GPU")
        promise: Promise[int] = Promise()
        error = OSError("nvml unavailable")

        asyncio.get_running_loop().call_soon(promise.fail, error)
        with pytest.raises(OSError) as info:
            await (await within(asyncio.create_task(_await(promise.future))))
        assert info.value is error
        discarded: Promise[int] = Promise()
        asyncio.get_running_loop().call_soon(discarded.discard)
        with pytest.raises(Discarded):
            await discarded.future


async def test_a_cancelled_waiter_is_resumed_and_the_future_stays_pending_for_the_others() -> None:
    async with Runtime():
        promise: Promise[str] = Promise()
        future = promise.future
        outcomes: dict[str, Any] = {}

        async def await_it(name: str) -> None:
            try:
                outcomes[name] = await future
            except asyncio.CancelledError:
                outcomes[name] = "cancelled"
                raise

        first = asyncio.create_task(await_it("first"))
        await waiting_on(first, future)
        second = asyncio.create_task(await_it("second"))  # a second awaiter waits its own way
        assert not isinstance(await waiting(second), TaskWait)
        assert first.cancel() is True
        assert (await within(first)).cancelled()
        assert outcomes == {"first": "cancelled"}
        assert future.is_pending() and not future.has_discard()

        third = asyncio.create_task(await_it("third"))
        await waiting(third)
        promise.set_value("granted")
        await within(second)
        await within(third)
        assert outcomes == {"first": "cancelled", "second": "granted", "third": "granted"}


async def test_a_task_cancelled_once_its_wake_up_is_queued_is_cancelled_at_that_wake_up() -> None:
    async with Runtime():
        promise: Promise[int] = Promise()
        task = asyncio.create_task(_await(promise.future))
        await waiting_on(task, promise.future)
        promise.set_value(7)  # the wake-up is queued ...
        assert task.cancel() is True  # ... and the cancellation wins, as on a done loop future
        assert (await within(task)).cancelled()
        assert promise.future.get() == 7


async def test_a_deadline_cancels_a_waiting_dispatch_without_discarding_it() -> None:
    gate = anyio.Event()

    class Gated(Process):
        async def wait_gate(self) -> str:
            await gate.wait()
            return "opened"

    async def deadline(future: Future) -> bool:
        with anyio.move_on_after(0.01) as scope:
            await future
        return scope.cancelled_caught

    async with Runtime():
        pid = spawn(Gated())
        future = dispatch(pid, Gated.wait_gate)
        assert (await within(asyncio.create_task(deadline(future)))).result() is True
        assert future.is_pending() and not future.has_discard()
        gate.set()
        assert (await within(asyncio.create_task(_await(future)))).result() == "opened"


async def _await(future: Future) -> Any:
    return await future
