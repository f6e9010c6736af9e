"""R-MG-3: ``--nvidia_mig_strategy`` and the MIG resources, validated the way
R-FL-1 validates ``gpus``; and the allocator's pools they give."""

from __future__ import annotations

import logging

import pytest

from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError, managed_units
from actors.flags import Flags, FlagsError
from actors.gpu import Gpu
from actors.mig import MigDevice
from actors.nvml import SimulatedNvml, read_inventory
from actors.resources import Resources


@pytest.fixture
def h200(data_dir) -> str:
    # GPU 0: 2x 1g.18gb, 2g.35gb, 3g.71gb; GPU 1: MIG off; GPU 2: 2x 1c.3g.71gb; GPU 3: MIG on, empty.
    return str(data_dir / "h200-mig.toml")


@pytest.fixture
def uniform(tmp_path) -> str:
    path = tmp_path / "uniform.toml"
    path.write_text(
        "[[gpus]]\nmemory_total_mib = 81559\nmig = true\nmig_devices = ["
        + ", ".join(f"{{gi = {g}, ci = 0, profile = '1g.10gb', memory_total_mib = 9984}}" for g in (7, 8, 9))
        + "]\n[[gpus]]\nmemory_total_mib = 81559\nmig = true\nmig_devices = ["
        "{gi = 1, ci = 0, profile = '1g.10gb', memory_total_mib = 9984}]\n"
    )
    return str(path)


def resources(node: str, **flags) -> str:
    return str(NvidiaGpuAllocator.resources(Flags(host_file=node, **flags)))


def error(node: str, **flags) -> str:
    with pytest.raises(AllocatorError) as caught:
        NvidiaGpuAllocator.resources(Flags(host_file=node, **flags))
    return str(caught.value)


def test_strategy_flag_is_one_of_three_with_a_clear_error():
    assert Flags().nvidia_mig_strategy == "none" and Flags().proc_dir == "/proc"
    assert Flags.from_args(["--nvidia-mig-strategy=mixed", "--proc-dir=/x"]).proc_dir == "/x"
    with pytest.raises(FlagsError) as caught:
        Flags.from_args(["--nvidia_mig_strategy=multi"])
    assert str(caught.value) == "Invalid '--nvidia_mig_strategy' 'multi': expected one of none, single, mixed"
    with pytest.raises(FlagsError, match="'--proc_dir': it must not be empty"):
        Flags(proc_dir="")


def test_none_hands_mig_gpus_out_whole_and_refuses_mig_resources(h200):
    assert resources(h200) == "gpus:4"
    assert error(h200, resources="gpus:4;mig-1g.18gb:1") == (
        "'--resources' names 'mig-1g.18gb': MIG devices are resources of their own only with"
        " '--nvidia_mig_strategy=mixed'"
    )
    # Without the isolator the MIG resources pass through unchecked, as 'gpus' does.
    assert resources(h200, isolation="cgroups/devices", resources="mig-9g.1gb:1.5") == "mig-9g.1gb:1.5"


def test_single_counts_every_mig_device_as_one_gpu(uniform):
    assert resources(uniform, nvidia_mig_strategy="single") == "gpus:4"
    assert resources(uniform, nvidia_mig_strategy="single", resources="gpus:3", nvidia_gpu_devices=[0]) == "gpus:3"
    assert resources(uniform, nvidia_mig_strategy="single", resources="gpus:0") == ""


def test_single_rules_follow_mesos_with_mig_devices_as_the_count(uniform):
    single = {"nvidia_mig_strategy": "single"}
    assert error(uniform, **single, resources="gpus:4", nvidia_gpu_devices=[0]) == (
        "'--resources' asks for 4 gpus but the GPUs of '--nvidia_gpu_devices' (index 0) have 3 MIG devices;"
        " under '--nvidia_mig_strategy=single' each MIG device is one of 'gpus'"
    )
    assert error(uniform, **single, resources="gpus:1.5", nvidia_gpu_devices=[1]) == (
        "The 'gpus' resource must be an non-negative integer (got 1.5)"
    )
    assert error(uniform, **single, resources="gpus:3") == (
        "The `gpus` resource cannot be set without also setting `--nvidia_gpu_devices`"
    )
    assert error(uniform, **single, nvidia_gpu_devices=[0]) == (
        "'--nvidia_gpu_devices' cannot be set without also setting 'gpus' in '--resources'"
    )
    assert error(uniform, **single, resources="gpus:1", nvidia_gpu_devices=[1, 1]) == (
        "'--nvidia_gpu_devices' contains duplicates: 1"
    )
    assert error(uniform, **single, resources="gpus:1", nvidia_gpu_devices=[5]) == (
        "'--nvidia_gpu_devices' names GPU index 5 but the machine has 2 GPUs (indices 0-1)"
    )
    assert error(uniform, **single, resources="mig-1g.10gb:1") == (
        "'--resources' names 'mig-1g.10gb', a resource of '--nvidia_mig_strategy=mixed'; under 'single'"
        " every MIG device is one of 'gpus'"
    )


def test_single_refuses_a_node_with_mig_on_and_off_at_start(h200):
    assert error(h200, nvidia_mig_strategy="single") == (
        "'--nvidia_mig_strategy=single' needs every GPU in MIG mode or none: GPU index 0, 2, 3 have MIG"
        " mode on and 1 has it off (use '--nvidia_mig_strategy=mixed' for such a node, or select GPUs"
        " with '--nvidia_gpu_devices')"
    )
    # Selecting GPUs of one kind is fine; with none in MIG mode the whole-GPU rules apply.
    assert resources(h200, nvidia_mig_strategy="single", resources="gpus:6", nvidia_gpu_devices=[0, 2]) == "gpus:6"
    assert resources(h200, nvidia_mig_strategy="single", resources="gpus:1", nvidia_gpu_devices=[1]) == "gpus:1"


def test_single_on_profiles_that_differ_warns(h200, caplog):
    with caplog.at_level(logging.WARNING):
        resources(h200, nvidia_mig_strategy="single", resources="gpus:6", nvidia_gpu_devices=[0, 2])
    assert "MIG devices of different profiles (1c.3g.71gb, 1g.18gb, 2g.35gb, 3g.71gb)" in caplog.text


def test_mixed_offers_whole_gpus_and_each_profile(h200):
    mixed = {"nvidia_mig_strategy": "mixed"}
    assert resources(h200, **mixed) == "gpus:1;mig-1c.3g.71gb:2;mig-1g.18gb:2;mig-2g.35gb:1;mig-3g.71gb:1"
    assert resources(h200, **mixed, resources="cpus:4;mig-1g.18gb:1;mig-3g.71gb:0") == (
        "gpus:1;mig-1c.3g.71gb:2;mig-1g.18gb:1;mig-2g.35gb:1;mig-3g.71gb:0"
    )
    assert resources(h200, **mixed, resources="gpus:1", nvidia_gpu_devices=[0, 1]) == (
        "gpus:1;mig-1g.18gb:2;mig-2g.35gb:1;mig-3g.71gb:1"
    )
    assert resources(h200, **mixed, nvidia_gpu_devices=[0]) == "mig-1g.18gb:2;mig-2g.35gb:1;mig-3g.71gb:1"
    assert resources(h200, **mixed, resources="gpus:0", nvidia_gpu_devices=[2]) == "mig-1c.3g.71gb:2"
    assert resources(h200, **mixed, resources="gpus:0") == "mig-1c.3g.71gb:2;mig-1g.18gb:2;mig-2g.35gb:1;mig-3g.71gb:1"


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"resources": "mig-2g.20gb:1"},
         "Unknown MIG profile '2g.20gb' in '--resources' ('mig-2g.20gb'): the node's MIG devices have"
         " profiles 1c.3g.71gb, 1g.18gb, 2g.35gb, 3g.71gb"),
        ({"resources": "mig-1g18gb:1"},
         "Invalid resource 'mig-1g18gb' in '--resources': invalid MIG profile '1g18gb': expected"
         " '<G>g.<GB>gb' such as '1g.18gb' (optionally '<C>c.' before it and '+<attribute>' after it,"
         " e.g. '1c.3g.71gb', '1g.24gb+me')"),
        ({"resources": "mig-1g.18gb:1.5"}, "The 'mig-1g.18gb' resource must be a non-negative integer (got 1.5)"),
        ({"resources": "mig-1g.18gb:[1-2]"},
         "The 'mig-1g.18gb' resource must be a non-negative integer (got '[1-2]')"),
        ({"resources": "mig-1g.18gb:3"},
         "The number of 'mig-1g.18gb' devices requested is greater than the number available on the"
         " machine (3 requested, 2 available)"),
        ({"resources": "mig-1c.3g.71gb:1", "nvidia_gpu_devices": [0], "resources_gpus": None},
         "Unknown MIG profile '1c.3g.71gb' in '--resources' ('mig-1c.3g.71gb'): the node's MIG devices"
         " have profiles 1g.18gb, 2g.35gb, 3g.71gb"),
        ({"resources": "gpus:2", "nvidia_gpu_devices": [0, 1]},
         "'--resources' and '--nvidia_gpu_devices' specify different numbers of GPU devices (2 and 1:"
         " under '--nvidia_mig_strategy=mixed' the GPUs with MIG mode on (index 0) count as their"
         " 'mig-<profile>' resources, not as 'gpus')"),
        ({"nvidia_gpu_devices": [0, 1]},
         "'--nvidia_gpu_devices' cannot be set without also setting 'gpus' in '--resources' (GPU index 1"
         " of it has MIG mode off)"),
        ({"resources": "gpus:0", "nvidia_gpu_devices": [1]},
         "'--resources' specifies 0 GPUs but '--nvidia_gpu_devices' selects GPU index 1 with MIG mode off"),
        ({"resources": "gpus:1"}, "The `gpus` resource cannot be set without also setting `--nvidia_gpu_devices`"),
        ({"resources": "gpus:0.5", "nvidia_gpu_devices": [1]},
         "The 'gpus' resource must be an non-negative integer (got 0.5)"),
    ],
)
def test_mixed_resources_are_validated_with_clear_errors(h200, flags, message):
    flags = {k: v for k, v in flags.items() if k != "resources_gpus"}
    assert error(h200, nvidia_mig_strategy="mixed", **flags) == message


def test_managed_units_are_the_pools_of_each_resource(h200, uniform):
    def pools(node, **values):
        flags = Flags(host_file=node, **values)
        nvml = SimulatedNvml.from_file(node)
        nvml.init()
        inventory = read_inventory(nvml)
        return managed_units(flags, NvidiaGpuAllocator.resources(flags), inventory)

    gpu0 = Gpu(195, 0)
    assert pools(h200) == {"gpus": [Gpu(195, i) for i in range(4)]}
    assert pools(h200, nvidia_mig_strategy="mixed", resources="mig-1g.18gb:1") == {
        "gpus": [Gpu(195, 1)],
        "mig-1c.3g.71gb": [MigDevice(Gpu(195, 2), 1, 0), MigDevice(Gpu(195, 2), 1, 1)],
        "mig-1g.18gb": [MigDevice(gpu0, 3, 0)],
        "mig-2g.35gb": [MigDevice(gpu0, 2, 0)],
        "mig-3g.71gb": [MigDevice(gpu0, 1, 0)],
    }
    assert pools(uniform, nvidia_mig_strategy="single") == {
        "gpus": [MigDevice(gpu0, 7, 0), MigDevice(gpu0, 8, 0), MigDevice(gpu0, 9, 0), MigDevice(Gpu(195, 1), 1, 0)]
    }
    assert Resources.parse(str(NvidiaGpuAllocator.resources(Flags(host_file=uniform, nvidia_mig_strategy="single")))) \
        == Resources.parse("gpus:4")
