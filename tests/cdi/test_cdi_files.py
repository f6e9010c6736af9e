"""Spec files in a spec directory (R-CD-1): atomic writes, one clear error
for a missing, read-only or full directory, no half-written file, and
nothing but our own files touched.

The read-only and full directories are real tmpfs mounts, made in a child
process's private mount namespace (root only), so a failed test leaves no
mount behind.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from isolators.cdi import CONTAINER_SPEC_PREFIX, CdiWriteError, apply_spec_changes, ensure_spec_file
from isolators.cdi import list_spec_files, read_spec_files, remove_spec_file, write_spec_file

NAME = CONTAINER_SPEC_PREFIX + "c1.json"


def test_write_is_whole_readable_and_leaves_no_temporary(tmp_path) -> None:
    old_umask = os.umask(0o077)
    try:
        path = write_spec_file(str(tmp_path), NAME, b'{"a": 1}\n')
    finally:
        os.umask(old_umask)
    assert path == str(tmp_path / NAME)
    assert (tmp_path / NAME).read_bytes() == b'{"a": 1}\n'
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # engines must read it whatever the umask
    write_spec_file(str(tmp_path), NAME, b'{"a": 2}\n')
    assert (tmp_path / NAME).read_bytes() == b'{"a": 2}\n'
    assert os.listdir(tmp_path) == [NAME]


def test_a_missing_directory_is_one_clear_error_and_is_not_created(tmp_path) -> None:
    missing = tmp_path / "cdi"
    with pytest.raises(CdiWriteError) as caught:
        write_spec_file(str(missing), NAME, b"{}")
    assert str(caught.value) == (
        f"Failed to write CDI spec '{missing}/{NAME}': the CDI spec directory '{missing}' does not exist"
        " (create it first; container engines read /etc/cdi and /var/run/cdi)"
    )
    assert not missing.exists()


def test_a_file_where_the_directory_should_be(tmp_path) -> None:
    (tmp_path / "cdi").write_text("x")
    with pytest.raises(CdiWriteError, match=f"'{tmp_path}/cdi' is not a directory"):
        write_spec_file(str(tmp_path / "cdi"), NAME, b"{}")


def test_a_failed_rename_removes_the_temporary_and_keeps_what_was_there(tmp_path) -> None:
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "keep").write_text("x")
    with pytest.raises(CdiWriteError, match=f"Failed to write CDI spec '{tmp_path}/{NAME}': Is a directory"):
        write_spec_file(str(tmp_path), NAME, b"{}")
    assert sorted(os.listdir(tmp_path)) == [NAME]
    assert (tmp_path / NAME / "keep").read_text() == "x"


@pytest.mark.parametrize("name", ["", "../x.json", "a/b.json", ".hidden.json", "spec.txt", "spec", "x\x00.json"])
def test_bad_file_names_are_refused_before_touching_anything(tmp_path, name: str) -> None:
    with pytest.raises(CdiWriteError, match="Invalid CDI spec file name"):
        write_spec_file(str(tmp_path), name, b"{}")
    assert os.listdir(tmp_path) == []


def test_listing_and_removing_touch_only_our_files(tmp_path) -> None:
    ours = [CONTAINER_SPEC_PREFIX + "a.json", CONTAINER_SPEC_PREFIX + "b.json"]
    leftover = f".{CONTAINER_SPEC_PREFIX}c.json.123.abcd.tmp"
    others = ["nvidia.yaml", "vendor.com-device.json", ".vendor-x.json.1.tmp", CONTAINER_SPEC_PREFIX + "notes.txt"]
    for name in ours + others + [leftover]:
        (tmp_path / name).write_text("{}")
    assert list_spec_files(str(tmp_path), CONTAINER_SPEC_PREFIX) == sorted([leftover] + ours)
    assert remove_spec_file(str(tmp_path), ours[0]) is True
    assert remove_spec_file(str(tmp_path), ours[0]) is False  # already gone: not an error
    assert remove_spec_file(str(tmp_path), leftover) is True
    assert sorted(os.listdir(tmp_path)) == sorted(others + ours[1:])
    assert list_spec_files(str(tmp_path / "absent"), CONTAINER_SPEC_PREFIX) == []
    with pytest.raises(CdiWriteError, match="Invalid CDI spec file name"):
        remove_spec_file(str(tmp_path), "../etc.json")


def test_a_batch_attempts_every_change_and_reports_the_first_failure(tmp_path) -> None:
    (tmp_path / (CONTAINER_SPEC_PREFIX + "gone.json")).write_text("{}")
    (tmp_path / (CONTAINER_SPEC_PREFIX + "blocked.json")).mkdir()
    with pytest.raises(CdiWriteError, match="blocked.json': Is a directory"):
        apply_spec_changes(str(tmp_path), [(CONTAINER_SPEC_PREFIX + "blocked.json", b"{}"),
                                           (CONTAINER_SPEC_PREFIX + "new.json", b"{}")],
                           [CONTAINER_SPEC_PREFIX + "gone.json"])
    assert sorted(os.listdir(tmp_path)) == [CONTAINER_SPEC_PREFIX + "blocked.json", CONTAINER_SPEC_PREFIX + "new.json"]


# -- read-only and full directories: real tmpfs mounts in a private namespace ---------------------

def run_in_private_mounts(directory: str, mount_options: str, body: str) -> str:
    """Mount a tmpfs at ``directory`` in a child's private mount namespace, run ``body`` there."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    program = textwrap.dedent(f"""
        import os, subprocess, sys
        subprocess.run(["mount", "-t", "tmpfs", "-o", {mount_options!r}, "gi-cdi-test", {directory!r}], check=True)
        from isolators.cdi import CdiWriteError, write_spec_file
        d = {directory!r}
    """) + textwrap.dedent(body)
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", program],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def rewrite_failing(tmp_path: os.PathLike[str], mount_options: str, spoil: list[str], new: str) -> list[str]:
    """On a tmpfs (``mount_options``) at ``tmp_path``: write the old spec, run
    the ``spoil`` lines, then try to write ``new`` (a bytes expression) over
    it; what the child printed: the error, then the directory's names and
    the spec's bytes."""
    spoiled = "\n        ".join(spoil)
    return run_in_private_mounts(str(tmp_path), mount_options, f"""
        write_spec_file(d, {NAME!r}, b"old")
        {spoiled}
        try:
            write_spec_file(d, {NAME!r}, {new})
        except CdiWriteError as e:
            print(e)
        print(sorted(os.listdir(d)), open(os.path.join(d, {NAME!r}), "rb").read())
    """).splitlines()


def test_a_read_only_directory_is_one_clear_error_and_the_old_spec_stays(tmp_path) -> None:
    remount = 'subprocess.run(["mount", "-o", "remount,ro", d], check=True)'
    assert rewrite_failing(tmp_path, "size=1m", [remount], 'b"new"') == [
        f"Failed to write CDI spec '{tmp_path}/{NAME}': the CDI spec directory '{tmp_path}' is read-only"
        " (Read-only file system)",
        f"[{NAME!r}] b'old'",
    ]


def test_a_full_directory_is_one_clear_error_with_no_half_written_file(tmp_path) -> None:
    filler = ['with open(os.path.join(d, "filler"), "wb") as f:  # leaves room for part of the new spec',
              '    f.write(b"x" * 40960)']
    assert rewrite_failing(tmp_path, "size=64k", filler, 'b"n" * 65536') == [  # a part fits, the rest does not
        f"Failed to write CDI spec '{tmp_path}/{NAME}': the CDI spec directory '{tmp_path}' is full"
        " (No space left on device)",
        f"{sorted(['filler', NAME])!r} b'old'",
    ]


def test_reading_and_ensuring_our_files(tmp_path) -> None:
    a, b = CONTAINER_SPEC_PREFIX + "a.json", CONTAINER_SPEC_PREFIX + "b.json"
    (tmp_path / a).write_bytes(b"A")
    (tmp_path / f".{b}.1.abcd.tmp").write_bytes(b"partial")
    (tmp_path / "nvidia.yaml").write_bytes(b"theirs")
    assert read_spec_files(str(tmp_path), CONTAINER_SPEC_PREFIX) == {a: b"A"}
    assert ensure_spec_file(str(tmp_path), a, b"A") is None
    assert ensure_spec_file(str(tmp_path), a, b"A2") == "differed"
    assert ensure_spec_file(str(tmp_path), b, b"B") == "missing"
    assert read_spec_files(str(tmp_path), CONTAINER_SPEC_PREFIX) == {a: b"A2", b: b"B"}
    assert (tmp_path / "nvidia.yaml").read_bytes() == b"theirs"
