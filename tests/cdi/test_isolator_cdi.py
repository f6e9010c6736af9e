"""The isolator's transient CDI specs (R-CD-1): written at prepare, rewritten
at update, removed at cleanup, repaired by recover and reconcile; one device
holding exactly the container's GPU nodes and the control devices; nested
containers share their parent's; a failure undoes what was done; other
vendors' specs are never touched; bad ids never become file names."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

import runtime
from isolators import ContainerClass, ContainerID, ImageManifest, InvalidContainerID, Resources
from isolators.cdi import CONTAINER_KIND, CdiWriteError, decode_spec, validate_spec
from tests.support.containers import config, started_with
from tests.support.errors import isolator_failure, raises_isolator_error

LABEL = {"com.nvidia.volumes.needed": "nvidia_driver"}
OTHERS = {"nvidia.yaml": "cdiVersion: 0.5.0\n", "vendor.com-device.json": "{}",
          ".gpu-isolator-container_x.json.bak": "not ours: not a temporary name"}


@pytest.fixture
def cdi_node(node_factory, tmp_path):
    """A memory node with ``cdi_spec_dir`` set, other vendors' specs already there."""
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    for name, text in OTHERS.items():
        (cdi_dir / name).write_text(text)
    node = node_factory("memory", gpus=4, cdi_spec_dir=str(cdi_dir))
    node.cdi_dir = str(cdi_dir)
    return node


def ours(node) -> list[str]:
    return sorted(n for n in os.listdir(node.cdi_dir) if n not in OTHERS)


def others_untouched(node) -> bool:
    return all(open(os.path.join(node.cdi_dir, n)).read() == text for n, text in OTHERS.items())


def spec_of(node, name: str):
    with open(os.path.join(node.cdi_dir, f"gpu-isolator-container_{name}.json"), "rb") as handle:
        return validate_spec(decode_spec(handle.read(), "json"))


def uuids(components) -> dict[int, str]:
    return {info.gpu.minor: info.uuid for info in components.inventory.gpus}


def expected_nodes(node, minors: list[int]) -> list[tuple[str, str, int, int]]:
    gpus = [(f"/dev/nvidia{m}", os.path.join(node.dev_dir, f"nvidia{m}"), 195, m) for m in minors]
    control = [("/dev/nvidiactl", os.path.join(node.dev_dir, "nvidiactl"), 195, 255),
               ("/dev/nvidia-uvm", os.path.join(node.dev_dir, "nvidia-uvm"), 235, 0),
               ("/dev/nvidia-uvm-tools", os.path.join(node.dev_dir, "nvidia-uvm-tools"), 235, 1),
               ("/dev/nvidia-modeset", os.path.join(node.dev_dir, "nvidia-modeset"), 195, 254)]
    return gpus + control


def assert_spec_grants(node, components, name: str, minors: list[int]) -> None:
    spec = spec_of(node, name)
    assert spec.kind == CONTAINER_KIND and spec.cdi_version == "0.5.0"  # hostPath is under the node's dev dir
    (device,) = spec.devices
    assert device.name == name and spec.container_edits is None
    edits = device.container_edits
    assert [(n.path, n.host_path, n.major, n.minor) for n in edits.device_nodes] == expected_nodes(node, minors)
    assert all(n.type == "c" and n.permissions == "rwm" and n.file_mode == 0o666 for n in edits.device_nodes)
    visible = ",".join(uuids(components)[m] for m in minors) or "none"
    assert edits.env[0] == f"NVIDIA_VISIBLE_DEVICES={visible}"


@pytest.mark.asyncio
async def test_prepare_writes_one_spec_and_returns_its_name_without_a_rootfs(cdi_node) -> None:
    async with runtime.Runtime():
        components, isolator = await cdi_node.start()
        info = await isolator.prepare(ContainerID("c1"), config("gpus:2"))
        assert info is not None and info.mounts == []
        assert info.cdi_devices == ["gpu-isolator/container=c1"]
        assert ours(cdi_node) == ["gpu-isolator-container_c1.json"]
        assert_spec_grants(cdi_node, components, "c1", [0, 1])
        fragment = info.to_oci()
        assert [(d["path"], d["major"], d["minor"]) for d in fragment["linux"]["devices"]] == [
            (p, ma, mi) for p, _, ma, mi in expected_nodes(cdi_node, [0, 1])]
        assert f"NVIDIA_VISIBLE_DEVICES={uuids(components)[0]},{uuids(components)[1]}" in fragment["process"]["env"]
        zero = await isolator.prepare(ContainerID("c0"), config())
        assert zero.cdi_devices == ["gpu-isolator/container=c0"]
        assert_spec_grants(cdi_node, components, "c0", [])
        assert others_untouched(cdi_node)
        await isolator.cleanup(ContainerID("c1"))
        await isolator.cleanup(ContainerID("c0"))
        assert ours(cdi_node) == [] and others_untouched(cdi_node)
        await isolator.cleanup(ContainerID("c1"))  # idempotent


@pytest.mark.asyncio
async def test_without_a_spec_dir_nothing_is_written_and_mesos_behaviour_stays(node_factory) -> None:
    node = node_factory("memory", gpus=2)
    async with runtime.Runtime():
        _, isolator = await node.start()
        assert await isolator.prepare(ContainerID("c1"), config("gpus:1")) is None
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_a_rootfs_with_the_volume_puts_its_mount_and_hook_in_the_spec(cdi_node, tmp_path) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    manifest = ImageManifest(env=["PATH=/usr/bin"], labels=LABEL)
    async with runtime.Runtime():
        components, isolator = await cdi_node.start()
        info = await isolator.prepare(ContainerID("c1"), config("gpus:1", rootfs=str(rootfs), docker_manifest=manifest))
        assert info.cdi_devices == ["gpu-isolator/container=c1"]
        assert info.mounts  # the Mesos launch info is as before
        edits = spec_of(cdi_node, "c1").devices[0].container_edits
        assert [(m.host_path, m.container_path, m.options) for m in edits.mounts] == [
            (components.volume.host_path, "/usr/local/nvidia", ["rbind", "ro"])]
        assert edits.env == [f"NVIDIA_VISIBLE_DEVICES={uuids(components)[0]}"]  # R-DR-2: the image's PATH stays
        [hook] = edits.hooks  # the loader cache finds the volume's libraries instead
        assert hook.args[-5:] == ["update-ldcache", "--folder", "/usr/local/nvidia/lib64", "--folder",
                                  "/usr/local/nvidia/lib"]
        assert info.environment["PATH"] == "/usr/bin:/usr/local/nvidia/bin"  # the Mesos launch info is as before
        assert [m["destination"] for m in info.to_oci()["mounts"]] == ["/usr/local/nvidia"]
        assert "PATH=/usr/bin:/usr/local/nvidia/bin" in info.to_oci()["process"]["env"]
        await isolator.cleanup(ContainerID("c1"))
        assert ours(cdi_node) == []


@pytest.mark.asyncio
async def test_update_rewrites_the_spec(cdi_node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(cdi_node, c1="gpus:1")
        assert_spec_grants(cdi_node, components, "c1", [0])
        await isolator.update(ContainerID("c1"), Resources.parse("gpus:3"))
        assert_spec_grants(cdi_node, components, "c1", [0, 1, 2])
        await isolator.update(ContainerID("c1"), Resources.parse("gpus:1"))
        assert_spec_grants(cdi_node, components, "c1", [0])
        await isolator.update(ContainerID("c1"), Resources.parse("gpus:0"))
        assert_spec_grants(cdi_node, components, "c1", [])
        assert ours(cdi_node) == ["gpu-isolator-container_c1.json"]
        await isolator.cleanup(ContainerID("c1"))


@pytest.mark.asyncio
async def test_nested_containers_share_their_parents_grant(cdi_node, tmp_path) -> None:
    parent, child = ContainerID("p1"), ContainerID("child", ContainerID("p1"))
    async with runtime.Runtime():
        components, isolator = await cdi_node.start()
        top = await isolator.prepare(parent, config("gpus:2"))
        nested = await isolator.prepare(child, config())
        assert nested.cdi_devices == top.cdi_devices == ["gpu-isolator/container=p1"]
        assert nested.grant == top.grant
        assert await isolator.prepare(ContainerID("dbg", parent), config(container_class=ContainerClass.DEBUG)) is None
        assert ours(cdi_node) == ["gpu-isolator-container_p1.json"]
        await isolator.cleanup(child)
        assert ours(cdi_node) == ["gpu-isolator-container_p1.json"]
        await isolator.update(parent, Resources.parse("gpus:1"))
        again = await isolator.prepare(ContainerID("child2", parent), config())
        assert [d.minor for d in again.grant.devices][:1] == [0] and len(again.grant.devices) == 5
        await isolator.cleanup(parent)
        assert ours(cdi_node) == []


@pytest.mark.asyncio
async def test_ids_that_are_not_cdi_names_get_a_hashed_name(cdi_node) -> None:
    async with runtime.Runtime():
        _, isolator = await cdi_node.start()
        info = await isolator.prepare(ContainerID("-odd@id+"), config("gpus:1"))
        (name,) = info.cdi_devices
        assert name.startswith("gpu-isolator/container=id.")
        assert ours(cdi_node) == [f"gpu-isolator-container_{name.split('=')[1]}.json"]
        forged = ContainerID("ok")
        msgspec.structs.force_setattr(forged, "value", "../../etc/x")
        await isolator_failure(isolator.prepare(forged, config("gpus:1")),
                               "Invalid container id '../../etc/x': it contains '.'; '/', '\\\\', '.', spaces and"
                               " control characters are not allowed", InvalidContainerID)
        assert len(ours(cdi_node)) == 1
        await isolator.cleanup(ContainerID("-odd@id+"))
        assert ours(cdi_node) == []


@pytest.mark.asyncio
async def test_a_spec_that_cannot_be_written_fails_prepare_and_undoes_it(node_factory, tmp_path) -> None:
    missing = tmp_path / "no-such-dir"
    node = node_factory("memory", gpus=2, cdi_spec_dir=str(missing))
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    async with runtime.Runtime():
        components, isolator = await node.start()
        with raises_isolator_error() as caught:
            await isolator.prepare(ContainerID("c1"), config("gpus:2", rootfs=str(rootfs),
                                                              docker_manifest=ImageManifest(labels=LABEL)))
        assert str(caught.value) == (
            f"Failed to write CDI spec '{missing}/gpu-isolator-container_c1.json': the CDI spec directory"
            f" '{missing}' does not exist (create it first; container engines read /etc/cdi and /var/run/cdi)")
        assert isinstance(caught.value.__cause__, CdiWriteError)
        assert await isolator.containers() == {}
        assert len(await components.allocator.available()) == 2
        assert node.cgroups() == []
        assert not missing.exists()
        assert not os.path.exists(os.path.join(node.runtime_dir, "containers", "c1"))  # copied nodes removed
        missing.mkdir()
        info = await isolator.prepare(ContainerID("c1"), config("gpus:2"))  # nothing left in the way
        assert info.cdi_devices == ["gpu-isolator/container=c1"]
        await isolator.cleanup(ContainerID("c1"))


def block(node, name: str) -> str:
    """Put a non-empty directory where a spec file goes: writing or removing it fails."""
    path = os.path.join(node.cdi_dir, f"gpu-isolator-container_{name}.json")
    if os.path.exists(path):
        os.unlink(path)
    os.mkdir(path)
    open(os.path.join(path, "x"), "w").close()
    return path


def unblock(path: str) -> None:
    os.unlink(os.path.join(path, "x"))
    os.rmdir(path)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["memory", "cgroups_v1"])
@pytest.mark.parametrize("before, after", [(1, 3), (3, 1)])
async def test_an_update_whose_spec_cannot_be_written_changes_nothing(node_factory, tmp_path, backend, before,
                                                                      after) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    node = node_factory(backend, gpus=4, cdi_spec_dir=str(cdi_dir))
    node.cdi_dir = str(cdi_dir)
    held = list(range(before))
    async with runtime.Runtime():
        components, isolator = await node.start()
        await isolator.prepare(ContainerID("c1"), config(f"gpus:{before}"))
        blocked = block(node, "c1")
        with raises_isolator_error(f"Failed to write CDI spec '{cdi_dir}/gpu-isolator-container_c1.json': Is a directory") as caught:
            await isolator.update(ContainerID("c1"), Resources.parse(f"gpus:{after}"))
        assert isinstance(caught.value.__cause__, CdiWriteError)
        assert await isolator.containers() == {"c1": held}
        assert len(await components.allocator.available()) == 4 - before
        assert node.kernel_grants() == {"c1": set(held)}  # the kernel went back too
        unblock(blocked)
        await isolator.update(ContainerID("c1"), Resources.parse(f"gpus:{after}"))
        assert_spec_grants(node, components, "c1", list(range(after)))
        await node.clean_all()
        assert os.listdir(cdi_dir) == []


@pytest.mark.asyncio
async def test_a_cleanup_whose_spec_cannot_be_removed_fails_before_changing_anything(cdi_node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(cdi_node, c1="gpus:2")
        blocked = block(cdi_node, "c1")
        with raises_isolator_error(
                f"Failed to remove CDI spec '{cdi_node.cdi_dir}/gpu-isolator-container_c1.json': Is a directory"):
            await isolator.cleanup(ContainerID("c1"))
        assert await isolator.containers() == {"c1": [0, 1]}  # no spec outlives its GPUs' release
        assert len(await components.allocator.available()) == 2
        assert cdi_node.cgroup_exists("c1")
        unblock(blocked)
        await isolator.cleanup(ContainerID("c1"))
        assert await isolator.containers() == {} and ours(cdi_node) == []


@pytest.mark.asyncio
async def test_recover_rewrites_missing_specs_and_removes_unknown_ones(cdi_node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(cdi_node, keep="gpus:2", lost="gpus:1", gone="gpus:1")
        await isolator.cleanup(ContainerID("gone"))
        os.unlink(os.path.join(cdi_node.cdi_dir, "gpu-isolator-container_lost.json"))
        stray = os.path.join(cdi_node.cdi_dir, "gpu-isolator-container_stranger.json")
        with open(os.path.join(cdi_node.cdi_dir, "gpu-isolator-container_keep.json"), "rb") as handle:
            keep_before = handle.read()
        with open(stray, "wb") as handle:
            handle.write(keep_before)
        leftover = os.path.join(cdi_node.cdi_dir, ".gpu-isolator-container_keep.json.99.abcd1234.tmp")
        open(leftover, "w").close()
        components, isolator = await cdi_node.restart(["keep", "lost"])
        assert ours(cdi_node) == ["gpu-isolator-container_keep.json", "gpu-isolator-container_lost.json"]
        assert_spec_grants(cdi_node, components, "keep", [0, 1])
        assert_spec_grants(cdi_node, components, "lost", [2])
        assert others_untouched(cdi_node)
        info = await isolator.prepare(ContainerID("child", ContainerID("keep")), config())
        assert info.cdi_devices == ["gpu-isolator/container=keep"]
        await cdi_node.clean_all()
        assert ours(cdi_node) == []


@pytest.mark.asyncio
async def test_recover_keeps_the_volume_part_of_a_spec_it_finds(cdi_node, tmp_path) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    async with runtime.Runtime():
        components, isolator = await cdi_node.start()
        await isolator.prepare(ContainerID("c1"), config("gpus:1", rootfs=str(rootfs),
                                                        docker_manifest=ImageManifest(labels=LABEL)))
        before = spec_of(cdi_node, "c1")
        components, isolator = await cdi_node.restart(["c1"])
        assert spec_of(cdi_node, "c1") == before
        await isolator.update(ContainerID("c1"), Resources.parse("gpus:2"))
        after = spec_of(cdi_node, "c1").devices[0].container_edits
        assert after.mounts == before.devices[0].container_edits.mounts
        assert after.hooks == before.devices[0].container_edits.hooks and after.hooks
        await cdi_node.clean_all()


@pytest.mark.asyncio
async def test_reconcile_repairs_a_missing_or_changed_spec(cdi_node) -> None:
    async with runtime.Runtime():
        components, isolator = await started_with(cdi_node, a="gpus:1", b="gpus:1")
        assert await isolator.reconcile() == []
        os.unlink(os.path.join(cdi_node.cdi_dir, "gpu-isolator-container_a.json"))
        path_b = os.path.join(cdi_node.cdi_dir, "gpu-isolator-container_b.json")
        document = json.load(open(path_b))
        document["devices"][0]["containerEdits"]["deviceNodes"].append(
            {"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3})
        json.dump(document, open(path_b, "w"))
        repairs = await isolator.reconcile()
        assert sorted((r.container_id, r.description) for r in repairs) == [
            ("a", f"CDI spec '{cdi_node.cdi_dir}/gpu-isolator-container_a.json' was missing; rewritten"),
            ("b", f"CDI spec '{path_b}' differed from the grant; rewritten"),
        ]
        assert_spec_grants(cdi_node, components, "a", [0])
        assert_spec_grants(cdi_node, components, "b", [1])
        assert await isolator.reconcile() == []
        await cdi_node.clean_all()


@pytest.mark.asyncio
async def test_recover_reports_a_spec_dir_it_cannot_use_and_still_recovers(node_factory, tmp_path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    node = node_factory("memory", gpus=2, cdi_spec_dir=str(cdi_dir))
    async with runtime.Runtime():
        components, isolator = await started_with(node, c1="gpus:1")
        os.unlink(cdi_dir / "gpu-isolator-container_c1.json")
        cdi_dir.rmdir()
        cdi_dir.write_text("not a directory")
        components, isolator = await node.restart(["c1"])
        assert await isolator.containers() == {"c1": [0]}
        assert isolator.recovery_report[-1] == (
            "The CDI specs could not be brought in line with the recovered containers: Failed to list CDI specs"
            f" in '{cdi_dir}': '{cdi_dir}' is not a directory")
        cdi_dir.unlink()
        cdi_dir.mkdir()
        repairs = await isolator.reconcile()  # reconcile repairs it once the directory is back
        assert [r.description for r in repairs] == [
            f"CDI spec '{cdi_dir}/gpu-isolator-container_c1.json' was missing; rewritten"]
        await node.clean_all()
