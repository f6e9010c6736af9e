"""The isolator when the device worker dies mid-call (issue 20 items 1 and 2),
on cgroups v1 and v2, judged by the kernel: a probe process in each cgroup
opens mknod'ed GPU nodes (ENXIO = granted, EPERM = denied).

The worker is stopped (SIGSTOP) before the call, so the call's batch is
written to it and never answered; when the test needs "the worker applied it
and died before saying so", the test applies the same change to the kernel
itself (what the worker would have done), then the worker is killed
(SIGKILL). Device control then fails the call with a ``WorkerError`` (its
effects are unknown) and the isolator must not release a GPU on a guess:
- a growing update keeps the extra GPU out of the pool until the kernel is
  made to match the record again (or read back), then releases it;
- a cleanup whose removal was lost keeps the record and its GPUs (the call
  fails; a retry finishes it, EBUSY included);
- a shrink whose rule write was lost keeps every GPU with the container;
- a cleanup that is the first call to the next worker, after a kill, of a
  container with a live process (EBUSY) leaves it lingering and denied
  every GPU before another container gets them.
Every wait is bounded."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import pytest

import runtime
from actors.devices import DeviceRule, WorkerError, _worker_child
from isolators import IsolatorError, Resources
from tests.support.containers import C, cleanup_until_removed, config, free_gpus, started_with
from tests.support.probes import DENIED, GRANTED
from tests.support.errors import isolator_failure
from tests.support.nodes import judge
from tests.support.kernel import stop_process, wait_gone


def wait_exit(pid: int) -> None:
    """Until ``pid`` is gone or a zombie (bounded)."""
    assert wait_gone(pid), f"device worker {pid} did not exit"


class StoppedWorker:
    """The isolator's device worker, stopped: what is sent to it is never answered."""

    def __init__(self, isolator: Any) -> None:
        self.devices = isolator.devices
        self.pid = self.devices.worker_pid
        assert self.pid is not None, "the isolator runs no device worker process"

    def __enter__(self) -> "StoppedWorker":
        stop_process(self.pid)
        self.sent_before = self.devices.operations
        return self

    async def sent(self, count: int = 1) -> None:
        """Until ``count`` more device operations went to the (stopped) worker:
        submitted, and every byte of them written into its pipe."""
        driver = self.devices._process.driver
        with anyio.fail_after(10):
            while (self.devices.operations < self.sent_before + count or driver._queue
                   or driver._child is None or driver._child.outbox):
                await anyio.sleep(0.001)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        wait_exit(self.pid)

    def __exit__(self, *exc: Any) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def applied_by_the_dead_worker(node: Any, cgroup: str, rule: DeviceRule) -> None:
    """Grant ``rule`` to ``cgroup`` in the kernel, as the worker would have."""
    if node.backend == "cgroups_v1":
        with open(os.path.join(node.cgroup_dir(cgroup), "devices.allow"), "w") as allow:
            allow.write(str(rule))
        return
    backend = node.inner_backend()  # the attached program, as the worker writes it
    try:
        backend.reconfigure(cgroup, [rule], [])
    finally:
        backend.close()


async def failed_with_unknown_effects(call: Any, worker: StoppedWorker) -> IsolatorError:
    """The call fails with exactly an IsolatorError carrying the WorkerError's text: the killed
    worker held its operation, whose effects are unknown."""
    with anyio.fail_after(30):
        error = await isolator_failure(
            call, f"Device worker process {worker.pid} exited with status -9 holding 1 device operations (their"
            " effects are unknown: read the kernel state back); the next operation starts a new one")
    assert type(error.__cause__) is WorkerError and str(error.__cause__) == str(error), repr(error.__cause__)
    return error


async def killed_while_sent(isolator: Any, call_of: Any) -> IsolatorError:
    """``call_of()`` goes to the stopped worker, which is killed before it
    answers: the call fails, its effects unknown."""
    with StoppedWorker(isolator) as worker:
        call = call_of()
        await worker.sent()
        worker.kill()
        return await failed_with_unknown_effects(call, worker)


@pytest.mark.asyncio
async def test_a_grow_whose_worker_died_after_granting_releases_nothing_on_a_guess(
    kernel_node, char_nodes, probes
) -> None:
    node = kernel_node
    gpu = {m: char_nodes[(195, m)] for m in range(4)}
    async with runtime.Runtime():
        components, isolator = await started_with(node, a=1)  # GPU 0
        probe_a = probes()
        probe_a.move_to(node.cgroup_dir("a"))
        assert (probe_a.access(gpu[0]), probe_a.access(gpu[1])) == (GRANTED, DENIED)
        with StoppedWorker(isolator) as worker:
            grow = isolator.update(C("a"), Resources.parse("gpus:2"))  # GPU 1's grant goes to the stopped worker
            await worker.sent()
            applied_by_the_dead_worker(node, "a", DeviceRule("c", 195, 1, "rwm"))
            assert probe_a.access(gpu[1]) == GRANTED  # the kernel has it; the worker never says so
            worker.kill()
            await failed_with_unknown_effects(grow, worker)
        # The update failed and changes nothing: GPU 1 went back only once the
        # kernel stopped granting it to a.
        assert await isolator.containers() == {"a": [0]}
        assert (probe_a.access(gpu[0]), probe_a.access(gpu[1])) == (GRANTED, DENIED)
        await judge(node, {"a": 1})
        await isolator.prepare(C("b"), config(1))
        assert await isolator.containers() == {"a": [0], "b": [1]}
        probe_b = probes()
        probe_b.move_to(node.cgroup_dir("b"))
        assert (probe_b.access(gpu[1]), probe_a.access(gpu[1])) == (GRANTED, DENIED)  # one holder
        await judge(node, {"a": 1, "b": 1})
        probe_a.close()
        probe_b.close()
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_grow_whose_worker_died_before_granting_releases_after_reading_back(
    kernel_node, char_nodes, probes
) -> None:
    node = kernel_node
    async with runtime.Runtime():
        components, isolator = await started_with(node, a=1)
        await killed_while_sent(isolator, lambda: isolator.update(C("a"), Resources.parse("gpus:3")))
        assert await isolator.containers() == {"a": [0]}
        assert await free_gpus(node) == {1, 2, 3}
        await judge(node, {"a": 1})
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_cleanup_whose_worker_died_keeps_the_record_and_its_gpus(kernel_node, char_nodes, probes) -> None:
    node = kernel_node
    gpu = {m: char_nodes[(195, m)] for m in range(4)}
    async with runtime.Runtime():
        components, isolator = await started_with(node, a=1)  # GPU 0
        probe_a = probes()
        probe_a.move_to(node.cgroup_dir("a"))  # a live process: the kernel refuses to remove a
        await killed_while_sent(isolator, lambda: isolator.cleanup(C("a")))
        # Not forgotten: the record and GPU 0 stay; nobody else gets GPU 0.
        assert await isolator.containers() == {"a": [0]}
        assert probe_a.access(gpu[0]) == GRANTED
        await isolator.prepare(C("b"), config(1))
        assert await isolator.containers() == {"a": [0], "b": [1]}
        await judge(node, {"a": 1, "b": 1})
        # The retry finishes it: EBUSY, so GPU 0 is denied to the process, then released.
        await isolator.cleanup(C("a"))
        assert probe_a.access(gpu[0]) == DENIED
        assert await isolator.containers() == {"b": [1]}
        await judge(node, {"b": 1}, extra_cgroups={"a"})
        probe_a.close()
        await cleanup_until_removed(node, isolator, "a")  # the process is gone: a cleanup of that id removes it now
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_shrink_whose_worker_died_keeps_every_gpu_with_the_container(
    kernel_node, char_nodes, probes
) -> None:
    node = kernel_node
    async with runtime.Runtime():
        components, isolator = await started_with(node, a=2)  # GPUs 0, 1
        await killed_while_sent(isolator, lambda: isolator.update(C("a"), Resources.parse("gpus:1")))
        assert await isolator.containers() == {"a": [0, 1]}
        assert await free_gpus(node) == {2, 3}
        await isolator.reconcile()  # the kernel made to match the record again, whatever the worker did
        await judge(node, {"a": 2})
        await isolator.update(C("a"), Resources.parse("gpus:1"))  # and the shrink can be done again
        await judge(node, {"a": 1})
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_prepare_whose_worker_died_after_configuring_is_undone_by_the_kernel(
    kernel_node, char_nodes, probes
) -> None:
    node = kernel_node
    async with runtime.Runtime():
        components, isolator = await started_with(node, keep=1)  # GPU 0
        with StoppedWorker(isolator) as worker:
            prepare = isolator.prepare(C("c1"), config(2))  # GPUs 1, 2: their configure goes to the stopped worker
            await worker.sent()
            # What the worker would have done before dying: the cgroup, granting GPUs 1 and 2.
            backend = node.inner_backend()
            try:
                backend.configure("c1", isolator.process.policies.of(
                    {g for g in components.allocator.total() if g.minor in (1, 2)}))
            finally:
                getattr(backend, "close", lambda: None)()
            assert node.cgroup_exists("c1")
            worker.kill()
            await failed_with_unknown_effects(prepare, worker)
        # Undone through the kernel: the cgroup removed first, then the GPUs back.
        assert not node.cgroup_exists("c1")
        assert await isolator.containers() == {"keep": [0]}
        assert await free_gpus(node) == {1, 2, 3}
        await judge(node, {"keep": 1})
        await node.clean_all()


@pytest.mark.asyncio
async def test_a_cleanup_while_a_killed_worker_restarts_never_lets_two_containers_share_a_gpu(
    kernel_node, char_nodes, probes
) -> None:
    """Item 1's consequence: a holds every GPU and has a live process; its
    device worker is SIGKILLed and cleanup(a) is the call that starts the
    next one. The kernel refuses a's rmdir (EBUSY): a must linger denied
    every GPU before they go back, so that b, given them all, is the only
    one that opens them (the race once gave cleanup(a) the new worker's
    ready frame as its result: "removed", a forgotten still granted)."""
    node = kernel_node
    gpu = {m: char_nodes[(195, m)] for m in range(4)}
    async with runtime.Runtime():
        components, isolator = await node.start()
        for round_ in range(2):
            a, b = C(f"a{round_}"), C(f"b{round_}")
            await isolator.prepare(a, config(4))
            probe_a = probes()
            probe_a.move_to(node.cgroup_dir(str(a)))  # a live process: the kernel refuses to remove a
            assert [probe_a.access(gpu[m]) for m in range(4)] == [GRANTED] * 4
            pid = isolator.devices.worker_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_exit(pid)
            with anyio.fail_after(30):
                assert await isolator.cleanup(a) is None  # sent while the next worker starts
                await isolator.prepare(b, config(4))
            assert isolator.devices.worker_pid not in (None, pid)
            assert await isolator.containers() == {str(b): [0, 1, 2, 3]}
            assert node.cgroup_exists(str(a))  # EBUSY: it lingers ...
            assert [probe_a.access(gpu[m]) for m in range(4)] == [DENIED] * 4  # ... denied every GPU
            probe_b = probes()
            probe_b.move_to(node.cgroup_dir(str(b)))
            assert [probe_b.access(gpu[m]) for m in range(4)] == [GRANTED] * 4
            await judge(node, {str(b): 4}, extra_cgroups={str(a)})
            probe_a.close()
            probe_b.close()
            await cleanup_until_removed(node, isolator, a)  # its process gone: a cleanup of that id removes it
            await isolator.cleanup(b)
        await judge(node, {})
        await node.clean_all()


HANGS = "import time; time.sleep(120)"
"""A device worker that never answers its first frame."""


@pytest.mark.asyncio
async def test_a_failed_prepare_whose_cgroup_cannot_be_removed_holds_back_every_free_gpu(
    kernel_node, char_nodes, probes, monkeypatch
) -> None:
    """A prepare's configure dies with its worker after the mkdir, before any
    rule (v1: the cgroup then grants what its parent grants, every device;
    v2: no program, every device), and the next worker never starts, so the
    undo cannot remove the cgroup: it lingers, and its device state is
    unknown. Not only its own GPU but every free one is held back until it
    is removed (the random fault run found another container given GPUs
    such a cgroup could open), and so is a GPU another container releases
    meanwhile."""
    from actors.devices import _worker

    node = kernel_node
    gpu = {m: char_nodes[(195, m)] for m in range(4)}
    async with runtime.Runtime():
        components, isolator = await started_with(node, keep=1)  # GPU 0
        with StoppedWorker(isolator) as worker:
            prepare = isolator.prepare(C("c1"), config(1))  # GPU 1: its configure goes to the stopped worker
            await worker.sent()
            os.mkdir(node.cgroup_dir("c1"))  # what the worker did before it died
            monkeypatch.setattr(_worker, "BOOT", HANGS)  # the next worker never answers ...
            monkeypatch.setattr(_worker, "START_TIMEOUT", 0.5)  # ... so the undo's removal fails
            worker.kill()
            await failed_with_unknown_effects(prepare, worker)
        assert node.cgroup_exists("c1")
        probe = probes()
        probe.move_to(node.cgroup_dir("c1"))
        assert [probe.access(gpu[m]) for m in range(4)] == [GRANTED] * 4  # the kernel: it may reach every GPU
        assert set(await components.allocator.available()) == set()  # so none of them is free
        with pytest.raises(IsolatorError, match="Requested 1 gpus but only 0 available"):
            await isolator.prepare(C("c2"), config(1))
        probe.close()
        monkeypatch.setattr(_worker, "BOOT", _worker_child.BOOT)
        with anyio.fail_after(30):
            await isolator.cleanup(C("keep"))  # GPU 0 released while c1 may reach it ...
        assert await free_gpus(node) == set()  # ... stays held back for c1
        with pytest.raises(IsolatorError, match="Requested 1 gpus but only 0 available"):
            await isolator.prepare(C("c2"), config(1))
        with anyio.fail_after(30):
            await isolator.cleanup(C("c1"))  # removes it: the GPUs go back
        assert not node.cgroup_exists("c1")
        assert await free_gpus(node) == {0, 1, 2, 3}
        await judge(node, {})
        await node.clean_all()
