"""R-RT-3: spawn / terminate(inject) / wait, and unique explicit ids (both backends)."""

from __future__ import annotations

import re

import anyio
import pytest

from runtime import PID, Clock, Failure, Future, ProcessTerminated, Runtime, dispatch, spawn, terminate, wait

from tests.support.processes import LogProcess

pytestmark = pytest.mark.anyio


class Recorder(LogProcess):
    def stop_self(self, inject: bool) -> None:
        self.log.append("stop_self")
        terminate(self.pid, inject=inject)


async def three_queued() -> tuple[Recorder, PID, list[Future]]:
    """A spawned Recorder, initialized, with three records (0, 1, 2) dispatched to it."""
    proc = Recorder()
    pid = spawn(proc)
    await Clock.settle()
    return proc, pid, [dispatch(pid, Recorder.record, i) for i in range(3)]


async def test_terminate_with_inject_goes_before_queued_events_and_fails_them() -> None:
    async with Runtime():
        proc, pid, queued = await three_queued()
        terminate(pid, inject=True)
        await wait(pid)
        assert proc.log == ["finalize"]
        for future in queued:
            with pytest.raises(ProcessTerminated, match=re.escape(f"Process {pid} terminated before the event ran")):
                await future


async def test_terminate_without_inject_runs_queued_events_first() -> None:
    async with Runtime():
        proc, pid, queued = await three_queued()
        terminate(pid, inject=False)
        late = dispatch(pid, Recorder.record, "late")  # after terminate: refused
        await wait(pid)
        assert [await f for f in queued] == [0, 1, 2]
        assert proc.log == [0, 1, 2, "finalize"]
        with pytest.raises(ProcessTerminated, match="is not running"):
            await late


async def test_terminate_from_inside_a_method() -> None:
    async with Runtime():
        for inject, expected in ((True, ["stop_self", "finalize"]), (False, ["stop_self", "after", "finalize"])):
            proc = Recorder()
            pid = spawn(proc)
            stop = dispatch(pid, Recorder.stop_self, inject)
            after = dispatch(pid, Recorder.record, "after")
            await stop
            await wait(pid)
            assert proc.log == expected
            assert after.is_ready() is (not inject)


async def test_wait_is_ready_at_once_for_an_unknown_pid() -> None:
    async with Runtime():
        future = wait(PID("nobody(0)"))
        assert future.is_ready()
        assert await future is None


async def test_wait_completes_only_once_finalized() -> None:
    class SlowStop(Recorder):
        def __init__(self, gate: anyio.Event) -> None:
            super().__init__()
            self.gate = gate

        async def finalize(self) -> None:  # type: ignore[override]
            await self.gate.wait()
            self.log.append("finalize")

    gate = anyio.Event()
    async with Runtime():
        try:
            proc = SlowStop(gate)
            pid = spawn(proc)
            terminate(pid)
            await Clock.settle()
            waiter = wait(pid)
            assert waiter.is_pending()
            assert dispatch(pid, Recorder.record, 1).is_failed()  # terminated, though not finalized
            gate.set()
            await waiter
            assert proc.log == ["finalize"]
        finally:
            gate.set()


async def test_terminating_an_unknown_pid_is_a_no_op() -> None:
    async with Runtime():
        bystander = Recorder()
        other = spawn(bystander)
        terminate(PID("nobody(0)"))
        terminate(PID("nobody(0)"), inject=False)
        # No other process was touched: the bystander still serves events.
        assert await dispatch(other, Recorder.record, "still here") == "still here"
        proc = Recorder()
        pid = spawn(proc)
        terminate(pid)
        await wait(pid)
        assert proc.log == ["finalize"]
        terminate(pid)  # already gone: finalize does not run again
        terminate(pid, inject=False)
        await Clock.settle()
        assert proc.log == ["finalize"]
        assert wait(pid).is_ready()
        assert bystander.log == ["still here"]


async def test_a_second_live_process_with_the_same_explicit_id_is_an_error() -> None:
    async with Runtime():
        first = spawn(Recorder(id="allocator"))
        assert first == PID("allocator")
        with pytest.raises(Failure, match=r"A process with id allocator is already running"):
            spawn(Recorder(id="allocator"))
        terminate(first)
        await wait(first)
        again = spawn(Recorder(id="allocator"))  # the id is free once finalized
        assert await dispatch(again, Recorder.record, "ok") == "ok"


async def test_spawning_the_same_process_object_twice_is_an_error() -> None:
    async with Runtime():
        proc = Recorder()
        spawn(proc)
        with pytest.raises(Failure, match="was already spawned"):
            spawn(proc)


async def test_spawn_needs_a_runtime() -> None:
    with pytest.raises(RuntimeError, match="No runtime is running"):
        spawn(Recorder())
