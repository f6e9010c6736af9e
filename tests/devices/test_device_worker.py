"""The device worker process: a kernel backend in a child process.

What it must show: the same results and kernel state as the backend in a
thread (v1 and v2, asyncio and trio), results coming back while a batch is
still applied, errors that stay with their operation, the backend's warnings
logged here, a child that dies failing its batch with a clear error and the
next operation starting a new child, start-up errors raised unchanged, the
child exiting when closed, and a batch larger than the pipe that never
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import threading
from typing import Any

import anyio
import pytest

from isolators import Flags, FlagsError
from actors.devices import Policy, DeviceControl, DeviceOperation, DeviceControlError, DeviceRule
from actors.devices import container_policy
from actors.devices import WorkerError, _frames, _worker, _worker_process
from runtime import Runtime, collect
from tests.support.probes import assert_verdicts
from tests.support.kernel import process_state, stop_process, wait_blocked_writing_a_pipe, wait_gone

R = DeviceRule.parse
GUARD = 10  # seconds: a hang guard, never a timing assertion


# -- frames (no kernel) ---------------------------------------------------------------
def test_a_frame_arriving_in_pieces_and_an_oversized_frame() -> None:
    reader = _frames.FrameReader()
    data = _frames.encode({"a": list(range(1000))}) + _frames.encode([("exists", ("c1",))])
    for i in range(0, len(data), 7):
        reader.feed(data[i : i + 7])
        if i + 7 < len(data) // 2:
            assert reader.next() is None
    assert reader.next() == {"a": list(range(1000))}
    assert reader.next() == [("exists", ("c1",))]
    assert reader.next() is None
    reader.feed((_frames.MAX_FRAME + 1).to_bytes(4, "little") + b"x")
    with pytest.raises(WorkerError, match="frame of .* bytes .*the peer is broken"):
        reader.next()


# -- flags and arguments ------------------------------------------------------------
def test_the_flag_and_the_argument_name_their_choices() -> None:
    assert Flags().device_worker == "process"
    assert Flags.from_args(["--device_worker=thread"]).device_worker == "thread"
    with pytest.raises(FlagsError, match=r"Invalid '--device_worker' 'fork': expected one of process, thread"):
        Flags(device_worker="fork")


@pytest.mark.asyncio
async def test_an_unknown_worker_and_a_bad_hierarchy_fail_create(tmp_path) -> None:
    async with Runtime():
        with pytest.raises(DeviceControlError, match=r"Unknown device worker 'fork': expected one of process, thread"):
            await DeviceControl.create("memory", worker="fork")
        if os.geteuid() != 0:
            pytest.skip("needs root")
        for worker in ("thread", "process"):
            with pytest.raises(DeviceControlError, match="is not a cgroups v1 devices hierarchy"):
                await DeviceControl.create("cgroups_v1", hierarchy=str(tmp_path), worker=worker)
        memory = await DeviceControl.create("memory", worker="process")  # in memory there is nothing to offload
        assert memory.backend_name == "memory" and memory.worker_pid is None
        await memory.close()


# -- the kernel --------------------------------------------------------------------------
async def _v1_control(sandbox: Any) -> DeviceControl:
    return await DeviceControl.create(
        "cgroups_v1", hierarchy=sandbox.hierarchy, cgroups_root=sandbox.cgroups_root, worker="process"
    )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_v1_in_the_worker_enforces_what_the_thread_would(v1_sandbox, device_nodes) -> None:
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        pid = control.worker_pid
        assert pid is not None and pid != os.getpid()
        assert control.path("c1") == os.path.join(v1_sandbox.root, "c1")
        states = await collect(
            [control.configure(f"c{i}", *container_policy([], [f"c 195:{i} rwm"])) for i in range(4)]
        )
        probe = v1_sandbox.probe("c1")
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 1)], denied=[("c", 195, 0)])
        assert await control.state("c1") == states[1]
        await control.reconfigure("c1", ["c 195:0 rwm"], ["c 195:1 rwm"])
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 0)], denied=[("c", 195, 1)])
        probe.close()
        assert await control.list_cgroups() == ["c0", "c1", "c2", "c3"]
        assert all(await collect([control.remove(f"c{i}") for i in range(4)]))
        assert await control.exists("c1") is False
        await control.close()
    assert wait_gone(pid), "the device worker process outlived its device control"


@pytest.mark.asyncio
async def test_a_batch_keeps_each_error_with_its_operation_and_results_come_in_parts(
    v1_sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        allow, deny = container_policy([], ["c 195:0 rwm"])
        calls = []
        for i in range(40):
            calls.append(control.configure(f"c{i}", allow, deny))
            if i == 20:
                calls.append(control.reconfigure("missing", ["c 195:1 rwm"]))
                calls.append(control.configure("c0", allow, ["c 1:3 rwm"]))  # denies what it allows
        pending_when_told: list[int] = []  # results come in parts: callers told while others still wait
        for call in calls:
            call.on_any(lambda _f: pending_when_told.append(sum(c.is_pending() for c in calls)))
        results = await collect([call.recover(lambda error: error) for call in calls])
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert [i for i, _ in failed] == [21, 22]
        assert isinstance(failed[0][1], DeviceControlError)
        assert "Cannot reconfigure cgroup 'missing'" in str(failed[0][1])
        assert "allow entry 'c 1:3 rwm' cannot be encompassed by deny entry 'c 1:3 rwm'" in str(failed[1][1])
        assert len(pending_when_told) == len(calls)
        assert any(0 < pending < len(calls) - 1 for pending in pending_when_told)  # told before the batch ended
        assert (await control.state("c5")).is_granted("c", 195, 0, "rw")
        assert all(await collect([control.remove(f"c{i}") for i in range(40)]))
        await control.close()


@pytest.mark.asyncio
async def test_an_operation_the_worker_does_not_know_fails_alone(v1_sandbox) -> None:
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        allow, deny = container_policy([], ["c 195:0 rwm"])
        calls = [control.configure("c1", allow, deny),
                 control._process.submit(DeviceOperation("chmod", ("c1",))),  # not a backend operation
                 control.exists("c1")]
        results = await collect([call.recover(lambda error: error) for call in calls])
        assert isinstance(results[1], ValueError) and str(results[1]) == "Unknown device operation 'chmod'"
        assert results[0].is_granted("c", 195, 0, "rw") and results[2] is True
        assert await control.remove("c1") is True
        await control.close()


@pytest.mark.asyncio
async def test_the_backends_warnings_are_logged_here(v1_sandbox, caplog: pytest.LogCaptureFixture) -> None:
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        await control.configure("busy", *container_policy([], []))
        probe = v1_sandbox.probe("busy")
        with caplog.at_level(logging.WARNING, logger="actors.devices"):
            assert await control.remove("busy") is False
        warnings = [r for r in caplog.records if r.name == "actors.devices._cgroups_v1"]
        assert warnings and "still has processes" in warnings[0].getMessage()
        assert os.path.join(v1_sandbox.root, "busy") in warnings[0].getMessage()
        probe.close()
        assert await control.remove("busy") is True
        await control.close()


@pytest.mark.asyncio
async def test_a_killed_idle_worker_is_replaced_by_the_next_call(v1_sandbox, device_nodes, caplog) -> None:
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        await control.configure("kept", *container_policy([], ["c 195:2 rwm"]))
        first = control.worker_pid
        os.kill(first, signal.SIGKILL)
        assert wait_gone(first)
        # the next call starts a new child; nothing was lost; what the kernel held is intact
        assert await control.configure("next", *container_policy([], [])) is not None
        assert await control.exists("kept") is True
        assert control._process.driver.starts == 2 and control.worker_pid not in (None, first)
        assert any(f"Device worker process {first} exited with status -9" in r.getMessage() for r in caplog.records)
        probe = v1_sandbox.probe("kept")
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 2)], denied=[("c", 195, 0)])
        probe.close()
        assert all(await collect([control.remove(name) for name in ("kept", "next")]))
        await control.close()


@pytest.mark.asyncio
async def test_v2_in_the_worker_survives_a_restart_read_back_from_the_kernel(v2_sandbox, device_nodes, tmp_path) -> None:
    kwargs = dict(hierarchy=v2_sandbox.hierarchy, cgroups_root=v2_sandbox.cgroups_root, work_dir=str(tmp_path),
                  worker="process")
    async with Runtime():
        control = await DeviceControl.create("cgroups_v2", **kwargs)
        assert control.worker_pid is not None and control.backend_name == "cgroups_v2"
        states = await collect([control.configure(f"c{i}", *container_policy([], [f"c 195:{i} rw"])) for i in range(3)])
        v2_sandbox.attached("c1")
        await control.close()
    async with Runtime():
        control = await DeviceControl.create("cgroups_v2", **{**kwargs, "worker": "thread"})
        assert [await control.state(f"c{i}") for i in range(3)] == states  # the worker's programs, read back
        await control.close()
    async with Runtime():
        control = await DeviceControl.create("cgroups_v2", **kwargs)
        assert [await control.state(f"c{i}") for i in range(3)] == states
        probe = v2_sandbox.probe("c1")
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 1)], denied=[("c", 195, 0)])
        await control.reconfigure("c1", ["c 195:0 rw"], ["c 195:1 rw"])
        assert_verdicts(probe, device_nodes, granted=[("c", 195, 0)], denied=[("c", 195, 1)])
        v2_sandbox.attached("c1")
        probe.close()
        assert all(await collect([control.remove(f"c{i}") for i in range(3)]))
        await control.close()


async def held_mid_batch(control: DeviceControl, calls_of: Any) -> tuple[Any, list]:
    """``calls_of()``'s calls, returned once the worker waits in write(2) mid-batch:
    the loop stops reading its results, whose pipe holds one page, so it reports
    what fits and then applies nothing more -- a known point to kill or stop
    it at. ``read_results(child)`` has the loop read them again."""
    child = control._process.driver._child
    fcntl.fcntl(child.read_fd, fcntl.F_SETPIPE_SZ, 4096)
    asyncio.get_running_loop().remove_reader(child.read_fd)
    calls = calls_of()
    blocked = await anyio.to_thread.run_sync(wait_blocked_writing_a_pipe, child.pid)
    assert blocked, "the worker never filled its result pipe"
    return child, calls


def read_results(child: Any) -> None:
    asyncio.get_running_loop().add_reader(child.read_fd, child._on_readable)


@pytest.mark.asyncio
async def test_a_worker_killed_mid_batch_fails_only_the_operations_not_yet_reported(v1_sandbox) -> None:
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        await control.exists("warm")  # the next batch is sent whole
        policy = container_policy([], ["c 195:0 rwm"])
        hold = control.exists("warm")  # keeps the worker busy so that the 400 go as one batch
        child, calls = await held_mid_batch(control, lambda: [control.configure(f"c{i}", *policy) for i in range(400)])
        killed = [child.pid]
        os.kill(child.pid, signal.SIGKILL)
        read_results(child)  # what it reported is read, then its end
        await hold
        results = await collect([call.recover(lambda error: error) for call in calls])
        reported = [r for r in results if not isinstance(r, BaseException)]
        lost = [r for r in results if isinstance(r, BaseException)]
        assert killed and reported and lost, (len(reported), len(lost))
        assert results[: len(reported)] == reported  # a prefix was told, the rest failed
        assert all(isinstance(e, WorkerError) for e in lost)
        assert f"Device worker process {killed[0]} exited with status -9 holding {len(lost)} device" in str(lost[0])
        assert "(their effects are unknown: read the kernel state back)" in str(lost[0])
        # a new worker; every cgroup the dead one made can be found and removed
        made = await control.list_cgroups()
        assert len(made) >= len(reported)
        assert all(await collect([control.remove(name) for name in made]))
        assert control._process.driver.starts == 2
        await control.close()


@pytest.mark.asyncio
async def test_termination_fails_what_the_worker_has_not_reported_and_the_child_exits(v1_sandbox) -> None:
    from runtime import ProcessTerminated

    async with Runtime():
        control = await _v1_control(v1_sandbox)
        pid = control.worker_pid
        policy = container_policy([], [])
        child, calls = await held_mid_batch(control, lambda: [control.configure(f"c{i}", *policy) for i in range(600)])
        stop_process(pid)  # what it wrote is read, and nothing more comes meanwhile
        read_results(child)
        await calls[0]  # reported before the termination
        asyncio.get_running_loop().remove_reader(child.read_fd)
        os.kill(pid, signal.SIGCONT)  # it goes on until its pipe is full again
        await control.close()
        results = await collect([call.recover(lambda error: error) for call in calls])
        terminated = [r for r in results if isinstance(r, ProcessTerminated)]
        assert terminated and all(isinstance(r, (ProcessTerminated, Policy)) for r in results)
        assert isinstance(results[0], Policy)  # what was reported stands
        assert "terminated before the operation completed" in str(terminated[0])
    assert wait_gone(pid)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_batch_larger_than_the_pipe_never_blocks_the_loop(v1_sandbox, monkeypatch) -> None:
    sends: list[bool] = []
    original = _worker_process.WorkerProcess.send
    monkeypatch.setattr(_worker_process.WorkerProcess, "send", lambda child, entries: sends.append(original(child, entries)) or sends[-1])
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        await control.exists("warm")
        child = control._process.driver._child
        names = [f"{'n' * 200}{i}" for i in range(3000)]  # ~0.6 MB of frame, the pipe holds 64 KiB
        # The child is stopped: it reads nothing, so what the pipe does not take
        # must wait in the outbox while the loop goes on. (Should a write block the
        # loop instead, the guard lets the child go on after GUARD seconds, so the
        # test fails rather than hangs.)
        guard = threading.Timer(GUARD, os.kill, (child.pid, signal.SIGCONT))
        stop_process(child.pid)
        guard.start()
        try:
            calls = [control.exists(name) for name in names]
            with anyio.fail_after(GUARD):
                while not child.outbox:
                    await anyio.sleep(0)
            for _ in range(100):  # the loop serves this task while the frame cannot go out
                await anyio.sleep(0)
            assert child.outbox and process_state(child.pid) == "T", "the loop waited for the stopped child"
        finally:
            guard.cancel()
            os.kill(child.pid, signal.SIGCONT)
        assert any(not complete for complete in sends), "the big batch should not have fit in the pipe"
        with anyio.fail_after(GUARD):
            results = await collect(calls)  # the rest of the frame goes out as the child reads
        assert results == [False] * len(names)
        assert await control.configure("after", *container_policy([], [])) is not None
        assert await control.remove("after") is True
        await control.close()


@pytest.mark.asyncio
async def test_a_worker_that_cannot_start_leaves_device_control_in_a_thread(
    v1_sandbox, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    async with Runtime():
        with caplog.at_level(logging.WARNING, logger="actors.devices"):
            control = await _v1_control(v1_sandbox)
        assert control.worker_pid is None
        warning = [r.getMessage() for r in caplog.records if r.name == "actors.devices._control"]
        assert warning and "Failed to start the device worker process" in warning[0]
        assert "device control for cgroups_v1 uses a thread of this process instead" in warning[0]
        assert await control.configure("c1", *container_policy([], [])) is not None
        assert await control.remove("c1") is True
        await control.close()


@pytest.mark.asyncio
async def test_a_queue_longer_than_a_frame_goes_as_several_batches_in_order(
    v1_sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_worker, "MAX_WORKER_BATCH", 50)
    sizes: list[int] = []
    original = _worker_process.WorkerProcess.send
    monkeypatch.setattr(_worker_process.WorkerProcess, "send", lambda child, entries: (sizes.append(len(entries)), original(child, entries))[1])
    async with Runtime():
        control = await _v1_control(v1_sandbox)
        policy = container_policy([], [])
        calls = [control.configure("c1", *policy)] + [control.exists("c1") for _ in range(199)]
        results = await collect(calls)
        assert results[1:] == [True] * 199  # in arrival order: every exists sees the configure
        assert max(sizes) <= 50 and sum(sizes) == 200
        assert await control.remove("c1") is True
        await control.close()
