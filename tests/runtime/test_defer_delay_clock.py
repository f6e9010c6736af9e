"""R-RT-6 defer, R-RT-7 delay and the Clock (both backends)."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import pytest

from runtime import PID, Clock, Process, ProcessTerminated, Promise, Runtime, defer, delay, dispatch, spawn
from runtime import terminate, wait

pytestmark = pytest.mark.anyio


class Owner(Process):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[Any] = []
        self.in_event = False

    def record(self, value: Any) -> Any:
        self.log.append(value)
        return value

    def watch(self, future: Any) -> None:
        # the continuation touches this process's state: it must be deferred
        future.then(defer(self.pid, Owner.record))


def _running_in(proc: Process) -> bool:
    """True while ``proc``'s mailbox is being drained (inside one of its events)."""
    return proc._scheduled and proc.stats()["state"] == "running"


# -- defer --------------------------------------------------------------------------
async def test_defer_of_a_class_function_dispatches_it_with_the_process() -> None:
    async with Runtime():
        proc = Owner()
        pid = spawn(proc)
        deferred = defer(pid, Owner.record)
        assert await deferred("x") == "x"
        assert proc.log == ["x"]


async def test_a_deferred_continuation_runs_in_the_process_not_in_the_completer() -> None:
    async with Runtime():
        proc = Owner()
        pid = spawn(proc)
        await Clock.settle()
        promise: Promise[str] = Promise()
        await dispatch(pid, Owner.watch, promise.future)
        queued = dispatch(pid, Owner.record, "queued first")
        promise.set_value("continuation")
        assert proc.log == []  # nothing ran in the completing code
        await Clock.settle()
        assert await queued == "queued first"
        assert proc.log == ["queued first", "continuation"]  # behind the queued event


async def test_defer_of_a_plain_callable_runs_it_inside_the_process() -> None:
    async with Runtime():
        proc = Owner()
        pid = spawn(proc)
        await Clock.settle()
        seen: list[Any] = []
        deferred = defer(pid, lambda a, b: seen.append(((a, b), list(proc.log), _running_in(proc))) or a + b)
        dispatch(pid, Owner.record, "queued first")
        future = deferred(2, 3)
        assert seen == []  # not run in place
        assert await future == 5
        # run by the process's drain, in mailbox order
        assert seen == [((2, 3), ["queued first"], True)]


async def test_defer_of_a_base_class_function_gets_the_process() -> None:
    class Child(Owner):
        pass

    async with Runtime():
        proc = Child()
        pid = spawn(proc)
        assert await defer(pid, Owner.record)("inherited") == "inherited"
        assert proc.log == ["inherited"]


async def test_defer_to_a_terminated_process_fails() -> None:
    async with Runtime():
        pid = spawn(Owner())
        terminate(pid)
        await wait(pid)
        with pytest.raises(ProcessTerminated):
            await defer(pid, Owner.record)(1)
        with pytest.raises(ProcessTerminated):
            await defer(pid, print)(1)


# -- delay ----------------------------------------------------------------------------
async def test_delay_dispatches_when_the_paused_clock_reaches_the_deadline() -> None:
    async with Runtime():
        Clock.pause()
        proc = Owner()
        pid = spawn(proc)
        delay(10, pid, Owner.record, "late")
        delay(5, pid, Owner.record, "early")
        Clock.advance(4.999)
        await Clock.settle()
        assert proc.log == []
        Clock.advance(0.001)
        await Clock.settle()
        assert proc.log == ["early"]
        Clock.advance(5)
        await Clock.settle()
        assert proc.log == ["early", "late"]


async def test_a_cancelled_delay_never_fires() -> None:
    async with Runtime():
        Clock.pause()
        proc = Owner()
        pid = spawn(proc)
        timer = delay(1, pid, Owner.record, "cancelled")
        assert timer.cancel() is True
        assert timer.cancel() is False
        Clock.advance(2)
        await Clock.settle()
        assert proc.log == []
        fired = delay(1, pid, Owner.record, "fired")
        Clock.advance(1)
        assert fired.fired and fired.cancel() is False
        await Clock.settle()
        assert proc.log == ["fired"]


async def test_a_delay_to_a_terminated_process_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    async with Runtime():
        Clock.pause()
        gone, alive = Owner(), Owner()
        pid, alive_pid = spawn(gone), spawn(alive)
        dropped = delay(1, pid, Owner.record, "x")
        delivered = delay(1, alive_pid, Owner.record, "y")  # same deadline, a live target
        terminate(pid)
        await wait(pid)
        with caplog.at_level(logging.WARNING):
            Clock.advance(1)
            await Clock.settle()
        assert dropped.fired and delivered.fired
        assert alive.log == ["y"]
        assert gone.log == []  # the method never ran on the terminated process
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- the Clock ------------------------------------------------------------------------
async def test_pause_freezes_time_and_advance_moves_it() -> None:
    async with Runtime():
        Clock.pause()
        assert Clock.paused()
        frozen = Clock.now()
        time.sleep(0.001)  # real time passes; the clock does not
        assert Clock.now() == frozen
        Clock.advance(2.5)
        assert Clock.now() == frozen + 2.5


async def test_resume_continues_from_the_frozen_instant_and_fires_due_timers() -> None:
    async with Runtime():
        Clock.pause()
        fired: list[str] = []
        Clock.timer(0, lambda: fired.append("due"))
        Clock.timer(3600, lambda: fired.append("an hour"))
        Clock.advance(10)
        assert fired == ["due"]
        frozen = Clock.now()
        Clock.timer(0, lambda: fired.append("on resume"))
        Clock.resume()
        assert not Clock.paused()
        assert fired == ["due", "on resume"]
        assert Clock.now() >= frozen  # never jumps back


async def test_timers_fire_in_deadline_order_then_creation_order() -> None:
    async with Runtime():
        Clock.pause()
        fired: list[int] = []
        for seconds, tag in ((3, 3), (1, 1), (2, 2), (1, 11)):
            Clock.timer(seconds, lambda tag=tag: fired.append(tag))
        Clock.advance(5)
        assert fired == [1, 11, 2, 3]


async def test_advance_needs_a_paused_clock_and_a_non_negative_duration() -> None:
    async with Runtime():
        with pytest.raises(RuntimeError, match=r"needs a paused clock: call Clock.pause\(\) first"):
            Clock.advance(1)
        Clock.pause()
        with pytest.raises(ValueError, match="non-negative duration, got -1"):
            Clock.advance(-1)


async def test_a_running_clock_fires_timers_by_itself() -> None:
    async with Runtime():
        fired = anyio.Event()
        start = Clock.now()
        timer = Clock.timer(0.001, fired.set)
        later = Clock.timer(3600, lambda: None)
        with anyio.fail_after(10):  # a hang guard, not a timing assertion
            await fired.wait()
        assert not Clock.paused()
        assert timer.fired and Clock.now() - start >= 0.001  # not before its deadline
        assert not later.fired  # a timer an hour away waits its turn


async def test_a_raising_timer_is_logged_and_others_still_fire(caplog: pytest.LogCaptureFixture) -> None:
    async with Runtime():
        Clock.pause()
        fired: list[str] = []
        Clock.timer(1, lambda: 1 // 0)
        Clock.timer(1, lambda: fired.append("second"))
        Clock.advance(1)
        assert fired == ["second"]
        assert "Timer callback" in caplog.text


async def test_leaving_the_scope_resumes_the_clock_and_drops_timers() -> None:
    fired: list[str] = []
    async with Runtime():
        Clock.pause()
        Clock.timer(1, lambda: fired.append("dropped"))
    assert not Clock.paused()
    Clock.pause()
    Clock.advance(5)
    assert fired == []


async def test_settle_waits_for_chains_of_events_across_processes() -> None:
    class Relay(Process):
        def __init__(self, next_pid: PID | None, log: list[str]) -> None:
            super().__init__()
            self.next_pid = next_pid
            self.log = log

        def hop(self, n: int) -> None:
            self.log.append(f"{self.pid.id}:{n}")
            if self.next_pid is not None:
                dispatch(self.next_pid, Relay.hop, n + 1)

    async with Runtime():
        log: list[str] = []
        pid: PID | None = None
        for _ in range(5):
            pid = spawn(Relay(pid, log))
        assert pid is not None
        dispatch(pid, Relay.hop, 0)
        await Clock.settle()
        assert [entry.split(":")[1] for entry in log] == ["0", "1", "2", "3", "4"]


async def test_settle_counts_a_suspended_method_as_idle() -> None:
    class Waiter(Process):
        async def wait_for(self, gate: anyio.Event) -> str:
            await gate.wait()
            return "released"

    gate = anyio.Event()
    async with Runtime():
        future = dispatch(spawn(Waiter()), Waiter.wait_for, gate)
        await Clock.settle()
        assert future.is_pending()
        gate.set()
        assert await future == "released"


async def test_settle_needs_a_runtime() -> None:
    with pytest.raises(RuntimeError, match="No runtime is running"):
        await Clock.settle()
