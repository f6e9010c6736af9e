"""R-FL-1: the node's GPU resources from flags, as Mesos computes them."""

from __future__ import annotations

import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError
from actors.flags import Flags
from actors.nvml import HostFileError, SimulatedNvml, nvml_available
from actors.resources import Resources, ResourcesError


@pytest.fixture
def node4(tmp_path) -> str:
    path = tmp_path / "node4.toml"
    path.write_text("gpu_count = 4\n")
    return str(path)


def resources(node: str | None, **flags) -> Resources:
    return NvidiaGpuAllocator.resources(Flags(host_file=node, **flags))


def test_neither_given_means_every_gpu_nvml_reports(node4):
    assert str(resources(node4)) == "gpus:4"
    assert str(resources(node4, resources="cpus:2;mem:1024")) == "gpus:4"


def test_devices_and_a_matching_gpus_resource(node4):
    result = resources(node4, resources="cpus:8;gpus:2", nvidia_gpu_devices=[1, 3])
    assert result == Resources.parse("gpus:2")  # only the gpus entry, like Mesos


def test_devices_without_the_gpu_isolator_are_an_error(node4):
    with pytest.raises(AllocatorError) as caught:
        resources(node4, isolation="cgroups/devices", resources="gpus:1", nvidia_gpu_devices=[0])
    assert str(caught.value) == (
        "'--nvidia_gpu_devices' can only be specified if the `--isolation` flag contains 'gpu/nvidia'"
    )


def test_without_the_gpu_isolator_gpus_pass_through_unchecked(tmp_path):
    # Not even the host file is read: a missing one does not matter.
    result = resources(str(tmp_path / "absent.toml"), isolation="cgroups/devices", resources="cpus:1;gpus:0.5")
    assert result == Resources.parse("gpus:0.5")
    assert resources(None, isolation="filesystem/linux").gpus() is None


def test_without_nvml_gpus_pass_through_unchecked():
    if nvml_available():
        pytest.skip("a real NVIDIA driver is present here")
    assert resources(None, resources="gpus:3") == Resources.parse("gpus:3")
    assert resources(None, resources="gpus:2", nvidia_gpu_devices=[0, 0]) == Resources.parse("gpus:2")


def test_explicit_zero_gpus_means_no_gpus_and_no_discovery(node4):
    assert resources(node4, resources="cpus:1;gpus:0") == Resources()
    with pytest.raises(AllocatorError) as caught:
        resources(node4, resources="gpus:0", nvidia_gpu_devices=[0])
    assert str(caught.value) == "'--nvidia_gpu_devices' cannot be specified when '--resources' specifies 0 GPUs"


def test_devices_without_a_gpus_resource_are_an_error(node4):
    with pytest.raises(AllocatorError) as caught:
        resources(node4, resources="cpus:1", nvidia_gpu_devices=[0])
    assert str(caught.value) == "'--nvidia_gpu_devices' cannot be set without also setting 'gpus' in '--resources'"


def test_a_gpus_resource_without_devices_is_an_error(node4):
    with pytest.raises(AllocatorError) as caught:
        resources(node4, resources="gpus:2")
    assert str(caught.value) == "The `gpus` resource cannot be set without also setting `--nvidia_gpu_devices`"


def test_fractional_gpus_are_an_error(node4):
    with pytest.raises(AllocatorError, match=r"^The 'gpus' resource must be an non-negative integer \(got 1.5\)$"):
        resources(node4, resources="gpus:1.5", nvidia_gpu_devices=[0])


def test_duplicate_devices_are_an_error(node4):
    with pytest.raises(AllocatorError, match=r"^'--nvidia_gpu_devices' contains duplicates: 1$"):
        resources(node4, resources="gpus:2", nvidia_gpu_devices=[1, 1])


def test_a_count_mismatch_is_an_error(node4):
    with pytest.raises(AllocatorError) as caught:
        resources(node4, resources="gpus:3", nvidia_gpu_devices=[0, 1])
    assert str(caught.value).startswith(
        "'--resources' and '--nvidia_gpu_devices' specify different numbers of GPU devices"
    )


def test_more_gpus_than_the_node_has_is_an_error(node4):
    with pytest.raises(AllocatorError) as caught:
        resources(node4, resources="gpus:5", nvidia_gpu_devices=[0, 1, 2, 3, 4])
    assert str(caught.value).startswith(
        "The number of GPUs requested is greater than the number of GPUs available on the machine"
    )
    with pytest.raises(AllocatorError, match=r"names GPU index 7 but the machine has 4 GPUs \(indices 0-3\)"):
        resources(node4, resources="gpus:2", nvidia_gpu_devices=[0, 7])


def test_bad_resources_text_and_bad_host_files_surface(node4, tmp_path):
    with pytest.raises(ResourcesError, match="missing or extra ':' in gpus"):
        resources(node4, resources="cpus:1;gpus")
    bad = tmp_path / "bad.toml"
    bad.write_text("gpu_count = -1")
    with pytest.raises(HostFileError, match="gpu_count"):
        resources(str(bad))


def test_an_explicit_nvml_port_can_be_given():
    nvml = SimulatedNvml.with_gpus(2)
    nvml.init()
    assert NvidiaGpuAllocator.resources(Flags(), nvml) == Resources.parse("gpus:2")
    nvml.fail("nvmlDeviceGetCount_v2", 999)
    with pytest.raises(AllocatorError, match=r"^Failed to nvml::deviceGetCount: nvmlDeviceGetCount_v2 failed: Unknown Error"):
        NvidiaGpuAllocator.resources(Flags(), nvml)
