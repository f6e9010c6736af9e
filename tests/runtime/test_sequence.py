"""runtime.Sequence (libprocess ``process::Sequence``): callbacks run one at
a time in the order they were added, each after every earlier one is done;
discards before and after a callback started; close() (libprocess'
destruction); keyed use with ``on_idle``; a process's async methods
serialized through it on both backends."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from runtime import Discarded, Failure, Future, Process, ProcessTerminated, Promise, Runtime, Sequence
from runtime import dispatch, spawn, terminate, wait


# -- pure: no runtime, Futures completed by hand ----------------------------------
def test_an_idle_sequence_invokes_at_once_and_returns_the_callbacks_future() -> None:
    sequence = Sequence()
    promise: Promise[int] = Promise()
    future = sequence.add(lambda: promise.future)
    assert future is promise.future  # started at once: the callback's own Future
    assert not sequence.is_idle() and len(sequence) == 1
    promise.set_value(7)
    assert future.get() == 7 and sequence.is_idle() and len(sequence) == 0
    assert sequence.add(lambda x: x * 2, 21).get() == 42  # plain values, arguments


def test_each_callback_waits_for_every_earlier_one_to_be_done() -> None:
    sequence = Sequence()
    log: list[str] = []
    gates = [Promise() for _ in range(3)]

    def step(i: int) -> Future:
        log.append(f"start {i}")
        gates[i].future.on_any(lambda _f: log.append(f"end {i}"))
        return gates[i].future

    futures = [sequence.add(step, i) for i in range(3)]
    assert log == ["start 0"]
    gates[1].set_value(1)  # a later callback's own work finishing early changes nothing
    assert log == ["start 0"]
    gates[0].fail(OSError("boom"))  # failed counts as done
    assert log == ["start 0", "end 0", "start 1", "end 1", "start 2"]
    assert futures[0].is_failed() and isinstance(futures[0].failure(), OSError)
    assert futures[1].get() == 1 and futures[2].is_pending()
    gates[2].discard()  # discarded counts as done too
    assert futures[2].is_discarded() and sequence.is_idle()


def test_an_exception_from_a_callback_fails_only_its_future() -> None:
    sequence = Sequence()
    gate: Promise[None] = Promise()
    first = sequence.add(lambda: gate.future)

    def boom() -> None:
        raise ValueError("no")

    second = sequence.add(boom)
    third = sequence.add(lambda: "after")
    gate.set_value(None)
    assert isinstance(second.failure(), ValueError) and str(second.failure()) == "no"
    assert third.get() == "after" and first.is_ready()
    # at once, too
    assert isinstance(sequence.add(boom).failure(), ValueError)
    assert sequence.add(lambda: 1).get() == 1


def test_a_coroutine_is_refused_with_the_way_out() -> None:
    async def work() -> int:
        return 1

    future = Sequence().add(work)
    assert isinstance(future.failure(), TypeError)
    assert "returned a coroutine" in str(future.failure()) and "defer(pid, method)" in str(future.failure())


def test_discard_before_the_callback_started_never_invokes_it() -> None:
    sequence = Sequence()
    gate: Promise[None] = Promise()
    invoked: list[int] = []
    first = sequence.add(lambda: gate.future)
    second = sequence.add(lambda: invoked.append(2))
    third = sequence.add(lambda: invoked.append(3))
    assert second.discard() is True
    assert second.is_pending()  # DISCARDED when its turn comes, as in libprocess
    gate.set_value(None)
    assert first.is_ready() and second.is_discarded() and third.is_ready()
    assert invoked == [3]


def test_discard_after_the_callback_started_goes_to_its_future_and_the_next_waits() -> None:
    sequence = Sequence()
    gate: Promise[None] = Promise()
    seen: list[str] = []
    gate.on_discard(lambda: seen.append("discard requested"))
    blocker: Promise[None] = Promise()
    sequence.add(lambda: blocker.future)
    second = sequence.add(lambda: gate.future)
    third = sequence.add(lambda: seen.append("third"))
    blocker.set_value(None)  # second starts
    second.discard()
    assert seen == ["discard requested"]
    assert second.is_pending() and third.is_pending()  # the producer decides; the next still waits
    gate.set_value("kept going")
    assert second.get() == "kept going" and seen == ["discard requested", "third"]


def test_close_discards_what_waits_and_lets_the_running_one_finish() -> None:
    sequence = Sequence()
    gate: Promise[str] = Promise()
    invoked: list[int] = []
    running = sequence.add(lambda: gate.future)
    waiting = [sequence.add(lambda i=i: invoked.append(i)) for i in range(3)]
    sequence.close()
    assert all(f.is_discarded() for f in waiting) and sequence.closed
    late = sequence.add(lambda: invoked.append(99))
    assert late.is_discarded()
    assert running.is_pending()
    gate.set_value("done")
    assert running.get() == "done" and invoked == []


def test_a_callback_that_adds_to_its_own_sequence_queues_behind_itself() -> None:
    sequence = Sequence()
    log: list[str] = []
    inner: list[Future] = []

    def outer() -> str:
        inner.append(sequence.add(lambda: log.append("inner")))
        log.append("outer")
        return "outer done"

    assert sequence.add(outer).get() == "outer done"
    assert log == ["outer", "inner"] and inner[0].is_ready() and sequence.is_idle()


def test_a_long_chain_of_callbacks_that_complete_at_once_does_not_recurse() -> None:
    sequence = Sequence()
    gate: Promise[None] = Promise()
    sequence.add(lambda: gate.future)
    futures = [sequence.add(lambda i=i: i) for i in range(20_000)]
    gate.set_value(None)
    assert [f.get() for f in futures[-3:]] == [19_997, 19_998, 19_999]
    assert sequence.is_idle()


def test_on_idle_lets_a_keyed_user_drop_sequences() -> None:
    sequences: dict[str, Sequence] = {}
    gates = {key: Promise() for key in "ab"}

    def run(key: str, fn: Any) -> Future:
        sequence = sequences.get(key)
        if sequence is None:
            sequence = sequences[key] = Sequence(on_idle=lambda: sequences.pop(key, None))
        return sequence.add(fn)

    run("a", lambda: gates["a"].future)
    run("a", lambda: "a2")
    run("b", lambda: gates["b"].future)
    assert sorted(sequences) == ["a", "b"]
    run("c", lambda: "at once")  # idle again inside add: dropped at once
    assert sorted(sequences) == ["a", "b"]
    gates["a"].set_value(None)
    assert sorted(sequences) == ["b"]
    gates["b"].set_value(None)
    assert sequences == {}


def test_claim_takes_an_idle_sequence_until_release() -> None:
    sequence = Sequence(on_idle=lambda: idle.append(True))
    idle: list[bool] = []
    assert sequence.claim() is True and not sequence.is_idle()
    assert sequence.claim() is False  # taken: add the work instead
    later = sequence.add(lambda: "later")
    assert later.is_pending() and idle == []
    sequence.release()
    assert later.get() == "later" and sequence.is_idle() and idle == [True]
    sequence.release()  # nothing claimed: no effect
    gate: Promise[None] = Promise()
    sequence.add(lambda: gate.future)
    assert sequence.claim() is False  # a callback is running
    gate.set_value(None)
    sequence.close()
    assert sequence.claim() is False  # closed


# -- on a runtime: a process's async methods serialized, asyncio and trio ----------
class Keeper(Process):
    """Serializes its async ``write`` per key through a Sequence each."""

    def __init__(self) -> None:
        super().__init__()
        self.sequences: dict[str, Sequence] = {}
        self.log: list[str] = []
        self.gates: dict[str, anyio.Event] = {}

    def write(self, key: str, value: str) -> Any:
        sequence = self.sequences.get(key)
        if sequence is None:
            sequence = self.sequences[key] = Sequence(on_idle=lambda: self.sequences.pop(key, None))
        if sequence.claim():  # idle: run it as this event (the isolator's fast path)
            return self._write(key, value, sequence)
        return sequence.add(dispatch, self.pid, Keeper._write, key, value)

    def finalize(self) -> None:
        for sequence in list(self.sequences.values()):
            sequence.release()  # a claimed call that never started holds nothing

    async def _write(self, key: str, value: str, claimed: Sequence | None = None) -> str:
        try:
            return await self._write_now(key, value)
        finally:
            if claimed is not None:
                claimed.release()

    async def _write_now(self, key: str, value: str) -> str:
        self.log.append(f"{key}:{value}:start")
        gate = self.gates.get(value)
        if gate is not None:
            await gate.wait()
        else:
            await anyio.sleep(0)
        self.log.append(f"{key}:{value}:end")
        if value == "bad":
            raise Failure(f"{key} refused {value}")
        return value


def spawned_keeper(gate: str) -> Keeper:
    """A spawned Keeper whose write of ``gate`` waits until ``keeper.gates[gate]`` is set."""
    keeper = Keeper()
    spawn(keeper)
    keeper.gates[gate] = anyio.Event()
    return keeper


async def running_and_waiting(gate: str) -> tuple[Keeper, Future, Future]:
    """A spawned Keeper, a write of ``gate`` on key "a" running (held at its
    gate) and one more waiting behind it."""
    keeper = spawned_keeper(gate)
    running = dispatch(keeper.pid, Keeper.write, "a", gate)
    waiting = dispatch(keeper.pid, Keeper.write, "a", "next")
    with anyio.fail_after(5):
        while keeper.log != [f"a:{gate}:start"]:
            await anyio.sleep(0)
    return keeper, running, waiting


async def terminated_failing(keeper: Keeper, calls: list[Future], inject: bool) -> None:
    """Terminate ``keeper``; every one of ``calls`` then fails with
    ProcessTerminated: nothing hangs."""
    terminate(keeper.pid, inject=inject)
    await wait(keeper.pid)
    with anyio.fail_after(5):
        for call in calls:
            with pytest.raises(ProcessTerminated):
                await call


@pytest.mark.anyio
async def test_a_process_serializes_its_async_methods_per_key(anyio_backend: str) -> None:
    async with Runtime():
        keeper = spawned_keeper("slow")
        pid = keeper.pid
        a1 = dispatch(pid, Keeper.write, "a", "slow")
        a2 = dispatch(pid, Keeper.write, "a", "bad")
        a3 = dispatch(pid, Keeper.write, "a", "last")
        b1 = dispatch(pid, Keeper.write, "b", "quick")
        assert await b1 == "quick"  # another key is not held up by "a"
        assert keeper.log == ["a:slow:start", "b:quick:start", "b:quick:end"]
        keeper.gates["slow"].set()
        assert await a1 == "slow"
        with pytest.raises(Failure, match="a refused bad"):
            await a2
        assert await a3 == "last"
        assert [line for line in keeper.log if line.startswith("a:")] == [
            "a:slow:start", "a:slow:end", "a:bad:start", "a:bad:end", "a:last:start", "a:last:end",
        ]
        assert keeper.sequences == {}  # every key dropped once idle


@pytest.mark.anyio
async def test_termination_fails_the_running_and_the_waiting_calls(anyio_backend: str) -> None:
    async with Runtime():
        keeper, running, waiting = await running_and_waiting("never")
        await terminated_failing(keeper, [running, waiting], inject=True)
        assert keeper.log == ["a:never:start"]


@pytest.mark.anyio
async def test_termination_right_after_the_calls_completes_every_future(anyio_backend: str) -> None:
    async with Runtime():
        keeper = spawned_keeper("one")  # never set: "one" holds the key until termination
        pid = keeper.pid
        calls = [dispatch(pid, Keeper.write, "a", value) for value in ("one", "two", "three")]
        # after the three events: the first one runs, the others wait
        await terminated_failing(keeper, calls, inject=False)
        assert keeper.log == ["a:one:start"]


@pytest.mark.anyio
async def test_close_on_a_runtime_discards_the_waiting_calls(anyio_backend: str) -> None:
    async with Runtime():
        keeper, running, waiting = await running_and_waiting("slow")
        keeper.sequences["a"].close()
        with pytest.raises(Discarded):
            await waiting
        keeper.gates["slow"].set()
        assert await running == "slow"
        assert keeper.log == ["a:slow:start", "a:slow:end"]
