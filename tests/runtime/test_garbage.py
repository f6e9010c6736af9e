"""A terminated process is freed by reference counting alone (both backends).

Rules checked: with the cycle collector disabled, spawning, calling,
terminating and waiting for processes leaves nothing for ``gc.collect()``
to find -- no reference cycle between a process, its mailbox, its
scheduler, its drain, its context, its Futures, its links or the run
queue -- and a weak reference to a terminated process is dead right after
``wait()`` returns, once nobody else holds it. The same for the dispatches'
Futures, a tree of linked processes, async methods (finished, parked on a
runtime Future, handed to a task, cancelled by termination) and named
messages (handled, and dropped at termination).

The census (``gc.collect()`` finds exactly nothing) runs in a fresh
interpreter (``python -m tests.runtime.test_garbage BACKEND``): inside
pytest, the harness itself releases cyclic garbage of earlier tests (their
reports and tracebacks) at moments of its own, which would be counted.
The weak-reference checks run in the test process.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import anyio
import pytest

from runtime import PID, Process, Promise, Runtime, collect, dispatch, send, spawn, terminate, wait

from tests.support.processes import LogProcess

pytestmark = pytest.mark.anyio

BATCH = 1000
BOUND = 10.0  # seconds the cancelled methods' tasks may take to unwind


class Worker(LogProcess):
    """Logs what it records and the bodies of the ``tell`` messages it gets."""

    def initialize(self) -> None:
        self.install("tell", Worker.told)

    def told(self, _from: PID | None, body: Any) -> None:
        self.log.append(body)

    async def parked(self, future: Any) -> Any:  # awaits a runtime Future: parked, then resumed
        return await future

    async def handed_to_a_task(self) -> str:  # awaits something else: a task drives it
        await anyio.sleep(0)
        return "slept"


class Parent(Process):
    """Links to its children and counts their ``exited``."""

    def __init__(self, children: list[PID]) -> None:
        super().__init__()
        self.children = children
        self.exits = 0

    def initialize(self) -> None:
        for child in self.children:
            self.link(child)

    def exited(self, _pid: PID) -> None:
        self.exits += 1

    def seen(self) -> int:
        return self.exits


def census() -> dict[str, int]:
    """What ``gc.collect()`` finds unreachable now, by type name."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return dict(collections.Counter(type(o).__name__ for o in gc.garbage).most_common(12))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def freed(run: Callable[[], Awaitable[list[weakref.ref]]], unwinding: bool = False) -> dict[str, int]:
    """Run a scenario once to warm up, then again; every process it reports
    is freed when ``wait`` returns (``unwinding``: once the tasks of its
    methods cancelled at termination have unwound, within BOUND seconds --
    trio runs each suspended method in a task, whose cancellation is
    delivered when trio next runs it); what the collector finds after the
    second run."""
    await run()
    census()
    refs = await run()
    if unwinding:
        with anyio.move_on_after(BOUND):
            while any(ref() is not None for ref in refs):
                await anyio.sleep(0)
    alive = [ref() for ref in refs if ref() is not None]
    assert alive == [], f"{len(alive)} terminated process(es) still alive after wait(), e.g. {alive[:3]}"
    return census()


async def batch(k: int = BATCH) -> list[weakref.ref]:
    """Spawn ``k`` processes, call each once, terminate and wait for all."""
    workers = [Worker() for _ in range(k)]
    refs = [weakref.ref(w) for w in workers]
    pids = [spawn(w) for w in workers]
    del workers
    assert await collect([dispatch(pid, Worker.record, i) for i, pid in enumerate(pids)]) == list(range(k))
    for pid in pids:
        terminate(pid)
    await collect([wait(pid) for pid in pids])
    return refs


async def tree() -> list[weakref.ref]:
    """Parents linked to ten children each: the children terminate (each
    parent sees ten ``exited``), then the parents."""
    children = [Worker() for _ in range(BATCH // 10)]
    refs = [weakref.ref(c) for c in children]
    pids = [spawn(c) for c in children]
    del children
    parents = [Parent(pids[i:i + 10]) for i in range(0, len(pids), 10)]
    refs += [weakref.ref(p) for p in parents]
    parent_pids = [spawn(p) for p in parents]
    del parents
    assert await collect([dispatch(p, Parent.seen) for p in parent_pids]) == [0] * len(parent_pids)
    for pid in pids:
        terminate(pid)
    await collect([wait(pid) for pid in pids])
    assert await collect([dispatch(p, Parent.seen) for p in parent_pids]) == [10] * len(parent_pids)
    for parent in parent_pids:
        terminate(parent)
    await collect([wait(p) for p in parent_pids])
    return refs


async def mixed() -> list[weakref.ref]:
    """Messages, async methods resumed from a Future and from a task, then
    termination with a method still parked and events and messages queued."""
    workers = [Worker() for _ in range(50)]
    refs = [weakref.ref(w) for w in workers]
    pids = [spawn(w) for w in workers]
    del workers
    for pid in pids:
        for i in range(3):
            send(pid, "tell", i)
    promises = [Promise() for _ in pids]
    resumed = [dispatch(pid, Worker.parked, p.future) for pid, p in zip(pids, promises)]
    tasks = [dispatch(pid, Worker.handed_to_a_task) for pid in pids]
    for promise in promises:
        promise.set_value(1)
    assert await collect(resumed) == [1] * len(pids)
    assert await collect(tasks) == ["slept"] * len(pids)
    stuck = [dispatch(pid, Worker.parked, Promise().future) for pid in pids]  # never completed
    await collect([dispatch(pid, Worker.record, 0) for pid in pids])  # so each is parked now
    for pid in pids:
        dispatch(pid, Worker.record, 1)  # still queued at termination
        send(pid, "tell", 9)
    for pid in pids:
        terminate(pid)
    await collect([wait(pid) for pid in pids])
    assert all(future.is_failed() for future in stuck)
    return refs


SCENARIOS = {"batch": batch, "tree": tree, "mixed": mixed}


async def census_of_scenarios() -> dict[str, dict[str, int]]:
    """Each scenario's census with the collector off (run in a fresh interpreter)."""
    import logging

    logging.disable(logging.WARNING)  # the dropped messages' warnings are not the point here
    gc.collect()
    gc.disable()
    async with Runtime():
        return {name: await freed(run, unwinding=name == "mixed") for name, run in SCENARIOS.items()}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_terminated_processes_leave_nothing_for_the_collector(backend: str) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-m", "tests.runtime.test_garbage", backend], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {name: {} for name in SCENARIOS}, f"gc.collect() found unreachable objects: {found}"


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_each_terminated_process_is_freed_by_the_time_wait_returns(collector_off: None, scenario: str) -> None:
    async with Runtime():
        await freed(SCENARIOS[scenario], unwinding=scenario == "mixed")


async def test_a_weak_reference_to_a_terminated_process_is_dead_right_after_wait(collector_off: None) -> None:
    async with Runtime():
        worker = Worker()
        ref = weakref.ref(worker)
        pid = spawn(worker)
        del worker
        assert await dispatch(pid, Worker.record, "x") == "x"
        assert ref() is not None  # alive while it runs
        terminate(pid)
        await wait(pid)
        assert ref() is None


if __name__ == "__main__":
    print(json.dumps(anyio.run(census_of_scenarios, backend=sys.argv[1])))
