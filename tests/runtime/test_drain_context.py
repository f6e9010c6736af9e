"""The runtime's rule on asyncio's own loops: a process's events run in a
context of its own, copied from the spawner's when it was spawned (its
drain is one Handle made at spawn), so a context variable set by whoever
dispatches later, or by another process, does not leak into it; in debug
mode the loop's own call_soon (and its checks) schedules the drain."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from runtime import Process, Runtime, dispatch, spawn

pytestmark = pytest.mark.asyncio

tag: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="none")


class Reader(Process):
    def read(self) -> str:
        return tag.get()

    def write(self, value: str) -> None:
        tag.set(value)


async def test_events_run_in_the_context_copied_at_spawn() -> None:
    async with asyncio.timeout(10):
        async with Runtime():
            tag.set("spawner")
            first = spawn(Reader())
            tag.set("caller")  # after the spawn: not the process's
            assert await dispatch(first, Reader.read) == "spawner"
            second = spawn(Reader())
            await dispatch(first, Reader.write, "first's own")
            assert await dispatch(first, Reader.read) == "first's own"
            assert await dispatch(second, Reader.read) == "caller"  # copied when it was spawned
            assert tag.get() == "caller"  # nothing leaks back into the caller either


async def test_in_debug_mode_the_loops_call_soon_schedules_and_events_still_run() -> None:
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    try:
        async with asyncio.timeout(10):
            async with Runtime() as rt:
                assert rt._run_queue is None  # call_soon, with its thread checks
                pid = spawn(Reader())
                assert await dispatch(pid, Reader.read) == "none"
    finally:
        loop.set_debug(False)
