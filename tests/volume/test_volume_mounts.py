"""The noexec check's mount table reading (pure parts, and the non-root path)."""

from __future__ import annotations

import logging

import pytest

from actors.volume import VolumeError
from actors.volume import _mount
from actors.volume._mount import ensure_executable, mount_of, read_mount_table

TABLE = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:40 / /var/lib/foo rw,noexec,relatime - tmpfs tmpfs rw
41 27 0:41 / /var/lib/foobar rw,relatime - tmpfs tmpfs rw
42 40 0:42 / /var/lib/foo/stacked rw,noexec - tmpfs tmpfs rw
43 40 0:43 / /var/lib/foo/stacked rw,nosuid,nodev - tmpfs tmpfs rw,mode=755
44 27 0:44 / /mnt/with\\040space rw,noexec shared:1 master:2 - tmpfs my\\040src rw
"""


@pytest.fixture
def table_file(tmp_path):
    path = tmp_path / "mountinfo"
    path.write_text(TABLE)
    return path


def test_reads_targets_options_types_and_unescapes(table_file):
    table = read_mount_table(str(table_file))
    assert [m.target for m in table] == ["/", "/var/lib/foo", "/var/lib/foobar", "/var/lib/foo/stacked",
                                         "/var/lib/foo/stacked", "/mnt/with space"]
    assert table[5].source == "my src" and table[5].fs_type == "tmpfs"
    assert "noexec" in table[1].options and table[0].options == ("rw", "relatime")


@pytest.mark.parametrize("path, target, noexec", [
    ("/var/lib/foo/nvidia_1", "/var/lib/foo", True),
    ("/var/lib/foo", "/var/lib/foo", True),
    ("/var/lib/foobar/nvidia_1", "/var/lib/foobar", False),   # whole components only
    ("/var/lib/fo", "/", False),
    ("/var/lib/foo/stacked/x", "/var/lib/foo/stacked", False),  # the topmost of a stack
    ("/mnt/with space/v", "/mnt/with space", True),
])
def test_the_mount_holding_a_path(table_file, path, target, noexec):
    mount = mount_of(path, read_mount_table(str(table_file)))
    assert mount.target == target
    assert ("noexec" in mount.options) is noexec


def test_a_malformed_table_is_an_error(tmp_path):
    path = tmp_path / "mountinfo"
    path.write_text("27 1 254:0 / / rw no separator here\n")
    with pytest.raises(VolumeError, match="^Failed to get mount table: malformed line in"):
        read_mount_table(str(path))


def test_without_root_a_noexec_volume_is_built_with_a_warning(tmp_path, monkeypatch, caplog):
    volume = tmp_path / "nvidia_1"
    volume.mkdir()
    table = tmp_path / "mountinfo"
    table.write_text(f"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                     f"50 27 0:50 / {tmp_path} rw,noexec - tmpfs tmpfs rw\n")
    monkeypatch.setattr(_mount.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(_mount, "_mount_tmpfs", lambda target: pytest.fail("must not mount"))
    with caplog.at_level(logging.WARNING):
        assert ensure_executable(str(volume), str(table)) is False
    assert "mounted noexec; only root can mount a tmpfs over it" in caplog.text


def test_an_exec_filesystem_needs_nothing(tmp_path, monkeypatch):
    table = tmp_path / "mountinfo"
    table.write_text("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    monkeypatch.setattr(_mount, "_mount_tmpfs", lambda target: pytest.fail("must not mount"))
    assert ensure_executable(str(tmp_path), str(table)) is False
