"""R-RT-2 and R-RT-8: initialize / finalize / exited, link (both backends)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from runtime import PID, Clock, ProcessTerminated, Runtime, dispatch, spawn, terminate, wait

from tests.support.processes import LogProcess

pytestmark = pytest.mark.anyio


class Recorder(LogProcess):
    """Logs its hooks and events."""

    def initialize(self) -> None:
        self.log.append("initialize")

    def exited(self, pid: PID) -> None:
        self.log.append(("exited", pid))

    def link_to(self, pid: PID) -> None:
        self.link(pid)


class Gated(Recorder):
    """A Recorder with a hook that holds until ``gate`` is set."""

    def __init__(self, gate: anyio.Event) -> None:
        super().__init__()
        self.gate = gate

    async def held(self, hook: str) -> None:
        self.log.append(f"{hook}:start")
        await self.gate.wait()
        self.log.append(f"{hook}:end")


class SlowStart(Gated):
    """An async initialize that holds the mailbox until ``gate`` is set."""

    async def initialize(self) -> None:  # type: ignore[override]
        await self.held("initialize")


class SlowStop(Gated):
    """An async finalize that ends only when ``gate`` is set."""

    async def finalize(self) -> None:  # type: ignore[override]
        await self.held("finalize")


class Linker(Recorder):
    """Links to ``target`` in initialize."""

    def __init__(self, target: PID) -> None:
        super().__init__()
        self.target = target

    def initialize(self) -> None:
        super().initialize()
        self.link(self.target)


@asynccontextmanager
async def runtime_with_gate() -> AsyncIterator[anyio.Event]:
    """A Runtime and a gate for a Gated process, set before the Runtime's exit
    waits for the hook it holds, whatever the test did."""
    gate = anyio.Event()
    async with Runtime():
        try:
            yield gate
        finally:
            gate.set()


async def test_pid_is_set_and_returned_by_spawn() -> None:
    async with Runtime():
        proc = Recorder()
        assert spawn(proc) == proc.pid


async def test_initialize_runs_before_events_queued_right_after_spawn() -> None:
    async with Runtime():
        proc = Recorder()
        pid = spawn(proc)
        futures = [dispatch(pid, Recorder.record, i) for i in range(3)]
        assert proc.log == []  # nothing ran yet: spawn and dispatch only queue
        assert [await f for f in futures] == [0, 1, 2]
        assert proc.log == ["initialize", 0, 1, 2]


async def test_async_initialize_holds_the_mailbox_until_it_returns() -> None:
    async with runtime_with_gate() as gate:
        proc = SlowStart(gate)
        pid = spawn(proc)
        future = dispatch(pid, Recorder.record, "event")
        await Clock.settle()  # a suspended initialize counts as idle
        assert proc.log == ["initialize:start"]
        assert future.is_pending()
        assert proc.stats()["queue_depth"] == 1
        gate.set()
        assert await future == "event"
        assert proc.log == ["initialize:start", "initialize:end", "event"]


async def test_failing_initialize_terminates_the_process_and_fails_queued_events() -> None:
    class Broken(Recorder):
        def initialize(self) -> None:
            raise RuntimeError("no GPU inventory")

    async with Runtime():
        proc = Broken()
        pid = spawn(proc)
        future = dispatch(pid, Recorder.record, 1)
        await wait(pid)
        with pytest.raises(ProcessTerminated, match="terminated before the event ran"):
            await future
        assert proc.log == ["finalize"]


async def test_finalize_runs_once_however_often_terminated() -> None:
    async with Runtime():
        proc = Recorder()
        pid = spawn(proc)
        terminate(pid)
        terminate(pid)
        terminate(pid, inject=False)
        await wait(pid)
        terminate(pid)
    assert proc.log == ["initialize", "finalize"]


async def test_terminate_right_after_spawn_still_initializes_before_finalize() -> None:
    async with Runtime():
        proc = Recorder()
        pid = spawn(proc)
        terminate(pid, inject=True)
        await wait(pid)
    assert proc.log == ["initialize", "finalize"]


async def test_exited_is_dispatched_when_a_linked_process_terminates() -> None:
    async with Runtime():
        target = Recorder()
        target_pid = spawn(target)
        linker = Linker(target_pid)
        spawn(linker)
        await Clock.settle()
        assert linker.log == ["initialize"]
        terminate(target_pid)
        await wait(target_pid)
        await Clock.settle()
        assert linker.log == ["initialize", ("exited", target_pid)]


async def test_link_to_an_already_terminated_process_delivers_exited_at_once() -> None:
    async with Runtime():
        target_pid = spawn(Recorder())
        terminate(target_pid)
        await wait(target_pid)
        linker = Recorder()
        pid = spawn(linker)
        await dispatch(pid, Recorder.link_to, target_pid)
        await Clock.settle()
        assert linker.log == ["initialize", ("exited", target_pid)]


async def test_link_to_an_unknown_pid_delivers_exited() -> None:
    async with Runtime():
        linker = Recorder()
        pid = spawn(linker)
        ghost = PID("ghost(404)")
        await dispatch(pid, Recorder.link_to, ghost)
        await Clock.settle()
        assert linker.log == ["initialize", ("exited", ghost)]


async def test_every_linker_is_told_once() -> None:
    async with Runtime():
        target_pid = spawn(Recorder())
        linkers = [Linker(target_pid) for _ in range(3)]
        for linker in linkers:
            spawn(linker)
            await dispatch(linker.pid, Recorder.link_to, target_pid)  # linking twice is one link
        terminate(target_pid)
        await wait(target_pid)
        await Clock.settle()
        for linker in linkers:
            assert linker.log == ["initialize", ("exited", target_pid)]


async def test_exited_comes_after_an_async_finalize_has_finished() -> None:
    async with runtime_with_gate() as gate:
        target = SlowStop(gate)
        target_pid = spawn(target)
        linker = Linker(target_pid)
        spawn(linker)
        await Clock.settle()
        terminate(target_pid)
        await Clock.settle()
        assert target.log == ["initialize", "finalize:start"]
        assert linker.log == ["initialize"]
        assert wait(target_pid).is_pending()
        gate.set()
        await wait(target_pid)
        await Clock.settle()
        assert target.log == ["initialize", "finalize:start", "finalize:end"]
        assert linker.log == ["initialize", ("exited", target_pid)]


async def test_a_terminated_linker_is_not_told() -> None:
    async with Runtime():
        target_pid = spawn(Recorder())
        linker = Linker(target_pid)
        linker_pid = spawn(linker)
        await Clock.settle()
        terminate(linker_pid)
        await wait(linker_pid)
        terminate(target_pid)
        await wait(target_pid)
        await Clock.settle()
        assert linker.log == ["initialize", "finalize"]


async def test_link_needs_a_spawned_process() -> None:
    with pytest.raises(RuntimeError, match="is not spawned"):
        Recorder().link(PID("x"))
