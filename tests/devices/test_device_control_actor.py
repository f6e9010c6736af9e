"""The device control actor: the port, group commit, ordering, failures
that stay with their caller, termination, and its backends on the kernel."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any, Sequence

import pytest

from actors.devices import Policy, DeviceControl, DeviceControlError, DeviceOperation, DeviceRule
from actors.devices import DeviceRuleError, InvalidCgroupError, KernelOperationError, MemoryBackend
from actors.devices import container_policy
from actors.devices import _drivers as drivers
from actors.devices.testing import FaultInjectingBackend
from runtime import Future, ProcessTerminated, Runtime, collect, dispatch
from tests.support.probes import assert_verdicts
from actors.flags import DEVICE_WORKERS

R = DeviceRule.parse
POLICY = container_policy(["c 195:255 rwm"], ["c 195:0 rw"])


class BatchRecordingBackend(MemoryBackend):
    """In-memory rules, but applied through the executor like a kernel
    backend; records each batch it is given, and can hold a batch."""

    name = "recording"
    blocking = True  # applied in a thread, like a kernel backend

    def __init__(self) -> None:
        super().__init__("recording:/gpu-isolator")
        self.batches: list[list[str]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        self.batches.append([op.kind for op in ops])
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        return super().apply_batch(ops)


@pytest.mark.asyncio
async def test_the_port_on_memory() -> None:
    async with Runtime():
        control = await DeviceControl.create("memory")
        assert control.backend_name == "memory"
        assert control.path("c1") == "memory:/gpu-isolator/c1"
        access = await control.configure("c1", [str(rule) for rule in POLICY[0]])
        assert access == Policy.create(*POLICY)
        assert await control.exists("c1") and await control.state("c1") == access
        after = await control.reconfigure("c1", ["c 195:1 rw"], ["c 195:0 rw"])
        assert after.is_granted("c", 195, 1, "rw") and not after.is_granted("c", 195, 0, "r")
        assert await control.reconcile("c1", *POLICY) == ["memory:/gpu-isolator/c1: restored the device policy"]
        assert await control.list_cgroups() == ["c1"]
        assert await control.remove("c1") is True
        assert await control.state("c1") is None and not await control.exists("c1")
        await control.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda c: c.configure("../escape", POLICY[0]), InvalidCgroupError, "Invalid cgroup '../escape'"),
        (lambda c: c.configure("/abs", POLICY[0]), InvalidCgroupError, "must be relative"),
        (lambda c: c.remove(""), InvalidCgroupError, "must be a non-empty relative path"),
        (lambda c: c.state("a//b"), InvalidCgroupError, "every component must be a plain name"),
        (lambda c: c.configure("c1", ["c 195:0 rwx"]), DeviceRuleError, "access 'rwx'"),
        (lambda c: c.configure("c1", "c 195:0 rw"), DeviceRuleError, "Expected a list of device rules"),
        (lambda c: c.reconfigure("c1", ["c 195:* rw"]), DeviceRuleError, "exact devices only"),
        (lambda c: c.reconcile("c1", ["c 1:3 rw"], ["c 1:3 rwm"]), DeviceRuleError, "cannot be encompassed"),
    ],
)
async def test_bad_arguments_fail_before_anything_is_queued(call, error, message: str) -> None:
    async with Runtime():
        backend = BatchRecordingBackend()
        control = await DeviceControl.create(backend_impl=backend)
        with pytest.raises(error, match=message.replace("(", r"\(").replace("*", r"\*")):
            await call(control)
        assert control.operations == 0 and backend.batches == [] and backend.list_cgroups() == []


@pytest.mark.asyncio
async def test_group_commit_applies_concurrent_calls_in_one_executor_job() -> None:
    async with Runtime():
        backend = BatchRecordingBackend()
        control = await DeviceControl.create(backend_impl=backend)
        results = await collect([control.configure(f"c{i}", *POLICY) for i in range(50)])
        assert len(results) == 50 and all(r == results[0] for r in results)
        assert control.batches == 1 and backend.batches == [["configure"] * 50]
        removed = await collect([control.remove(f"c{i}") for i in range(50)])
        assert all(removed) and control.batches == 2
        await control.close()


@pytest.mark.asyncio
async def test_calls_arriving_during_a_job_form_the_next_batch() -> None:
    async with Runtime():
        backend, control, first = await one_job_held()
        later = [control.configure(f"c{i}", *POLICY) for i in range(1, 20)] + [control.list_cgroups()]
        backend.gate.set()
        await first
        cgroups = (await collect(later))[-1]
        assert backend.batches == [["configure"], ["configure"] * 19 + ["list_cgroups"]]
        assert cgroups == sorted(f"c{i}" for i in range(20))
        await control.close()


async def one_job_held() -> tuple[BatchRecordingBackend, DeviceControl, Future]:
    """Device control on a gated backend, its first job (configure c0) in
    its thread, held in ``apply_batch`` until ``backend.gate`` is set; that
    call's Future."""
    import anyio

    backend = BatchRecordingBackend()
    backend.gate = threading.Event()
    control = await DeviceControl.create(backend_impl=backend)
    first = control.configure("c0", *POLICY)
    assert await anyio.to_thread.run_sync(backend.entered.wait, 10)  # waited for off the loop
    return backend, control, first


@pytest.mark.asyncio
async def test_operations_on_one_cgroup_apply_in_arrival_order() -> None:
    async with Runtime():
        control = await DeviceControl.create(backend_impl=BatchRecordingBackend())
        futures = [
            control.configure("c1", *POLICY),
            control.reconfigure("c1", ["c 195:1 rw"], []),
            control.state("c1"),
            control.reconfigure("c1", [], ["c 195:0 rw"]),
            control.remove("c1"),
            control.exists("c1"),
        ]
        configured, added, state, removed_gpu, removed, exists = await collect(futures)
        assert state == added and added.is_granted("c", 195, 1, "rw") and added.is_granted("c", 195, 0, "rw")
        assert not removed_gpu.is_granted("c", 195, 0, "r")
        assert removed is True and exists is False
        assert control.batches == 1
        await control.close()


@pytest.mark.asyncio
async def test_a_failing_operation_fails_only_its_own_caller() -> None:
    async with Runtime():
        backend = BatchRecordingBackend()
        control = await DeviceControl.create(backend_impl=backend)
        ok1 = control.configure("c1", *POLICY)
        bad = control.reconfigure("never-configured", ["c 195:1 rw"])
        ok2 = control.configure("c2", *POLICY)
        assert isinstance(await ok1, Policy) and isinstance(await ok2, Policy)
        with pytest.raises(DeviceControlError, match="Cannot reconfigure cgroup 'never-configured'"):
            await bad
        assert control.batches == 1 and await control.list_cgroups() == ["c1", "c2"]
        await control.close()


@pytest.mark.asyncio
async def test_an_injected_fault_reaches_its_caller_only() -> None:
    async with Runtime():
        inner = BatchRecordingBackend()
        backend = FaultInjectingBackend(inner, fail_at=3, errno=errno.EIO)  # c2's mkdir
        control = await DeviceControl.create(backend_impl=backend)
        futures = [control.configure(f"c{i}", *POLICY) for i in (1, 2, 3)]
        first, second, third = [await _settle(f) for f in futures]
        assert isinstance(first, Policy) and isinstance(third, Policy)
        assert isinstance(second, KernelOperationError) and second.errno == errno.EIO
        assert await control.list_cgroups() == ["c1", "c3"]
        await control.close()


async def _settle(future) -> Any:
    try:
        return await future
    except Exception as error:
        return error


@pytest.mark.asyncio
async def test_termination_fails_queued_and_in_flight_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # close() waits for the job held in its thread for STOP_TIMEOUT (5 s), then returns: that bound, shorter
    monkeypatch.setattr(drivers, "STOP_TIMEOUT", 0.2)
    async with Runtime():
        backend, control, in_flight = await one_job_held()
        queued = control.configure("c1", *POLICY)
        await dispatch(control.pid, lambda process: None)  # c1 has been taken in: queued behind the job
        await control.close()  # returns with the job still held: the bound
        backend.gate.set()
        for future in (in_flight, queued):
            with pytest.raises(ProcessTerminated, match="terminated before the operation completed"):
                await future
        with pytest.raises(ProcessTerminated):
            await control.exists("c0")


@pytest.mark.asyncio
@pytest.mark.parametrize("worker", DEVICE_WORKERS)
async def test_v2_start_errors_are_raised_and_no_file_is_needed(v2_sandbox, tmp_path, worker: str) -> None:
    async with Runtime():
        with pytest.raises(DeviceControlError, match="is not a cgroup2 hierarchy"):  # the backend's own error
            await DeviceControl.create("cgroups_v2", hierarchy=str(tmp_path), cgroups_root=v2_sandbox.cgroups_root,
                                       worker=worker)
        control = await DeviceControl.create("cgroups_v2", hierarchy=v2_sandbox.hierarchy,
                                             cgroups_root=v2_sandbox.cgroups_root, worker=worker)  # no work_dir
        try:
            access = await control.configure("c1", *POLICY)
            assert await control.state("c1") == access  # read back from the kernel
            assert await control.remove("c1") is True and await control.state("c1") is None
        finally:
            await control.close()
        assert os.listdir(tmp_path) == []
    with pytest.raises(DeviceControlError, match="Unknown device backend 'v9'"):
        async with Runtime():
            await DeviceControl.create("v9")


# One batch in a thread; a device worker process gets the first call at once
# (it is idle) and the three that came with it as the next batch.
BATCHES_FOR_FOUR = {"thread": 1, "process": 2}


@pytest.mark.asyncio
@pytest.mark.parametrize("worker", DEVICE_WORKERS)
async def test_v1_through_the_actor(v1_sandbox, device_nodes, worker: str) -> None:
    async with Runtime():
        control = await DeviceControl.create(
            "cgroups_v1", hierarchy=v1_sandbox.hierarchy, cgroups_root=v1_sandbox.cgroups_root, worker=worker
        )
        assert control.backend_name == "cgroups_v1"
        assert control.path("c1") == os.path.join(v1_sandbox.root, "c1")
        await collect([control.configure(f"c{i}", *container_policy([], [f"c 195:{i} rwm"])) for i in range(4)])
        assert control.batches == BATCHES_FOR_FOUR[worker]
        probe = v1_sandbox.probe("c1")
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 1)], denied=[("c", 195, 0)])
        await control.reconfigure("c1", ["c 195:0 rwm"], ["c 195:1 rwm"])
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 0)], denied=[("c", 195, 1)])
        state = await control.state("c1")
        assert state.is_granted("c", 195, 0, "rw") and not state.is_granted("c", 195, 1, "r")
        assert await control.remove("c1") is False  # the probe is inside
        probe.close()
        assert all(await collect([control.remove(f"c{i}") for i in range(4)]))
        assert await control.list_cgroups() == []


@pytest.mark.asyncio
@pytest.mark.parametrize("worker", DEVICE_WORKERS)
async def test_v2_through_the_actor_survives_a_restart(v2_sandbox, device_nodes, tmp_path, worker: str) -> None:
    kwargs = dict(hierarchy=v2_sandbox.hierarchy, cgroups_root=v2_sandbox.cgroups_root, work_dir=str(tmp_path),
                  worker=worker)
    async with Runtime():
        control = await DeviceControl.create("cgroups_v2", **kwargs)
        states = await collect([control.configure(f"c{i}", *container_policy([], [f"c 195:{i} rw"])) for i in range(4)])
        assert control.batches == BATCHES_FOR_FOUR[worker]
        await control.close()
    async with Runtime():
        control = await DeviceControl.create("cgroups_v2", **kwargs)
        assert [await control.state(f"c{i}") for i in range(4)] == states
        assert await control.reconcile("c2", states[2].allow, states[2].deny) == []
        probe = v2_sandbox.probe("c2")
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 2)], denied=[("c", 195, 1)])
        await control.reconfigure("c2", ["c 195:1 rw"], ["c 195:2 rw"])
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 1)], denied=[("c", 195, 2)])
        probe.close()
        assert all(await collect([control.remove(f"c{i}") for i in range(4)]))
        assert await control.list_cgroups() == []


@pytest.mark.asyncio
async def test_a_simulated_crash_fails_every_caller_of_its_batch() -> None:
    from actors.devices.testing import SimulatedCrash

    async with Runtime():
        inner = BatchRecordingBackend()
        control = await DeviceControl.create(backend_impl=FaultInjectingBackend(inner, crash_at=3))
        futures = [control.configure(f"c{i}", *POLICY) for i in (1, 2, 3)]
        for future in futures:
            with pytest.raises(SimulatedCrash):
                await future
        assert inner.list_cgroups() == ["c1"]  # applied before the "crash", then nothing
        await control.close()
    async with Runtime():
        control = await DeviceControl.create("memory", backend_impl=FaultInjectingBackend(MemoryBackend(), crash_at=1))
        with pytest.raises(SimulatedCrash):
            await control.configure("c1", *POLICY)
        assert await control.list_cgroups() == []


def test_group_commit_under_trio() -> None:
    import anyio

    async def main() -> tuple[int, int]:
        async with Runtime():
            control = await DeviceControl.create(backend_impl=BatchRecordingBackend())
            results = await collect([control.configure(f"c{i}", *POLICY) for i in range(10)])
            batches = control.batches
            await control.close()
            return len(results), batches

    assert anyio.run(main, backend="trio") == (10, 1)
