"""The /dev/nvidia* nodes a container gets (R-IS-3), on real mknod'd nodes."""

from __future__ import annotations

import os
import stat

import pytest

from actors.volume import DeviceNode, DeviceNodeError, copy_device_nodes, nvidia_device_nodes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")

NODES = {  # name -> (major, minor, mode)
    "nvidiactl": (195, 255, 0o666),
    "nvidia0": (195, 0, 0o666),
    "nvidia1": (195, 1, 0o660),
    "nvidia-modeset": (195, 254, 0o666),
    "nvidia-uvm": (508, 0, 0o666),
    "nvidia-uvm-tools": (508, 1, 0o600),
}


def mknod(path, major, minor, mode=0o666):
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    os.chmod(path, mode)


@pytest.fixture
def dev_dir(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, (major, minor, mode) in NODES.items():
        mknod(dev / name, major, minor, mode)
    caps = dev / "nvidia-caps"                    # a directory: never a node
    caps.mkdir()
    mknod(caps / "nvidia-cap1", 511, 1)
    (dev / "nvidia-notes.txt").write_text("x")    # a regular file
    (dev / "nvidia-link").symlink_to("nvidia0")   # a symlink
    mknod(dev / "zero", 1, 5)                     # not nvidia
    return dev


def test_lists_every_nvidia_character_device_but_not_the_caps_directory(dev_dir):
    nodes = nvidia_device_nodes(str(dev_dir))
    assert nodes == [
        DeviceNode(path=str(dev_dir / name), major=major, minor=minor, mode=mode)
        for name, (major, minor, mode) in sorted(NODES.items())
    ]
    assert [n.name for n in nodes] == sorted(NODES)


def test_a_missing_dev_dir_has_no_nodes(tmp_path):
    assert nvidia_device_nodes(str(tmp_path / "none")) == []


def test_copies_are_mode_0666_whatever_the_umask(dev_dir, tmp_path):
    dest = tmp_path / "containers" / "c1" / "devices"
    old = os.umask(0o077)
    try:
        paths = copy_device_nodes(nvidia_device_nodes(str(dev_dir)), str(dest))
    finally:
        os.umask(old)
    assert paths == [str(dest / name) for name in sorted(NODES)]
    for name, (major, minor, _) in NODES.items():
        st = os.lstat(dest / name)
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor)
        assert stat.S_IMODE(st.st_mode) == 0o666
    assert sorted(os.listdir(dest)) == sorted(NODES)


def test_copying_twice_is_harmless_and_a_stale_copy_is_replaced(dev_dir, tmp_path):
    nodes = nvidia_device_nodes(str(dev_dir))
    dest = tmp_path / "devices"
    copy_device_nodes(nodes, str(dest))
    os.chmod(dest / "nvidia0", 0o600)
    os.unlink(dest / "nvidia-uvm")
    mknod(dest / "nvidia-uvm", 237, 0)                 # numbers changed since
    assert copy_device_nodes(nodes, str(dest)) == [str(dest / n) for n in sorted(NODES)]
    st = os.lstat(dest / "nvidia-uvm")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (508, 0)
    assert stat.S_IMODE(os.lstat(dest / "nvidia0").st_mode) == 0o666


def test_a_file_in_the_way_is_an_error(dev_dir, tmp_path):
    dest = tmp_path / "devices"
    dest.mkdir()
    (dest / "nvidia0").write_text("not a device")
    nodes = [n for n in nvidia_device_nodes(str(dev_dir)) if n.name == "nvidia0"]
    with pytest.raises(DeviceNodeError, match=rf"^Failed to mknod '{dest}/nvidia0' \(195:0\): a file"
                                              " that is not a character device is in the way$"):
        copy_device_nodes(nodes, str(dest))


def test_an_unusable_destination_is_an_error(dev_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DeviceNodeError, match=f"^Failed to create '{blocker}/devices': Not a directory$"):
        copy_device_nodes(nvidia_device_nodes(str(dev_dir)), str(blocker / "devices"))
