"""Device control's metrics (``devices/operations``, ``devices/batches``,
``devices/worker_restarts``): the actor's own counts, read when a snapshot is
taken; group commit shows as fewer batches than operations; a killed device
worker shows as a restart; everything goes with the actor."""

from __future__ import annotations

import os
import signal
import uuid

import anyio
import pytest

from actors.devices import DeviceControl, container_policy
from runtime import Runtime, collect, current_runtime

pytestmark = pytest.mark.asyncio

NAMES = ("devices/operations", "devices/batches", "devices/worker_restarts")
GPU0 = container_policy([], ["c 195:0 rwm"])


def device_metrics() -> dict[str, float]:
    snap = current_runtime().metrics.snapshot()
    return {name: snap[name] for name in NAMES if name in snap}


async def test_in_memory_each_operation_is_one_batch_and_the_metrics_go_with_the_actor() -> None:
    async with Runtime():
        control = await DeviceControl.create("memory", cgroups_root=f"metrics-{uuid.uuid4().hex[:8]}")
        await collect([control.configure(f"c{i}", *GPU0) for i in range(5)])
        assert await control.remove("c0") is True
        assert device_metrics() == {"devices/operations": 6, "devices/batches": 6, "devices/worker_restarts": 0}
        await collect([control.remove(f"c{i}") for i in range(1, 5)])
        await control.close()
        assert device_metrics() == {}


async def test_group_commit_in_a_thread_shows_fewer_batches_than_operations(v1_sandbox) -> None:
    async with Runtime():
        control = await DeviceControl.create("cgroups_v1", hierarchy=v1_sandbox.hierarchy,
                                             cgroups_root=v1_sandbox.cgroups_root, worker="thread")
        with anyio.fail_after(30):
            await collect([control.configure(f"c{i}", *GPU0) for i in range(20)])
            await collect([control.remove(f"c{i}") for i in range(20)])
        metrics = device_metrics()
        assert metrics["devices/operations"] == control.operations == 40
        assert metrics["devices/batches"] == control.batches < 40
        assert metrics["devices/worker_restarts"] == 0
        await control.close()
        assert device_metrics() == {}


async def test_a_killed_device_worker_counts_as_one_restart(v1_sandbox, tmp_path) -> None:
    async with Runtime():
        control = await DeviceControl.create("cgroups_v1", hierarchy=v1_sandbox.hierarchy,
                                             cgroups_root=v1_sandbox.cgroups_root,
                                             work_dir=str(tmp_path / "work"), worker="process")
        first = control.worker_pid
        assert first is not None, "device control runs no worker process"
        await control.configure("c1", *GPU0)
        assert device_metrics()["devices/worker_restarts"] == 0
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(30):  # the next call starts a new worker
            while True:
                try:
                    await control.configure("c1", *GPU0)
                    break
                except Exception:  # the call the dead worker held: effects unknown, ask again
                    await anyio.sleep(0.01)
        assert control.worker_pid not in (None, first)
        metrics = device_metrics()
        assert metrics["devices/worker_restarts"] == 1
        assert metrics["devices/batches"] == control.batches
        assert await control.remove("c1") is True
        await control.close()
        assert device_metrics() == {}
