"""R-RT-10: Executor -- results, exceptions, bounded concurrency, caller
cancellation (both backends). Threads are synchronised with threading
Events, never with sleeps."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import anyio
import pytest

from runtime import Clock, Executor, Process, Runtime, dispatch, spawn

pytestmark = pytest.mark.anyio

GUARD = 10  # seconds: a hang guard for waits on threads, never asserted on


async def _wait_in_thread(event: threading.Event) -> None:
    """Wait for a threading.Event without blocking the event loop."""
    assert await anyio.to_thread.run_sync(event.wait, GUARD), "helper thread never got there"


@contextmanager
def executor_and_release(max_workers: int) -> Iterator[tuple[Executor, threading.Event]]:
    """An Executor and the event its blocking jobs wait on; on the way out,
    whatever happened, the event is set (no job stays blocked) and the
    executor shut down."""
    executor = Executor(max_workers=max_workers)
    release = threading.Event()
    try:
        yield executor, release
    finally:
        release.set()
        executor.shutdown()


async def test_run_returns_the_result_of_a_blocking_call() -> None:
    executor = Executor(max_workers=2)
    try:
        assert await executor.run(sum, [1, 2, 3]) == 6
        assert await executor.run(int, "ff", base=16) == 255
        assert await executor.run(threading.get_ident) != threading.get_ident()
    finally:
        executor.shutdown()


async def test_an_exception_is_carried_back_unchanged() -> None:
    executor = Executor(max_workers=1)
    error = PermissionError(13, "Permission denied", "/sys/fs/cgroup/devices/x/devices.allow")

    def write() -> None:
        raise error

    try:
        with pytest.raises(PermissionError) as info:
            await executor.run(write)
        assert info.value is error
    finally:
        executor.shutdown()


async def test_at_most_max_workers_calls_run_at_once() -> None:
    with executor_and_release(2) as (executor, release):
        lock = threading.Lock()
        running = [0]
        peak = [0]
        two_running = threading.Event()

        def job(i: int) -> int:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                if running[0] == 2:
                    two_running.set()
            release.wait(GUARD)
            with lock:
                running[0] -= 1
            return i

        results: list[int] = []

        async def call(i: int) -> None:
            results.append(await executor.run(job, i))

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(call, i)
            await _wait_in_thread(two_running)
            assert peak[0] == 2
            release.set()
        assert sorted(results) == [0, 1, 2, 3, 4]
        assert peak[0] == 2


async def test_the_callers_cancellation_is_honoured_at_once() -> None:
    with executor_and_release(1) as (executor, release):
        started = threading.Event()
        finished = threading.Event()

        def blocking() -> str:
            started.set()
            release.wait(GUARD)
            finished.set()
            return "dropped"

        async with anyio.create_task_group() as tg:

            async def caller(scope: anyio.CancelScope) -> None:
                with scope:
                    await executor.run(blocking)
                    pytest.fail("the cancelled caller must not get the result")

            scope = anyio.CancelScope()
            tg.start_soon(caller, scope)
            await _wait_in_thread(started)
            scope.cancel()
        # the caller is gone while the call still runs in its thread
        assert scope.cancelled_caught
        assert not finished.is_set()


async def test_a_cancelled_call_that_had_not_started_never_runs() -> None:
    with executor_and_release(1) as (executor, release):
        started = threading.Event()
        ran: list[str] = []

        def first() -> None:
            started.set()
            release.wait(GUARD)

        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.run, first)
            await _wait_in_thread(started)
            scope = anyio.CancelScope()

            async def cancel() -> None:  # runs while the call waits for the worker
                scope.cancel()

            with scope:
                tg.start_soon(cancel)
                await executor.run(ran.append, "queued")
            release.set()
        assert scope.cancelled_caught
        await executor.run(ran.append, "after")  # one worker, in order: "queued" would come first
        assert ran == ["after"]


async def test_max_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_workers >= 1, got 0"):
        Executor(max_workers=0)


async def test_an_async_method_awaits_the_executor_without_holding_its_process() -> None:
    release = threading.Event()
    started = threading.Event()

    def blocking_read(path: str) -> str:
        started.set()
        release.wait(GUARD)
        return f"read {path}"

    class Reader(Process):
        def __init__(self) -> None:
            super().__init__()
            self.executor = Executor(max_workers=1)

        async def read(self, path: str) -> str:
            return await self.executor.run(blocking_read, path)

        def ping(self) -> str:
            return "pong"

        def finalize(self) -> None:
            self.executor.shutdown(wait=False)

    try:
        async with Runtime():
            pid = spawn(Reader())
            read: Callable[..., Any] = Reader.read
            pending = dispatch(pid, read, "/proc/driver/nvidia/version")
            await _wait_in_thread(started)
            assert await dispatch(pid, Reader.ping) == "pong"
            release.set()
            assert await pending == "read /proc/driver/nvidia/version"
            await Clock.settle()
    finally:
        release.set()


async def test_settle_waits_for_jobs_but_not_for_a_background_executors() -> None:
    release = threading.Event()
    started = threading.Event()

    def blocked() -> str:
        started.set()
        release.wait(10)
        return "released"

    background = Executor(max_workers=1, name="events", background=True)
    plain = Executor(max_workers=1, name="plain")
    try:
        async with Runtime():
            async with anyio.create_task_group() as group:
                results: list[str] = []

                async def run(executor: Executor) -> None:
                    results.append(await executor.run(blocked))

                group.start_soon(run, background)
                await _wait_in_thread(started)
                with anyio.fail_after(10):  # a hang guard: settle must not wait for it
                    await Clock.settle()
                assert results == []  # still blocked in its thread
                started.clear()
                release.set()
                await anyio.sleep(0)
            assert results == ["released"]
            release.clear()
            async with anyio.create_task_group() as group:
                group.start_soon(run, plain)
                await _wait_in_thread(started)
                settled = anyio.Event()

                async def settle() -> None:
                    await Clock.settle()
                    settled.set()

                group.start_soon(settle)
                await anyio.sleep(0.05)
                assert not settled.is_set()  # a plain job keeps settle waiting...
                release.set()
                with anyio.fail_after(10):
                    await settled.wait()  # ...until it ends
            assert results == ["released", "released"]
    finally:
        release.set()
        background.shutdown(wait=False)
        plain.shutdown(wait=False)
