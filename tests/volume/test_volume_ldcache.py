"""The ld.so cache parser: every format ldconfig writes, the host's own cache,
and corrupt caches failing with one clear LdCacheError."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.volume import LdCacheEntry, LdCacheError, parse_ld_cache, read_ld_cache

X86_64_LIBC6 = 0x0303
LIBC6 = 0x0003


def ldconfig_listing(cache: str) -> list[tuple[str, str, str]]:
    """(name, flags text, path) as ``ldconfig -p -C cache`` prints them."""
    out = subprocess.run(["ldconfig", "-p", "-C", cache], capture_output=True,
                         text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        match = re.match(r"^\t(\S+) \((.*)\) => (.*)$", line)
        if match:
            rows.append((match.group(1), match.group(2), match.group(3)))
    return rows


@pytest.mark.parametrize("fmt", ["new", "compat", "old"])
def test_every_ldconfig_format_parses_to_what_ldconfig_prints(fake_driver, fmt):
    dirs = ["lib64"] + (["lib32"] if fake_driver.has_32bit else [])
    cache = fake_driver.cache(f"fmt-{fmt}", dirs, fmt=fmt)
    entries = read_ld_cache(str(cache))
    assert [(e.name, e.arch, e.path) for e in entries] == ldconfig_listing(str(cache))
    names = {e.name for e in entries}
    assert {"libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libEGL.so.1",
            "libnvidia-tls.so.550.54.15"} <= names
    for entry in entries:
        assert entry.is_elf
        assert entry.path.startswith(str(fake_driver.base))


def test_the_three_formats_agree(fake_driver):
    dirs = ["lib64"] + (["lib32"] if fake_driver.has_32bit else [])
    parsed = {
        fmt: [(e.name, e.path, e.flags) for e in read_ld_cache(
            str(fake_driver.cache(f"agree-{fmt}", dirs, fmt=fmt)))]
        for fmt in ("new", "compat", "old")
    }
    assert parsed["new"] == parsed["compat"] == parsed["old"]


def test_flags_say_which_entries_are_64_bit(fake_driver, driver_cache):
    entries = read_ld_cache(str(driver_cache))
    lib64 = str(fake_driver.dirs["lib64"])
    for entry in entries:
        if entry.path.startswith(lib64 + "/"):
            assert entry.flags == X86_64_LIBC6 and entry.is_64bit
            assert entry.arch == "libc6,x86-64"
    if not fake_driver.has_32bit:
        pytest.skip(f"no 32-bit libraries: {fake_driver.no_32bit_reason}")
    lib32 = [e for e in entries if e.path.startswith(str(fake_driver.dirs["lib32"]) + "/")]
    assert {e.name for e in lib32} == {"libcuda.so.1", "libGLX_nvidia.so.0"}
    for entry in lib32:
        # No libc NEEDED (built -nostdlib), so ldconfig types them plain "ELF".
        assert entry.flags & 0xFF00 == 0 and entry.is_elf and not entry.is_64bit
        assert entry.arch in ("ELF", "libc6")


@pytest.mark.host_facts  # the host's own cache, on purpose (parsed only, nothing copied)
def test_the_hosts_own_cache_parses_like_ldconfig_prints_it():
    if not os.path.exists("/etc/ld.so.cache") or shutil.which("ldconfig") is None:
        pytest.skip("no /etc/ld.so.cache or ldconfig on this machine")
    entries = read_ld_cache()
    listing = ldconfig_listing("/etc/ld.so.cache")
    assert len(entries) > 10
    assert [(e.name, e.path) for e in entries] == [(n, p) for n, _, p in listing]
    assert any(e.name.startswith("libc.so.") for e in entries)


def test_hand_written_new_and_old_caches(cache_bytes):
    new, old = cache_bytes
    rows = [("libcuda.so.1", "/x/libcuda.so.1", X86_64_LIBC6),
            ("liba.out.so", "/x/liba.out.so", 0x0000),
            ("libcuda.so.1", "/y/libcuda.so.1", LIBC6)]
    expected = [(n, p, f) for n, p, f in rows]
    for data in (new(rows), old(rows), new(rows, order=">")):
        entries = parse_ld_cache(data, "hand")
        assert [(e.name, e.path, e.flags) for e in entries] == expected
    entries = parse_ld_cache(new(rows), "hand")
    assert [e.is_elf for e in entries] == [True, False, True]
    assert [e.is_64bit for e in entries] == [True, False, False]
    assert entries[1].arch == "libc4"
    native = new(rows, order="<" if sys.byteorder == "little" else ">", endian_flag=0)
    assert [(e.name, e.path) for e in parse_ld_cache(native)] == [(n, p) for n, p, _ in rows]


def test_entry_is_a_frozen_struct():
    entry = LdCacheEntry(name="libcuda.so.1", path="/x", flags=X86_64_LIBC6)
    with pytest.raises(AttributeError):
        entry.name = "other"  # type: ignore[misc]


# -- corrupt caches ----------------------------------------------------------
def _valid(cache_bytes) -> bytes:
    new, _ = cache_bytes
    return new([("libcuda.so.1", "/x/libcuda.so.1", X86_64_LIBC6),
                ("libGL.so.1", "/x/libGL.so.1", X86_64_LIBC6)])


def _corrupt(cache_bytes, how: str) -> bytes:
    data = bytearray(_valid(cache_bytes))
    if how == "empty":
        return b""
    if how == "magic":
        return b"not a cache at all, really" + bytes(data[26:])
    if how == "short header":
        return bytes(data[:30])
    if how == "entry count":
        data[20:24] = (1000).to_bytes(4, "little")
        return bytes(data)
    if how == "string table":
        return bytes(data[:-5])
    if how == "offset":
        data[48 + 4:48 + 8] = (10_000).to_bytes(4, "little")
        return bytes(data)
    if how == "nul":
        data[-1:] = b"X"
        return bytes(data)
    if how == "byte order":
        data[28] = 1
        return bytes(data)
    raise AssertionError(how)


@pytest.mark.parametrize("how, message", [
    ("empty", r"the file is empty"),
    ("magic", r"unknown magic b'not a cache at all, '"),
    ("short header", r"truncated: the new-format header at offset 0 needs 48 bytes, the file has 30"),
    ("entry count", r"truncated: the header lists 1000 entries \(24000 bytes\) but only \d+ bytes follow it"),
    ("string table", r"truncated: the string table of \d+ bytes runs 5 bytes past the end"),
    ("offset", r"entry 0: name offset 10000 is outside the string table"),
    ("nul", r"entry 1: path at offset \d+ is not NUL-terminated"),
    ("byte order", r"invalid byte-order flag 1"),
])
def test_corrupt_caches_fail_with_one_clear_error(tmp_path, cache_bytes, how, message):
    path = tmp_path / "ld.so.cache"
    path.write_bytes(_corrupt(cache_bytes, how))
    with pytest.raises(LdCacheError) as info:
        read_ld_cache(str(path))
    text = str(info.value)
    assert text.startswith(f"Invalid ld.so cache '{path}': ")
    assert re.search(message, text), text
    assert info.value.__cause__ is None


def test_truncated_old_format_cache(cache_bytes):
    _, old = cache_bytes
    data = old([("libcuda.so.1", "/x/libcuda.so.1", X86_64_LIBC6)] * 3)
    with pytest.raises(LdCacheError, match=r"the old-format header lists 3 entries \(36 bytes\)"
                                           r" but only 20 bytes follow it"):
        parse_ld_cache(data[:36], "/old")
    with pytest.raises(LdCacheError, match="the old-format header needs 16 bytes, the file has 12"):
        parse_ld_cache(data[:12], "/old")


def test_missing_cache_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(LdCacheError,
                       match=f"Failed to read ld.so cache '{missing}': No such file or directory"):
        read_ld_cache(str(missing))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_gives_a_cache_error_or_entries_never_a_crash(cache_bytes, data):
    valid = bytearray(_valid(cache_bytes))
    cut = data.draw(st.integers(0, len(valid)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)),
                               max_size=4))
    damaged = valid[:]
    for position, byte in flips:
        damaged[position] = byte
    damaged = bytes(damaged[:cut])
    try:
        entries = parse_ld_cache(damaged, "/fuzz")
    except LdCacheError as exc:
        assert str(exc).startswith("Invalid ld.so cache '/fuzz': ")
    else:
        assert all(isinstance(e, LdCacheEntry) for e in entries)
