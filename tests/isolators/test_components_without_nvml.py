"""R-NV-1: ``host_file=None`` means the real NVML and nothing else.

Every test here puts the process in the "no NVML" state on purpose
(``actors.nvml.testing.nvml_library_missing``: pynvml's own loader cannot
open ``libnvidia-ml.so.1``), so none depends on the accident of a machine
without a GPU. Without NVML: ``NvidiaComponents.create`` fails with an
``IsolatorError`` naming NVML's error and the host-file way out, nothing is
spawned or written, and ``NvidiaGpuAllocator.resources`` and ``create``
agree (nothing is managed that NVML did not report).
"""

from __future__ import annotations

import os

import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError
from actors.nvml import NvmlUnavailable, nvml_available
from actors.nvml.testing import nvml_library_missing
from isolators import IsolatorError, NvidiaComponents, Resources
from runtime import Runtime, snapshot

NO_LIBRARY = (
    "nvmlInit failed: NVML Shared Library Not Found (NVML_ERROR_LIBRARY_NOT_FOUND); is the NVIDIA"
    " driver installed and loaded? Without one, set '--host_file' (Flags.host_file) to a host file"
    " to use a simulated node"
)


def test_the_no_nvml_state_is_deterministic_and_restored() -> None:
    before = nvml_available()
    with nvml_library_missing():
        assert nvml_available() is False
    assert nvml_available() is before


@pytest.mark.asyncio
async def test_create_without_nvml_fails_naming_nvml_and_the_host_file(memory_node) -> None:
    flags = memory_node.flags(host_file=None)
    before = sorted(os.listdir(memory_node.tmp))
    with nvml_library_missing():
        async with Runtime():
            with pytest.raises(IsolatorError) as caught:
                await NvidiaComponents.create(flags)
            assert snapshot() == {}, "an actor outlived a refused start"
    assert type(caught.value) is IsolatorError
    assert str(caught.value) == (
        f"Failed to initialize NVML (no host file given, so the real NVML is required): {NO_LIBRARY}"
    )
    cause = caught.value.__cause__
    assert isinstance(cause, NvmlUnavailable) and cause.function == "nvmlInit" and cause.code == 12
    # Nothing prepared, nothing written: no runtime, work or volume directory.
    assert sorted(os.listdir(memory_node.tmp)) == before


@pytest.mark.asyncio
async def test_resources_and_create_agree_without_nvml(memory_node) -> None:
    with nvml_library_missing():
        # Neither given: Mesos passes 'gpus' through unchecked -> no GPUs, and
        # an allocator created from it manages none (it asks NVML nothing).
        plain = memory_node.flags(host_file=None)
        resources = NvidiaGpuAllocator.resources(plain)
        assert resources == Resources() and resources.gpus() is None
        # Given explicitly: passed through unchecked, and creating the
        # allocator for them fails naming NVML instead of inventing GPUs.
        named = memory_node.flags(host_file=None, resources="gpus:2", nvidia_gpu_devices=[0, 1])
        assert str(NvidiaGpuAllocator.resources(named)) == "gpus:2"
        async with Runtime():
            allocator = await NvidiaGpuAllocator.create(plain, resources)
            assert allocator.total() == set()
            assert await allocator.available() == set()
            with pytest.raises(AllocatorError) as caught:
                await allocator.allocate(1)
            assert str(caught.value) == "Requested 1 gpus but only 0 available"
            await allocator.close()
            with pytest.raises(AllocatorError) as caught:
                await NvidiaGpuAllocator.create(named, NvidiaGpuAllocator.resources(named))
            assert str(caught.value) == f"Failed to nvml::initialize: {NO_LIBRARY}"
            assert isinstance(caught.value.__cause__, NvmlUnavailable)
            assert snapshot() == {}
