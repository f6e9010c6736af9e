"""R-IS-3: prepare — nested and DEBUG containers, "Container has already been
prepared", the device policy, the launch info (NVIDIA volume bind mount and
env, /dev/nvidia* copied with mode 0666 and bind-mounted under the rootfs),
and a failed prepare that leaves nothing behind."""

from __future__ import annotations

import os
import stat

import pytest

import runtime
from isolators import ContainerClass, ContainerConfig, ContainerID, ContainerLaunchInfo, ImageManifest
from isolators import Resources
from isolators._types import MS_BIND, MS_RDONLY, MS_REC
from tests.support.containers import config
from tests.support.errors import isolator_failure

LABEL = {"com.nvidia.volumes.needed": "nvidia_driver"}
CONTROL = [(195, 255), (235, 0), (235, 1), (195, 254)]


def rootfs_of(node, name: str = "rootfs") -> str:
    path = os.path.join(node.tmp, name)
    os.makedirs(path, exist_ok=True)
    return path


def listing(path: str) -> list[str]:
    found = []
    for directory, subdirs, files in os.walk(path):
        for name in subdirs + files:
            found.append(os.path.relpath(os.path.join(directory, name), path))
    return sorted(found)


async def assert_nothing_left(node, components, isolator, cid: str) -> None:
    assert await isolator.containers() == {}
    assert await components.allocator.available() == components.allocator.total()
    assert not await isolator.devices.exists(cid)
    assert not node.cgroup_exists(cid)


@pytest.mark.asyncio
async def test_prepare_grants_control_devices_and_its_gpus_only(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        assert await isolator.prepare(ContainerID("c1"), config("cpus:1;gpus:2")) is None
        assert await isolator.containers() == {"c1": [0, 1]}
        state = await isolator.devices.state("c1")
        for major, minor in CONTROL + [(195, 0), (195, 1)]:
            assert state.is_granted("c", major, minor, "rwm"), (major, minor)
        for minor in (2, 3):
            assert not state.is_granted("c", 195, minor, "r")
        assert state.is_granted("c", 1, 3, "rwm")  # /dev/null: the standard container set
        assert not state.is_granted("b", 8, 0, "r")
        assert node.cgroup_exists("c1")
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_prepare_without_gpus_gets_control_devices_and_no_gpu(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("c1"), config())
        await isolator.prepare(ContainerID("c2"), config("cpus:2;gpus:0"))
        assert await isolator.containers() == {"c1": [], "c2": []}
        for cid in ("c1", "c2"):
            state = await isolator.devices.state(cid)
            assert state.is_granted("c", 195, 255, "rwm")
            assert not any(state.is_granted("c", 195, m, "r") for m in range(4))
            await isolator.cleanup(ContainerID(cid))


@pytest.mark.asyncio
async def test_nested_debug_gets_nothing_and_nested_gets_launch_info_only(node) -> None:
    parent = ContainerID("p1")
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(parent, config("gpus:1"))
        debug = ContainerConfig(rootfs=rootfs_of(node), docker_manifest=ImageManifest(labels=LABEL),
                                container_class=ContainerClass.DEBUG, resources=Resources.parse("gpus:2"))
        assert await isolator.prepare(ContainerID("dbg", parent), debug) is None
        assert await isolator.prepare(ContainerID("plain", parent), config("gpus:2")) is None
        nested = ContainerConfig(rootfs=rootfs_of(node, "nested-rootfs"), docker_manifest=ImageManifest(labels=LABEL),
                                 resources=Resources.parse("gpus:2"))
        info = await isolator.prepare(ContainerID("child", parent), nested)
        assert isinstance(info, ContainerLaunchInfo)
        target = os.path.join(nested.rootfs, "usr/local/nvidia")
        assert ContainerMountInfo_tuple(info.mounts[0]) == (components.volume.host_path, target,
                                                            MS_RDONLY | MS_BIND | MS_REC)
        assert info.environment is not None and "/usr/local/nvidia/bin" in info.environment["PATH"]
        # No GPU, no record, no cgroup for nested containers: they share the parent's.
        assert await isolator.containers() == {"p1": [0]}
        assert await components.allocator.available() == {g for g in components.allocator.total() if g.minor != 0}
        assert not await isolator.devices.exists("p1/child")
        # A nested id may be prepared again (no record is kept).
        assert await isolator.prepare(ContainerID("child", parent), nested) is not None
        await isolator.cleanup(ContainerID("child", parent))
        await isolator.cleanup(parent)


def ContainerMountInfo_tuple(mount) -> tuple[str, str, int]:
    return (mount.source, mount.target, mount.flags)


@pytest.mark.asyncio
async def test_prepare_twice_is_refused_and_changes_nothing(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("c1"), config("gpus:1"))
        await isolator_failure(isolator.prepare(ContainerID("c1"), config("gpus:2")),
                               "Container has already been prepared")
        assert await isolator.containers() == {"c1": [0]}
        assert len(await components.allocator.available()) == 3
        state = await isolator.devices.state("c1")
        assert state.is_granted("c", 195, 0, "rwm") and not state.is_granted("c", 195, 1, "r")
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_prepare_refuses_fractional_and_excess_gpus_leaving_nothing(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator_failure(isolator.prepare(ContainerID("c1"), config("gpus:1.5")),
                               "The 'gpus' resource must be an unsigned integer")
        await assert_nothing_left(node, components, isolator, "c1")
        await isolator_failure(isolator.prepare(ContainerID("c2"), config("gpus:5")),
                               "Requested 5 gpus but only 4 available")
        await assert_nothing_left(node, components, isolator, "c2")


@pytest.mark.asyncio
async def test_rootfs_without_a_manifest_fails_and_is_undone(node) -> None:
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator_failure(isolator.prepare(ContainerID("c1"), config("gpus:2", rootfs=rootfs_of(node))),
                               "The 'ContainerConfig' for docker is missing a manifest")
        await assert_nothing_left(node, components, isolator, "c1")
        # The id is free again.
        assert await isolator.prepare(ContainerID("c1"), config("gpus:4")) is None
        assert await isolator.containers() == {"c1": [0, 1, 2, 3]}
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
@pytest.mark.parametrize("has_task_info", [True, False])
async def test_volume_is_injected_for_labelled_images(memory_node, has_task_info) -> None:
    rootfs = rootfs_of(memory_node)
    manifest = ImageManifest(env=["PATH=/usr/bin", "LD_LIBRARY_PATH=/opt/lib"], labels=LABEL)
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        info = await isolator.prepare(
            ContainerID("c1"), config("gpus:1", rootfs=rootfs, docker_manifest=manifest, has_task_info=has_task_info))
        target = os.path.join(rootfs, "usr/local/nvidia")
        assert [ContainerMountInfo_tuple(m) for m in info.mounts] == [
            (components.volume.host_path, target, MS_RDONLY | MS_BIND | MS_REC)
        ]
        assert info.mounts[0].flag_names() == ["MS_RDONLY", "MS_BIND", "MS_REC"]
        assert os.path.isdir(target)
        env = {
            "PATH": "/usr/bin:/usr/local/nvidia/bin",
            "LD_LIBRARY_PATH": "/opt/lib:/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
        }
        assert env == components.volume.env(manifest)
        if has_task_info:
            assert info.task_environment == env and info.environment is None
        else:
            assert info.environment == env and info.task_environment is None
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
@pytest.mark.parametrize("manifest", [
    ImageManifest(),
    ImageManifest(env=["NVIDIA_VISIBLE_DEVICES=void"], labels=LABEL),
    ImageManifest(env=["NVIDIA_VISIBLE_DEVICES="], labels=LABEL),
])
async def test_volume_is_not_injected_otherwise(memory_node, manifest) -> None:
    rootfs = rootfs_of(memory_node)
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        info = await isolator.prepare(ContainerID("c1"), config("gpus:1", rootfs=rootfs, docker_manifest=manifest))
        assert (info.mounts, info.environment, info.task_environment, info.cdi_devices) == ([], None, None, [])
        assert info.grant.mounts == () and list(info.grant.environment) == ["NVIDIA_VISIBLE_DEVICES"]  # no volume
        assert not os.path.exists(os.path.join(rootfs, "usr"))
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_visible_devices_variable_injects_without_the_label(memory_node) -> None:
    rootfs = rootfs_of(memory_node)
    manifest = ImageManifest(env=["NVIDIA_VISIBLE_DEVICES=all"])
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        info = await isolator.prepare(ContainerID("c1"), config(rootfs=rootfs, docker_manifest=manifest))
        assert [m.target for m in info.mounts] == [os.path.join(rootfs, "usr/local/nvidia")]
        await isolator.cleanup(ContainerID("c1"))


def make_fake_dev(dev_dir: str) -> dict[str, tuple[int, int]]:
    nodes = {"nvidiactl": (195, 255), "nvidia-uvm": (235, 0), "nvidia-uvm-tools": (235, 1),
             "nvidia-modeset": (195, 254), "nvidia0": (195, 0), "nvidia1": (195, 1),
             "nvidia2": (195, 2), "nvidia3": (195, 3)}
    for name, (major, minor) in nodes.items():
        os.mknod(os.path.join(dev_dir, name), stat.S_IFCHR | 0o600, os.makedev(major, minor))
    os.mkdir(os.path.join(dev_dir, "nvidia-caps"))
    os.mknod(os.path.join(dev_dir, "nvidia-caps", "nvidia-cap1"), stat.S_IFCHR | 0o600, os.makedev(240, 1))
    with open(os.path.join(dev_dir, "nvidia-not-a-device"), "w") as handle:
        handle.write("x")
    os.mknod(os.path.join(dev_dir, "null-ish"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    return nodes


@pytest.mark.asyncio
async def test_device_nodes_are_copied_with_mode_0666_and_bind_mounted(node) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    nodes = make_fake_dev(node.dev_dir)
    rootfs = rootfs_of(node)
    async with runtime.Runtime():
        components, isolator = await node.start()
        info = await isolator.prepare(
            ContainerID("c1"), config("gpus:1", rootfs=rootfs, docker_manifest=ImageManifest(labels=LABEL)))
        devices_dir = os.path.join(node.runtime_dir, "containers", "c1", "devices")
        assert sorted(os.listdir(devices_dir)) == sorted(nodes)
        for name, (major, minor) in nodes.items():
            st = os.lstat(os.path.join(devices_dir, name))
            assert stat.S_ISCHR(st.st_mode)
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor)
            assert stat.S_IMODE(st.st_mode) == 0o666
        device_mounts = [ContainerMountInfo_tuple(m) for m in info.mounts[1:]]
        assert device_mounts == [
            (os.path.join(devices_dir, name), os.path.join(rootfs, "dev", name), MS_BIND) for name in sorted(nodes)
        ]
        assert info.mounts[0].target == os.path.join(rootfs, "usr/local/nvidia")
        # The policy came from the nodes in dev_dir (same numbers here).
        state = await isolator.devices.state("c1")
        assert state.is_granted("c", 195, 255, "rwm") and state.is_granted("c", 195, 0, "rwm")
        assert not state.is_granted("c", 195, 1, "r")
        await isolator.cleanup(ContainerID("c1"))
        assert not os.path.exists(devices_dir)


@pytest.mark.asyncio
async def test_failed_device_copy_is_undone(node) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    make_fake_dev(node.dev_dir)
    rootfs = rootfs_of(node)
    containers = os.path.join(node.runtime_dir, "containers")
    os.makedirs(os.path.join(containers, "c1", "devices"))
    # A regular file where a node copy must go: the copy fails part-way.
    with open(os.path.join(containers, "c1", "devices", "nvidia2"), "w") as handle:
        handle.write("in the way")
    async with runtime.Runtime():
        components, isolator = await node.start()
        devices = os.path.join(containers, "c1", "devices")
        await isolator_failure(
            isolator.prepare(ContainerID("c1"), config("gpus:2", rootfs=rootfs, docker_manifest=ImageManifest())),
            f"Failed to copy NVIDIA device nodes into '{devices}': Failed to mknod '{devices}/nvidia2' (195:2): a file"
            " that is not a character device is in the way")
        await assert_nothing_left(node, components, isolator, "c1")
        # The nodes it copied before failing are gone again; the file it did not make stays.
        assert listing(containers) == ["c1", "c1/devices", "c1/devices/nvidia2"]
