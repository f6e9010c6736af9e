"""R-RT-12 Runtime scope and R-RT-13 introspection."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from runtime import Clock, Process, ProcessTerminated, Runtime, current_runtime, dispatch, snapshot, spawn
from runtime import terminate, wait

pytestmark = pytest.mark.asyncio


class Service(Process):
    def __init__(self) -> None:
        super().__init__()
        self.finalized = 0

    def finalize(self) -> None:
        self.finalized += 1

    def echo(self, value: Any) -> Any:
        return value

    def fail(self) -> None:
        raise ValueError("bad request")

    async def wait_for(self, event: asyncio.Event) -> str:
        await event.wait()
        return "released"


class SlowStop(Service):
    async def finalize(self) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.finalized += 1


async def test_the_runtime_embeds_in_a_running_loop_beside_other_tasks() -> None:
    outside = asyncio.Event()
    ticks: list[int] = []

    async def host_task() -> None:  # the embedding program's own work
        for i in range(3):
            ticks.append(i)
            await asyncio.sleep(0)
        outside.set()

    async with Runtime() as rt:
        assert current_runtime() is rt
        host = asyncio.get_running_loop().create_task(host_task())
        pid = spawn(Service())
        assert await dispatch(pid, Service.wait_for, outside) == "released"
        await host
    assert ticks == [0, 1, 2]


async def test_the_current_runtime_is_only_set_inside_the_scope() -> None:
    with pytest.raises(RuntimeError, match=r"No runtime is running: wrap the code in `async with runtime.Runtime\(\):`"):
        current_runtime()
    async with Runtime() as outer:
        async with Runtime() as inner:
            assert current_runtime() is inner
        assert current_runtime() is outer


async def test_leaving_the_scope_terminates_and_awaits_every_process() -> None:
    event = asyncio.Event()
    async with Runtime():
        services = [Service() for _ in range(3)] + [SlowStop()]
        pids = [spawn(s) for s in services]
        await Clock.settle()
        suspended = dispatch(pids[0], Service.wait_for, event)
        await Clock.settle()
        queued = [dispatch(pid, Service.echo, i) for i, pid in enumerate(pids)]
    assert [s.finalized for s in services] == [1, 1, 1, 1]  # async finalize included
    for future in [suspended, *queued]:
        assert isinstance(future.failure(), ProcessTerminated)
    assert all(wait(pid).is_ready() for pid in pids)  # no runtime: ready at once
    with pytest.raises(ProcessTerminated, match="No runtime is running"):
        await dispatch(pids[0], Service.echo, 1)


async def test_an_exception_leaving_the_scope_propagates_after_cleanup() -> None:
    service = Service()
    with pytest.raises(KeyError, match="boom"):
        async with Runtime():
            spawn(service)
            raise KeyError("boom")
    assert service.finalized == 1


async def test_processes_spawned_by_finalize_are_cleaned_up_too() -> None:
    later = Service()

    class Spawner(Service):
        def finalize(self) -> None:
            super().finalize()
            spawn(later)

    async with Runtime():
        spawn(Spawner())
    assert later.finalized == 1


async def test_snapshot_reports_queue_depth_events_handled_and_failures() -> None:
    async with Runtime() as rt:
        pid = spawn(Service())
        await Clock.settle()
        assert snapshot()[str(pid)]["events_handled"] == 1  # initialize
        for i in range(3):
            dispatch(pid, Service.echo, i)
        assert snapshot()[str(pid)]["queue_depth"] == 3
        failed = dispatch(pid, Service.fail)
        await Clock.settle()
        assert failed.is_failed()
        stats = snapshot()
        assert stats == rt.snapshot()
        assert stats[str(pid)] == {
            "state": "running",
            "queue_depth": 0,
            "events_handled": 5,
            "failures": 1,
            "messages_rejected": 0,
            "suspended": 0,
        }
        json.dumps(stats)  # a plain dict
        other = spawn(Service())
        assert set(snapshot()) == {str(pid), str(other)}
        terminate(other)
        await wait(other)
        assert set(snapshot()) == {str(pid)}
