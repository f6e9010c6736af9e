"""The one reader of kept files: versions, and what it does with a file it cannot read (SPEC R-SH-3)."""

from __future__ import annotations

import os

import msgspec
import pytest

from actors.file_format import UnreadableFile, decode_versioned, set_aside


class Record(msgspec.Struct):
    names: list[str]
    version: int = 0


def test_a_file_without_a_version_is_version_0_and_a_known_version_is_read():
    assert decode_versioned(b'{"names": ["a"]}', Record, "/r.json", (0, 1)) == Record(["a"], 0)
    assert decode_versioned(b'{"names": [], "version": 1, "later": 3}', Record, "/r.json", (0, 1)) == Record([], 1)


@pytest.mark.parametrize("data, reason", [
    (b"", "the file is empty (a write that never finished?)"),
    (b'{"names": ["a"', "it is not a JSON object: truncated or not this project's file"),
    (b"\x00\xff garbage", "it is not a JSON object: truncated or not this project's file"),
    (b'{"version": 7, "names": []}', "it is in format version 7, and this release reads versions 0, 1"
                                     " (a later release wrote it?)"),
    (b'{"version": "one"}', "its format version is not a number"),
    (b'{"version": 1, "names": 3}', "it does not hold what format version 1 holds"),
])
def test_a_file_it_cannot_read_is_one_error_naming_the_file_and_what_is_wrong(data, reason):
    with pytest.raises(UnreadableFile) as caught:
        decode_versioned(data, Record, "/var/lib/x/r.json", (0, 1))
    assert caught.value.path == "/var/lib/x/r.json"
    assert caught.value.reason.startswith(reason)
    assert str(caught.value).startswith(f"/var/lib/x/r.json: {reason}")


def test_set_aside_moves_the_file_next_to_itself_and_never_overwrites_an_earlier_one(tmp_path):
    path = tmp_path / "prepared-claims.json"
    moved = []
    for content in (b"first", b"second"):
        path.write_bytes(content)
        moved.append(set_aside(str(path)))
    assert not path.exists()
    assert [open(m, "rb").read() for m in moved] == [b"first", b"second"]
    assert all(os.path.basename(m).startswith("prepared-claims.json.unreadable-") for m in moved)
    assert os.path.dirname(moved[0]) == str(tmp_path)
