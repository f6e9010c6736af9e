"""R-FL-2 / R-IS-1 / R-IS-2: creating the isolator — the isolation flags it
needs (Mesos' messages), the control devices it records (from dev_dir, or
the host file on a simulated node without nodes), and nesting support."""

from __future__ import annotations

import os
import stat

import pytest

import runtime
from actors.devices import DeviceRule
from isolators import ContainerConfig, ContainerID, NvidiaComponents, NvidiaGpuIsolatorProcess, Resources
from isolators import _startup
from isolators._startup import devices_subsystem_enabled, find_control_devices
from tests.support.errors import isolator_failure, raises_isolator_error

NO_DEVICES = (
    "The 'cgroups/devices' or 'cgroups/all' isolator must be enabled in order to use the 'gpu/nvidia' isolator"
)
NO_FILESYSTEM = "The 'filesystem/linux' isolator must be enabled in order to use the 'gpu/nvidia' isolator"


def mknod(path: str, major: int, minor: int) -> None:
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "isolation, message",
    [
        ("filesystem/linux,gpu/nvidia", NO_DEVICES),
        ("filesystem/linux,cgroups/cpu,gpu/nvidia", NO_DEVICES),
        ("cgroups/devices,gpu/nvidia", NO_FILESYSTEM),
        ("cgroups/all,gpu/nvidia", NO_FILESYSTEM),
    ],
)
async def test_create_refuses_without_the_isolators_it_needs(memory_node, isolation, message) -> None:
    async with runtime.Runtime():
        flags = memory_node.flags(isolation=isolation)
        components = await NvidiaComponents.create(flags)
        try:
            await isolator_failure(NvidiaGpuIsolatorProcess.create(flags, components), message)
        finally:
            await components.close()


@pytest.mark.asyncio
async def test_cgroups_all_is_accepted_in_place_of_cgroups_devices(memory_node) -> None:
    if not devices_subsystem_enabled():
        pytest.skip("the devices cgroup subsystem is not enabled on this kernel")
    async with runtime.Runtime():
        components, isolator = await memory_node.start(isolation="filesystem/linux,cgroups/all,gpu/nvidia")
        info = await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=Resources.parse("gpus:1")))
        assert info is None
        assert await isolator.containers() == {"c1": [0]}
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_supports_nesting_and_standalone(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        assert isolator.supports_nesting() is True
        assert isolator.supports_standalone() is True
        assert isolator.process.supports_nesting() is True
        assert isolator.process.supports_standalone() is True


@pytest.mark.asyncio
@pytest.mark.parametrize("uvm_major", [None, 509], ids=["from-the-host-file-when-dev-dir-has-none",
                                                       "from-dev-dir-nodes-over-the-host-files-numbers"])
async def test_control_devices_come_from_dev_dir_nodes_else_the_host_file(memory_node, uvm_major) -> None:
    dev = memory_node.dev_dir
    if uvm_major is not None:
        needs_root()
        mknod(os.path.join(dev, "nvidiactl"), 195, 255)
        mknod(os.path.join(dev, "nvidia-uvm"), uvm_major, 0)
        mknod(os.path.join(dev, "nvidia-uvm-tools"), uvm_major, 1)
        mknod(os.path.join(dev, "nvidia-modeset"), 195, 254)
    uvm = 235 if uvm_major is None else uvm_major  # the host file's default numbers are 235:x
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        assert isolator.process.control_devices == {
            os.path.join(dev, "nvidiactl"): DeviceRule("c", 195, 255, "rwm"),
            os.path.join(dev, "nvidia-uvm"): DeviceRule("c", uvm, 0, "rwm"),
            os.path.join(dev, "nvidia-uvm-tools"): DeviceRule("c", uvm, 1, "rwm"),
            os.path.join(dev, "nvidia-modeset"): DeviceRule("c", 195, 254, "rwm"),
        }
        await isolator.prepare(ContainerID("c1"), ContainerConfig())
        state = await isolator.devices.state("c1")
        for major, minor in [(195, 255), (uvm, 0), (uvm, 1), (195, 254)]:
            assert state.is_granted("c", major, minor, "rwm")
        assert not state.is_granted("c", 195, 0, "r")
        if uvm != 235:
            assert not state.is_granted("c", 235, 0, "r")
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_control_device_numbers_from_a_toml_host_file(memory_node) -> None:
    memory_node.write_host(toml=(
        'driver_version = "535.1"\n'
        "gpu_count = 2\n"
        "[control_devices]\n"
        'nvidiactl = "195:255"\n'
        '"nvidia-uvm" = "511:0"\n'
        '"nvidia-uvm-tools" = "511:1"\n'
        '"nvidia-modeset" = "195:254"\n'
    ))
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        rules = {os.path.basename(p): r for p, r in isolator.process.control_devices.items()}
        assert rules["nvidia-uvm"] == DeviceRule("c", 511, 0, "rwm")
        assert rules["nvidia-uvm-tools"] == DeviceRule("c", 511, 1, "rwm")
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=Resources.parse("gpus:2")))
        state = await isolator.devices.state("c1")
        assert state.is_granted("c", 511, 0, "rwm") and state.is_granted("c", 195, 1, "rwm")
        await isolator.cleanup(ContainerID("c1"))


def test_optional_control_devices_are_recorded_only_when_present(tmp_path, memory_node) -> None:
    needs_root()
    dev = memory_node.dev_dir
    mknod(os.path.join(dev, "nvidiactl"), 195, 255)
    mknod(os.path.join(dev, "nvidia-uvm"), 509, 0)
    rules = find_control_devices(memory_node.flags(), None)
    assert rules == {
        os.path.join(dev, "nvidiactl"): DeviceRule("c", 195, 255, "rwm"),
        os.path.join(dev, "nvidia-uvm"): DeviceRule("c", 509, 0, "rwm"),
    }


def test_missing_nvidiactl_on_a_real_nvml_node_is_an_error(memory_node) -> None:
    flags = memory_node.flags()
    with raises_isolator_error() as error:
        find_control_devices(flags, None)
    path = os.path.join(memory_node.dev_dir, "nvidiactl")
    assert str(error.value) == f"Failed to obtain device ID for '{path}': No such file or directory"


def _fake_modprobe(tmp_path, monkeypatch, body: str) -> str:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "nvidia-modprobe"
    log = tmp_path / "modprobe.log"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{body}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ.get('PATH', '')}")
    return str(log)


def test_missing_nvidia_uvm_runs_nvidia_modprobe(tmp_path, monkeypatch, memory_node) -> None:
    needs_root()
    dev = memory_node.dev_dir
    mknod(os.path.join(dev, "nvidiactl"), 195, 255)
    log = _fake_modprobe(tmp_path, monkeypatch, f"mknod {dev}/nvidia-uvm c 508 0")
    rules = find_control_devices(memory_node.flags(), None)
    with open(log) as handle:
        assert handle.read().split() == ["-u", "-c", "0"]
    assert rules[os.path.join(dev, "nvidia-uvm")] == DeviceRule("c", 508, 0, "rwm")


def test_failing_nvidia_modprobe_is_an_error(tmp_path, monkeypatch, memory_node) -> None:
    needs_root()
    dev = memory_node.dev_dir
    mknod(os.path.join(dev, "nvidiactl"), 195, 255)
    _fake_modprobe(tmp_path, monkeypatch, "exit 3")
    with raises_isolator_error(f"Failed to load '{os.path.join(dev, 'nvidia-uvm')}': Command '['nvidia-modprobe',"
                               " '-u', '-c', '0']' returned non-zero exit status 3."):
        find_control_devices(memory_node.flags(), None)


def test_nvidia_uvm_still_missing_after_modprobe_is_an_error(tmp_path, monkeypatch, memory_node) -> None:
    needs_root()
    dev = memory_node.dev_dir
    mknod(os.path.join(dev, "nvidiactl"), 195, 255)
    _fake_modprobe(tmp_path, monkeypatch, "exit 0")
    with raises_isolator_error() as error:
        find_control_devices(memory_node.flags(), None)
    path = os.path.join(dev, "nvidia-uvm")
    assert str(error.value) == f"Failed to obtain device ID for '{path}': No such file or directory"


# -- control devices that are not what they claim to be (issue 20 item 6) -----------------
@pytest.mark.asyncio
@pytest.mark.parametrize(
    "nodes, bad, problem",
    [
        ({"nvidiactl": "file", "nvidia-uvm": (509, 0)}, "nvidiactl",
         "is not a character device (a regular file): the NVIDIA control device 'nvidiactl' must be the driver's"
         " device node; recreate it (nvidia-modprobe) or fix --dev_dir"),
        ({"nvidiactl": (195, 255), "nvidia-uvm": "file"}, "nvidia-uvm",
         "is not a character device (a regular file): the NVIDIA control device 'nvidia-uvm' must be the"
         " driver's device node; recreate it (nvidia-modprobe) or fix --dev_dir"),
        ({"nvidiactl": (10, 200), "nvidia-uvm": (509, 0)}, "nvidiactl",
         "is the character device 10:200, not of the NVIDIA major 195: it is not the control device 'nvidiactl';"
         " recreate it (nvidia-modprobe) or fix --dev_dir"),
        ({"nvidiactl": (195, 255), "nvidia-uvm": (195, 0)}, "nvidia-uvm",
         "is the character device 195:0, not of a major other than 195 (the nvidia-uvm module's own): it is not"
         " the control device 'nvidia-uvm'; recreate it (nvidia-modprobe -u -c 0) or fix --dev_dir"),
        ({"nvidiactl": (195, 255), "nvidia-uvm": (509, 0), "nvidia-modeset": "dir"}, "nvidia-modeset",
         "is not a character device (a directory): the NVIDIA control device 'nvidia-modeset' must be the"
         " driver's device node; recreate it (nvidia-modprobe) or fix --dev_dir"),
    ],
    ids=["nvidiactl-file", "uvm-file", "nvidiactl-wrong-major", "uvm-nvidia-major", "modeset-dir"],
)
async def test_control_devices_that_are_not_device_nodes_fail_create(memory_node, nodes, bad, problem) -> None:
    needs_root()
    dev = memory_node.dev_dir
    for name, kind in nodes.items():
        path = os.path.join(dev, name)
        if kind == "file":
            with open(path, "w") as handle:
                handle.write("not a device\n")
        elif kind == "dir":
            os.mkdir(path)
        else:
            mknod(path, *kind)
    async with runtime.Runtime():
        components = await NvidiaComponents.create(memory_node.flags())
        try:
            await isolator_failure(NvidiaGpuIsolatorProcess.create(memory_node.flags(), components),
                                   f"'{os.path.join(dev, bad)}' {problem}")
        finally:
            await components.close()


def _proc_devices(node, uvm_major: int) -> None:
    """The node's own ``<proc_dir>/devices``, listing nvidia-uvm at ``uvm_major``."""
    with open(os.path.join(node.proc_dir, "devices"), "w") as handle:
        handle.write(f"Character devices:\n  1 mem\n195 nvidia-frontend\n{uvm_major} nvidia-uvm\n\n"
                     "Block devices:\n  7 loop\n")


def _other_major_than_the_hosts(uvm: int) -> int:
    """``uvm``, or another major when the host's /proc/devices lists nvidia-uvm there (a GPU host)."""
    return uvm + 1 if _startup.registered_major("nvidia-uvm") == uvm else uvm


@pytest.mark.host_facts  # reads the host's /proc/devices to pick majors it does not list
def test_nvidia_uvm_must_have_the_major_its_proc_dir_lists(memory_node) -> None:
    """The major is read from the node's ``<proc_dir>/devices``, never the host's
    ``/proc/devices``: a node at 509 whose proc_dir lists 510 is refused whatever
    the host's kernel registered (it must differ from the host's to prove it)."""
    needs_root()
    dev = memory_node.dev_dir
    node_major = _other_major_than_the_hosts(509)
    listed = _other_major_than_the_hosts(node_major + 1)
    mknod(os.path.join(dev, "nvidiactl"), 195, 255)
    mknod(os.path.join(dev, "nvidia-uvm"), node_major, 0)
    _proc_devices(memory_node, listed)
    assert memory_node.flags().proc_dir == memory_node.proc_dir != "/proc"
    with raises_isolator_error(
            f"'{os.path.join(dev, 'nvidia-uvm')}' is the character device {node_major}:0, not of the major {listed}"
            " the kernel registered for nvidia-uvm: it is not the control device 'nvidia-uvm'; recreate it"
            " (nvidia-modprobe -u -c 0) or fix --dev_dir"):
        find_control_devices(memory_node.flags(), None)


@pytest.mark.host_facts  # reads the host's /proc/devices to pick majors it does not list
def test_nvidia_uvm_of_the_major_its_proc_dir_lists_is_accepted(memory_node) -> None:
    """The same node whose proc_dir lists its own major (not the host's) starts; so
    does one whose proc_dir has no ``devices`` (then only "not 195" is checked)."""
    needs_root()
    dev = memory_node.dev_dir
    node_major = _other_major_than_the_hosts(509)
    mknod(os.path.join(dev, "nvidiactl"), 195, 255)
    mknod(os.path.join(dev, "nvidia-uvm"), node_major, 0)
    expected = {os.path.join(dev, "nvidiactl"): DeviceRule("c", 195, 255, "rwm"),
                os.path.join(dev, "nvidia-uvm"): DeviceRule("c", node_major, 0, "rwm")}
    assert not os.path.exists(os.path.join(memory_node.proc_dir, "devices"))
    assert find_control_devices(memory_node.flags(), None) == expected
    _proc_devices(memory_node, node_major)
    assert find_control_devices(memory_node.flags(), None) == expected


def test_registered_major_reads_the_character_devices_of_proc_devices(tmp_path) -> None:
    proc_devices = tmp_path / "devices"
    proc_devices.write_text(
        "Character devices:\n  1 mem\n195 nvidia-frontend\n509 nvidia-uvm\n\nBlock devices:\n  8 nvidia-uvm\n")
    assert _startup.registered_major("nvidia-uvm", str(proc_devices)) == 509
    assert _startup.registered_major("nvidia-caps", str(proc_devices)) is None
    assert _startup.registered_major("nvidia-uvm", str(tmp_path / "missing")) is None
