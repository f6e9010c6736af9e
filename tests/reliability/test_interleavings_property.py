"""A stateful property test of the isolator (issue 9, R-IS-8), the kernel as judge.

A hypothesis ``RuleBasedStateMachine`` drives one isolator with prepare /
update / usage / cleanup, concurrent bursts (several dispatches awaited
together), reconcile and restart (drop every actor, rebuild from the same
flags, recover the containers known before). After every step ``judge``
reads the kernel: every GPU free in the allocator or granted to exactly one
container, never both, never two; records, allocator and kernel agree;
cleaned-up containers have no cgroup.

The machine owns its event loop (an ``asyncio.Runner``) with a
``runtime.Runtime`` entered in a host task for the whole example; each rule
runs its coroutine to completion on it.

CI runs derandomized (a fixed seed) with bounded examples and steps;
``GPU_ISOLATOR_PROPERTY_SCALE=N`` (N > 1) multiplies both and explores with
random seeds for a longer run (hypothesis prints the seed of a failure).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from isolators import ContainerID, IsolatorError, Resources
from runtime import Runtime
from tests.support.containers import config
from tests.support.errors import assert_isolator_error
from tests.support.kernel import skip_reason
from tests.support.nodes import judge

IDS = [f"c{i}" for i in range(5)]
GPUS = 4
SCALE = int(os.environ.get("GPU_ISOLATOR_PROPERTY_SCALE", "1"))
# (examples, steps) per backend and device worker; the kernel backends cost
# ~10x a memory step, and a device worker process adds ~0.1 s per (re)start.
BUDGET = {
    ("memory", "thread"): (40, 40),
    ("cgroups_v1", "thread"): (30, 40),
    ("cgroups_v2", "thread"): (30, 40),
    ("cgroups_v1", "process"): (16, 40),
    ("cgroups_v2", "process"): (16, 40),
}

ids = st.sampled_from(IDS)
counts = st.integers(min_value=0, max_value=GPUS + 1)
operation = st.one_of(
    st.tuples(st.just("prepare"), ids, counts),
    st.tuples(st.just("update"), ids, counts),
    st.tuples(st.just("usage"), ids, st.just(0)),
    st.tuples(st.just("cleanup"), ids, st.just(0)),
    st.tuples(st.just("reconcile"), st.just(""), st.just(0)),
)


class IsolatorMachine(RuleBasedStateMachine):
    """See the module docstring. ``node`` is set by the test (one per run)."""

    node: Any = None
    stats: dict[str, int] = {}

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, int] = {}
        self.runner = asyncio.Runner()
        self.stop_event: asyncio.Event | None = None
        self.entered: asyncio.Event | None = None
        self.host: asyncio.Task | None = None
        self.runner.run(self._open())
        self.run(self._start())

    # -- the loop and the runtime ----------------------------------------------
    async def _open(self) -> None:
        self.stop_event, self.entered = asyncio.Event(), asyncio.Event()
        self.host = asyncio.get_running_loop().create_task(self._host())
        await self.entered.wait()

    async def _host(self) -> None:
        async with Runtime():
            self.entered.set()
            await self.stop_event.wait()

    def run(self, awaitable: Any) -> Any:
        """Run ``awaitable`` (a coroutine or a runtime Future) to completion."""

        async def wait() -> Any:
            return await awaitable

        return self.runner.run(wait())

    async def _start(self) -> None:
        _components, isolator = await self.node.start()
        await isolator.recover([], set())

    def teardown(self) -> None:
        try:
            if self.node.isolator is not None:
                self.run(self._finish())
        finally:
            try:
                self.stop_event.set()
                self.run(self.host)
            finally:
                self.runner.close()
                self.node.components = self.node.isolator = None
                self.node.teardown()

    async def _finish(self) -> None:
        await self.node.clean_all()
        assert not self.node.root_exists(), "the cgroups root outlived clean_all"
        await self.node.stop()

    # -- helpers -------------------------------------------------------------------
    @property
    def free(self) -> int:
        return GPUS - sum(self.model.values())

    @staticmethod
    async def settle(future: Any) -> tuple[bool, Any]:
        try:
            return True, await future
        except IsolatorError as error:  # every isolator failure, allocator exhaustion included
            assert type(error) is IsolatorError, f"{type(error).__name__}: {error}"
            return False, error

    def dispatch(self, kind: str, cid: str, k: int) -> Any:
        isolator, container = self.node.isolator, ContainerID(cid)
        if kind == "prepare":
            return isolator.prepare(container, config(f"cpus:1;gpus:{k}"))
        if kind == "update":
            return isolator.update(container, Resources.parse(f"gpus:{k}"))
        if kind == "usage":
            return isolator.usage(container)
        return isolator.cleanup(container)

    def call(self, kind: str, cid: str, k: int) -> Any:
        if kind == "reconcile":  # no container: every container's repair, in its order
            return self.node.isolator.reconcile()
        return self.dispatch(kind, cid, k)

    def expect(self, kind: str, cid: str, k: int, ok: bool, value: Any, *, contended: bool) -> None:
        """Check one outcome against the model and apply it. ``contended``: other
        containers' calls ran concurrently, so a shortage may or may not occur."""
        known = cid in self.model
        self.stats[kind] = self.stats.get(kind, 0) + 1
        if kind == "reconcile":
            assert ok and value == [], f"nothing drifted, yet reconcile said {value}"
        elif kind == "prepare":
            if known:
                assert not ok, value
                assert_isolator_error(value, "Container has already been prepared")
            else:
                self.granted_or_short(kind, cid, k, k, ok, value, contended)
        elif kind == "update":
            if not known:
                assert not ok, value
                assert_isolator_error(value, "Unknown container")
            else:
                self.granted_or_short(kind, cid, k, k - self.model[cid], ok, value, contended)
        elif kind == "usage":
            if not known:
                assert not ok, value
                assert_isolator_error(value, "Unknown container")
            else:
                assert ok, value
                assert value.gpus_allocated == self.model[cid], (value, self.model)
        else:
            assert ok, value
            self.model.pop(cid, None)

    def granted_or_short(self, kind: str, cid: str, k: int, need: int, ok: bool, value: Any,
                         contended: bool) -> None:
        """A prepare or update of ``cid`` to ``k`` GPUs that needed ``need`` more:
        done (then they were free, unless others' calls ran meanwhile), or the
        shortage error naming ``need`` (then they were not)."""
        if ok:
            assert contended or need <= self.free, f"{kind} needing {need} with {self.free} free succeeded"
            self.model[cid] = k
        else:
            assert_isolator_error(value, re.compile(rf"Requested {need} gpus but only \d+ available"))
            assert contended or need > self.free, value

    def one(self, kind: str, cid: str, k: int) -> None:
        ok, value = self.run(self.settle(self.call(kind, cid, k)))
        self.expect(kind, cid, k, ok, value, contended=False)
        assert sum(self.model.values()) <= GPUS, self.model

    # -- rules ---------------------------------------------------------------------------
    @rule(cid=ids, k=counts)
    def prepare(self, cid: str, k: int) -> None:
        self.one("prepare", cid, k)

    @rule(cid=ids, k=counts)
    def update(self, cid: str, k: int) -> None:
        self.one("update", cid, k)

    @rule(cid=ids)
    def usage(self, cid: str) -> None:
        self.one("usage", cid, 0)

    @rule(cid=ids)
    def cleanup(self, cid: str) -> None:
        self.one("cleanup", cid, 0)

    @initialize(ops=st.lists(operation, min_size=2, max_size=8))
    def first_burst(self, ops: list[tuple[str, str, int]]) -> None:
        """Every example starts with a burst (small budgets draw few)."""
        self.burst(ops)

    @rule(ops=st.lists(operation, min_size=2, max_size=8))
    def burst(self, ops: list[tuple[str, str, int]]) -> None:
        """Dispatch several calls at once and await them together: calls on one
        container apply in arrival order; others interleave freely."""

        async def together() -> list[tuple[bool, Any]]:
            futures = [self.call(*op) for op in ops]
            return list(await asyncio.gather(*(self.settle(f) for f in futures)))

        outcomes = self.run(together())
        self.stats["burst"] = self.stats.get("burst", 0) + 1
        # Replay per container in arrival order (deterministic per container;
        # across containers the order is free, so the GPU total is checked
        # only once the burst is over).
        for (kind, cid, k), (ok, value) in zip(ops, outcomes):
            self.expect(kind, cid, k, ok, value, contended=True)
        assert sum(self.model.values()) <= GPUS, self.model

    @rule()
    def reconcile(self) -> None:
        self.one("reconcile", "", 0)

    @rule()
    def restart(self) -> None:
        """Drop every actor, rebuild from the same flags, recover what was known."""
        before = self.run(self.node.isolator.containers())
        self.run(self.node.restart(before))
        after = self.run(self.node.isolator.containers())
        assert after == before, f"recovered {after}, had {before}"
        assert self.node.isolator.recovery_report == [], self.node.isolator.recovery_report
        self.stats["restart"] = self.stats.get("restart", 0) + 1

    @invariant()
    def the_kernel_agrees(self) -> None:
        self.run(judge(self.node, self.model))


@pytest.mark.parametrize(("backend", "worker"), sorted(BUDGET))
def test_random_interleavings_never_leak_or_double_grant(
    backend: str, worker: str, node_factory: Any
) -> None:
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    examples, steps = BUDGET[backend, worker]
    nodes: list[Any] = []

    class Machine(IsolatorMachine):
        stats: dict[str, int] = {}

        def __init__(self) -> None:
            # One fresh node (cgroups root) per example; torn down by the machine.
            node = node_factory(backend, GPUS, device_worker=worker)
            nodes.append(node)
            type(self).node = node
            super().__init__()

    started = time.monotonic()
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=examples * SCALE,
            stateful_step_count=steps * SCALE,
            derandomize=SCALE == 1,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    elapsed = time.monotonic() - started
    print(
        f"\n[{backend}, {worker}] examples<= {examples * SCALE}, steps<= {steps * SCALE}, nodes {len(nodes)},"
        f" calls {sum(Machine.stats.values())} {dict(sorted(Machine.stats.items()))}, {elapsed:.1f}s"
    )
    assert Machine.stats.get("restart", 0) > 0 and Machine.stats.get("burst", 0) > 0
