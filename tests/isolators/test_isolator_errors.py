"""One error type (SPEC 11, issue 13): every failure of an isolator method is
an ``isolators.IsolatorError`` with the text of whoever failed (the
allocator's "Requested N gpus but only M available", device control's kernel
error), the original chained as ``__cause__``; a prepare whose undo cannot
remove its cgroup keeps it lingering with its GPUs (never allocated with no
record) until a cleanup or reconcile frees them; host probing at create
never runs on the event loop."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import pytest

import runtime
from actors.allocator import AllocatorError
from actors.devices import DeviceControlError, KernelOperationError
from isolators import ContainerID, IsolatorError, NvidiaComponents, NvidiaGpuIsolatorProcess, Repair
from isolators import Resources
from isolators import _startup
from tests.support.containers import config
from tests.support.errors import injected, isolator_failure as failure
from tests.support.nodes import judge
from tests.support.kernel import BACKENDS


NO_MANIFEST = "The 'ContainerConfig' for docker is missing a manifest"


@pytest.mark.asyncio
async def test_allocator_exhaustion_is_an_isolator_error_with_the_allocators_text(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("a"), config("gpus:3"))
        error = await failure(isolator.prepare(ContainerID("b"), config("gpus:2")))
        assert str(error) == "Requested 2 gpus but only 1 available"
        assert type(error.__cause__) is AllocatorError and str(error.__cause__) == str(error)
        error = await failure(isolator.update(ContainerID("a"), Resources.parse("gpus:5")))
        assert str(error) == "Requested 2 gpus but only 1 available"
        assert type(error.__cause__) is AllocatorError
        assert await isolator.containers() == {"a": [0, 1, 2]}
        await isolator.cleanup(ContainerID("a"))


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_kernel_error_is_an_isolator_error_with_device_controls_text(backend: str, node_factory) -> None:
    node = node_factory(backend)
    async with runtime.Runtime():
        _c, isolator = await node.start(fault={})
        node.fault.arm(1, errno=errno.ENOSPC)
        path = isolator.devices.path("c1")
        operation, target = ("mkdir", path)  # every backend: the container's mkdir first (then its root if missing)
        error = await failure(isolator.prepare(ContainerID("c1"), config("gpus:1")),
                              injected(operation, target, errno.ENOSPC))
        assert isinstance(error.__cause__, KernelOperationError) and error.__cause__.errno == errno.ENOSPC
        assert str(error) == str(error.__cause__)
        node.fault.arm(None)
        await isolator.prepare(ContainerID("c1"), config("gpus:1"))
        node.fault.arm(1, errno=errno.EIO)
        operation, target = {"memory": ("apply", path), "cgroups_v1": ("mkdir", path),  # EEXIST: it exists
                             "cgroups_v2": ("open", path)}[backend]
        error = await failure(isolator.update(ContainerID("c1"), Resources.parse("gpus:2")),
                              injected(operation, target, errno.EIO))
        assert isinstance(error.__cause__, DeviceControlError)
        node.fault.arm(None)
        await judge(node, {"c1": 1})
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_an_nvml_failure_in_usage_is_an_isolator_error(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        await isolator.prepare(ContainerID("c1"), config("gpus:1"))

        async def broken(gpus: Any) -> Any:
            raise OSError(5, "NVML went away")

        components.nvml.usages = broken
        error = await failure(isolator.usage(ContainerID("c1")), "[Errno 5] NVML went away")
        assert type(error.__cause__) is OSError
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_a_device_control_that_cannot_start_fails_create_with_an_isolator_error(memory_node) -> None:
    async with runtime.Runtime():
        flags = memory_node.flags(device_backend="cgroups_v1", cgroups_hierarchy=memory_node.tmp)  # not a hierarchy
        components = await NvidiaComponents.create(flags)
        try:
            error = await failure(NvidiaGpuIsolatorProcess.create(flags, components),
                                  f"'{memory_node.tmp}' is not a cgroups v1 devices hierarchy (no devices.allow);"
                                  " mount the devices controller or choose another device backend")
            assert isinstance(error.__cause__, DeviceControlError) and str(error) == str(error.__cause__)
        finally:
            await components.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_undo_that_cannot_remove_the_cgroup_keeps_it_lingering_with_its_gpus(
    backend: str, node_factory
) -> None:
    node = node_factory(backend)
    rootfs = os.path.join(node.tmp, "rootfs")
    os.makedirs(rootfs)
    no_manifest = config("gpus:2", rootfs=rootfs)  # fails after its configure: the undo removes the cgroup
    async with runtime.Runtime():
        components, isolator = await node.start(fault={})
        await isolator.prepare(ContainerID("keep"), config("gpus:1"))

        async def fail_the_undo() -> IsolatorError:
            for _ in range(2):  # the second run counts with the v2 program cache warm, as the failing one
                node.fault.arm(None)
                await failure(isolator.prepare(ContainerID("c1"), no_manifest), NO_MANIFEST)
            node.fault.arm([op for op, _target in node.fault.log].index("rmdir") + 1, errno=errno.EIO)
            error = await failure(isolator.prepare(ContainerID("c1"), no_manifest),
                                  NO_MANIFEST)  # the original error, not the undo's
            assert node.fault.injected and node.fault.log[-1][0] == "rmdir"
            node.fault.arm(None)
            return error

        await fail_the_undo()
        # The cgroup stays and may grant GPUs 1 and 2: they stay allocated, with a record of why.
        assert node.cgroup_exists("c1")
        assert await isolator.containers() == {"keep": [0]}
        assert {g.minor for g in await components.allocator.available()} == {3}
        # A prepare of that id removes it first; while it cannot, the prepare is refused.
        node.fault.arm(1, errno=errno.EIO)  # its first kernel operation: the rmdir
        await failure(isolator.prepare(ContainerID("c1"), config("gpus:1")),
                      "Container c1: the cgroup 'c1' of an earlier container with this id could not be removed"
                      f" ({injected('rmdir', isolator.devices.path('c1'), errno.EIO)}); it cannot be prepared"
                      " again until it is gone")
        assert node.cgroup_exists("c1") and {g.minor for g in await components.allocator.available()} == {3}
        node.fault.arm(None)
        assert await isolator.prepare(ContainerID("c1"), config("gpus:1")) is None
        assert await isolator.containers() == {"keep": [0], "c1": [1]}
        await judge(node, {"keep": 1, "c1": 1})
        await isolator.cleanup(ContainerID("c1"))
        await judge(node, {"keep": 1})

        # The same through cleanup, and through reconcile.
        for settle in ("cleanup", "reconcile"):
            await fail_the_undo()
            assert {g.minor for g in await components.allocator.available()} == {3}
            if settle == "cleanup":
                await isolator.cleanup(ContainerID("c1"))
            else:
                repairs = await isolator.reconcile()
                assert repairs == [Repair("c1", "removed the cgroup 'c1' left behind; released GPUs [1, 2]")]
            assert not node.cgroup_exists("c1")
            assert {g.minor for g in await components.allocator.available()} == {1, 2, 3}
            await judge(node, {"keep": 1})
        await isolator.cleanup(ContainerID("keep"))


@pytest.mark.asyncio
async def test_create_probes_the_host_off_the_event_loop(memory_node, monkeypatch) -> None:
    loop_thread = threading.get_ident()
    seen: list[tuple[str, bool]] = []
    real_enabled = _startup.devices_subsystem_enabled
    real_find = _startup.find_control_devices

    def enabled() -> bool:
        seen.append(("/proc/cgroups", threading.get_ident() == loop_thread))
        return real_enabled()

    def find(*args: Any) -> Any:
        seen.append(("control devices", threading.get_ident() == loop_thread))
        return real_find(*args)

    monkeypatch.setattr(_startup, "devices_subsystem_enabled", enabled)
    monkeypatch.setattr(_startup, "find_control_devices", find)
    async with runtime.Runtime():
        flags = memory_node.flags(isolation="filesystem/linux,cgroups/all,gpu/nvidia")
        components = await NvidiaComponents.create(flags)
        try:
            if real_enabled():
                isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
                await isolator.close()
            else:
                await failure(NvidiaGpuIsolatorProcess.create(flags, components))
        finally:
            await components.close()
    assert [name for name, _ in seen][:1] == ["/proc/cgroups"]
    assert seen and not any(on_loop for _, on_loop in seen), seen
