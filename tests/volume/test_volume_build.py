"""R-VO-1: the volume built from a fake driver (gcc) and a real ldconfig cache,
driven through the actor handle ``NvidiaVolume``."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from actors import NvidiaVolume
from actors.volume import LIBRARIES, ElfError, LdCacheError, VolumeError, library_skip_reason, read_elf, read_ld_cache
from actors.volume._build import VENDOR_NEUTRAL
from actors.volume.testing import write_ld_cache
from actors.volume._mount import mount_of, read_mount_table
from actors.volume._elf import ElfInfo
from runtime import Runtime, snapshot

V = "550.54.15"


def listing(root: str) -> dict[str, str]:
    """Every entry under ``root``: 'dir', 'file' or 'link:<target>'."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root)
            if os.path.islink(path):
                found[relative] = f"link:{os.readlink(path)}"
            elif os.path.isdir(path):
                found[relative] = "dir"
            else:
                found[relative] = "file"
    return found


def expected_volume(driver) -> dict[str, str]:
    expected = {"bin": "dir", "lib": "dir", "lib64": "dir",
                "bin/nvidia-smi": "file", "bin/nvidia-debugdump": "file"}

    def library(subdir: str, real: str, *links: str) -> None:
        expected[f"{subdir}/{real}"] = "file"
        for link in links:
            expected[f"{subdir}/{link}"] = f"link:{real}"

    library("lib64", f"libnvidia-ml.so.{V}", "libnvidia-ml.so.1", "libnvidia-ml.so")
    library("lib64", f"libcuda.so.{V}", "libcuda.so.1", "libcuda.so")
    library("lib64", f"libGLX_nvidia.so.{V}", "libGLX_nvidia.so.0", "libGLX_indirect.so.0")
    library("lib64", "libEGL.so.1.1.0", "libEGL.so.1")            # NEEDs libGLdispatch.so.0
    library("lib64", "libGLESv2.so.2.1.0", "libGLESv2.so.2")      # NEEDs libnvidia-glcore
    library("lib64", f"libnvidia-glcore.so.{V}")                  # cache name == file name
    library("lib64", f"libnvidia-tls.so.{V}")                     # ABI 2.3.99
    if driver.has_32bit:
        library("lib", f"libcuda.so.{V}", "libcuda.so.1")
        library("lib", f"libGLX_nvidia.so.{V}", "libGLX_nvidia.so.0", "libGLX_indirect.so.0")
    return expected


def source_of(driver, relative: str) -> Path:
    subdir, name = relative.split("/")
    if subdir == "bin":
        return Path(os.path.realpath(shutil.which(name, path=driver.search_path)))
    return driver.dirs["lib32" if subdir == "lib" else "lib64"] / name


@pytest.mark.asyncio
async def test_builds_every_file_and_link(fake_driver, driver_cache, volume_dir):
    async with Runtime():
        volume = await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(driver_cache),
                                           search_path=fake_driver.search_path)
        assert volume.host_path == str(volume_dir / f"nvidia_{V}")
        assert volume.container_path == "/usr/local/nvidia"
        expected = expected_volume(fake_driver)
        assert listing(volume.host_path) == expected
        for relative, kind in expected.items():
            if kind == "file":
                copy = Path(volume.host_path, relative)
                assert copy.read_bytes() == source_of(fake_driver, relative).read_bytes(), relative
        # Binaries are copied as executables (the symlinked one by its real path).
        smi = os.path.join(volume.host_path, "bin", "nvidia-smi")
        assert os.access(smi, os.X_OK)
        assert subprocess.run([smi], capture_output=True, text=True).stdout == "fake nvidia-smi\n"
        dump = os.path.join(volume.host_path, "bin", "nvidia-debugdump")
        assert not os.path.islink(dump)
        assert subprocess.run([dump], capture_output=True, text=True).stdout == "fake nvidia-debugdump\n"
        # Every link resolves inside its own directory.
        for relative, kind in expected.items():
            if kind.startswith("link:"):
                assert os.path.isfile(os.path.join(volume.host_path, relative))
        report = volume.report
        assert set(report.added) == {k for k, v in expected.items() if v != "dir"}
        assert not report.tmpfs_mounted
        skipped = "\n".join(report.skipped)
        assert "libGL.so.1 (" in skipped and "vendor-neutral GL library" in skipped
        assert "libnvidia-tls.so.1 (" in skipped and "ABI none, not 2.3.99" in skipped
        assert "libnvidia-tls.so.2 (" in skipped and "ABI 2.3.0, not 2.3.99" in skipped
        assert "nvidia-persistenced: not found on the search path" in skipped
        if not fake_driver.has_32bit:
            pytest.skip(f"32-bit part not checked: {fake_driver.no_32bit_reason}")


@pytest.mark.asyncio
async def test_the_volume_only_grows(fake_driver, driver_cache, volume_dir, tmp_path):
    cache = tmp_path / "ld.so.cache"           # the file the actor reads; swapped below
    shutil.copy(driver_cache, cache)
    dirs = ["lib64"] + (["lib32"] if fake_driver.has_32bit else [])
    with_extra = fake_driver.cache("grow-extra", dirs + ["extra64"])
    only_extra = fake_driver.cache("grow-only-extra", ["extra64"])
    async with Runtime():
        volume = await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(cache),
                                           search_path=fake_driver.search_path)
        before = listing(volume.host_path)
        # A file a running container may use, and a binary with other content.
        Path(volume.host_path, "lib64", "from-an-older-build.so").write_text("keep me")
        Path(volume.host_path, "bin", "nvidia-smi").write_text("#!/bin/sh\necho older\n")

        again = await volume.refresh()          # same cache: nothing to add
        assert again.added == ()

        shutil.copy(with_extra, cache)          # a new library appears in the cache
        grown = await volume.refresh()
        assert grown.added == ("lib64/libnvidia-encode.so.550.54.15",
                               "lib64/libnvidia-encode.so.1")

        shutil.copy(only_extra, cache)          # libraries vanish from the cache
        shrunk = await volume.refresh()
        assert shrunk.added == ()
        after = listing(volume.host_path)
        assert before.items() <= after.items()
        assert Path(volume.host_path, "lib64", "from-an-older-build.so").read_text() == "keep me"
        assert Path(volume.host_path, "bin", "nvidia-smi").read_text() == "#!/bin/sh\necho older\n"

        # A second handle on the same directory (an agent restart) adds nothing.
        restarted = await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(with_extra),
                                              search_path=fake_driver.search_path)
        assert restarted.report.added == ()
        assert listing(volume.host_path) == after


@pytest.mark.asyncio
async def test_concurrent_refreshes_never_overlap(fake_driver, driver_cache, volume_dir):
    async with Runtime():
        volume = await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(driver_cache),
                                           search_path=fake_driver.search_path)
        shutil.rmtree(os.path.join(volume.host_path, "lib64"))
        reports = await asyncio.gather(*(volume.refresh() for _ in range(5)))
        added = [r.added for r in reports]
        assert [len(a) for a in added[1:]] == [0, 0, 0, 0]    # the first did it all
        assert listing(volume.host_path) == expected_volume(fake_driver)
        assert not [p for p in listing(volume.host_path) if ".partial-" in p]


@pytest.mark.asyncio
async def test_default_search_path_is_the_process_path(fake_driver, driver_cache, volume_dir,
                                                        monkeypatch):
    monkeypatch.setenv("PATH", fake_driver.search_path)
    async with Runtime():
        volume = await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(driver_cache))
    assert os.path.isfile(os.path.join(volume.host_path, "bin", "nvidia-smi"))


@pytest.mark.asyncio
async def test_stale_cache_entries_are_skipped_with_a_warning(tmp_path, volume_dir, cache_bytes, caplog):
    new, _ = cache_bytes
    cache = tmp_path / "stale.cache"
    gone = tmp_path / "gone" / "libcuda.so.1"
    cache.write_bytes(new([("libcuda.so.1", str(gone), 0x0303)]))
    with caplog.at_level(logging.WARNING):
        async with Runtime():
            volume = await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(cache),
                                               search_path="")
    assert volume.report.added == ()
    assert volume.report.skipped[-1] == (
        f"libcuda.so.1 ({gone}): the ld.so cache names a file that does not exist"
        " (stale cache? run ldconfig)")
    assert "does not exist" in caplog.text


@pytest.mark.asyncio
async def test_a_non_elf_library_fails_the_build_and_stops_the_actor(tmp_path, volume_dir, cache_bytes):
    new, _ = cache_bytes
    script = tmp_path / "libcuda.so.1"
    script.write_text("INPUT ( libcuda.so.550 )\n")
    cache = tmp_path / "bad.cache"
    cache.write_bytes(new([("libcuda.so.1", str(script), 0x0303)]))
    async with Runtime():
        with pytest.raises(ElfError, match=f"^Failed to load ELF file '{script}': not an ELF file"):
            await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(cache), search_path="")
        assert not [pid for pid in snapshot() if pid.startswith("nvidia-volume")]


@pytest.mark.asyncio
async def test_a_corrupt_or_missing_cache_fails_the_build(tmp_path, volume_dir):
    corrupt = tmp_path / "corrupt.cache"
    corrupt.write_bytes(b"glibc-ld.so.cache1.1" + b"\xff" * 10)
    async with Runtime():
        with pytest.raises(LdCacheError, match=f"^Invalid ld.so cache '{corrupt}': truncated"):
            await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(corrupt), search_path="")
        with pytest.raises(LdCacheError, match="No such file or directory"):
            await NvidiaVolume.create(str(volume_dir), V, ld_cache=str(tmp_path / "none"),
                                      search_path="")


@pytest.mark.asyncio
@pytest.mark.parametrize("version", ["", "../x", "a/b", ".."])
async def test_an_unusable_driver_version_is_refused(volume_dir, version):
    async with Runtime():
        with pytest.raises(VolumeError, match="Invalid driver version"):
            await NvidiaVolume.create(str(volume_dir), version)


def test_the_library_list_is_mesos_list():
    assert LIBRARIES[:3] == ("libnvidia-ml.so", "libnvidia-cfg.so", "libcuda.so")
    assert set(LIBRARIES) >= VENDOR_NEUTRAL | {"libGLX_nvidia.so", "libnvidia-tls.so"}
    assert "libGLdispatch.so" not in LIBRARIES          # the image's loader, not the driver's
    assert len(LIBRARIES) == len(set(LIBRARIES)) == 24


@pytest.mark.parametrize("needed, kept", [
    (("libGLdispatch.so.0",), True),           # the real GLVND name (Mesos misses it)
    (("libGLdispatch.so",), True),
    (("libc.so.6", "libnvidia-glcore.so.550"), True),
    (("libnvidia-eglcore.so.550",), True),
    (("libGLX_mesa.so.0", "libc.so.6"), False),
    (("libmyGLdispatch.so.0",), False),        # must start with, not contain
    ((), False),
])
def test_vendor_neutral_rule(needed, kept):
    info = ElfInfo(path="/x", elf_class=64, machine="EM_X86_64", needed=needed)
    for library in VENDOR_NEUTRAL:
        assert (library_skip_reason(library, info) is None) is kept
    assert library_skip_reason("libcuda.so", info) is None


def test_tls_rule():
    def info(abi):
        return ElfInfo(path="/x", elf_class=64, machine="EM_X86_64", abi_version=abi)
    assert library_skip_reason("libnvidia-tls.so", info("2.3.99")) is None
    assert library_skip_reason("libnvidia-tls.so", info("2.3.0")) == "TLS library with ABI 2.3.0, not 2.3.99"
    assert library_skip_reason("libnvidia-tls.so", info(None)) == "TLS library with ABI none, not 2.3.99"


@pytest.mark.asyncio
@pytest.mark.host_facts  # the host's own cache, on purpose
async def test_the_hosts_cache_builds_and_keeps_glvnd_gl_libraries(volume_dir):
    """Smoke test on the machine's own cache: GL loaders that NEED the real
    ``libGLdispatch.so.0`` are kept (Mesos' exact match would drop them).
    Only the host's vendor-neutral entries are built (a cache of those rows,
    as the host lists them): on a GPU host the whole cache would copy every
    driver library (300 MB) that this test does not look at."""
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no /etc/ld.so.cache on this machine")
    host_entries = [e for e in read_ld_cache() if any(e.name.startswith(n) for n in VENDOR_NEUTRAL)]
    cache = write_ld_cache(volume_dir.parent / "vendor-neutral.cache",
                           [(e.name, e.path, e.flags) for e in host_entries])
    async with Runtime():
        volume = await NvidiaVolume.create(str(volume_dir), "host-smoke", ld_cache=cache, search_path="")
    for relative, kind in listing(volume.host_path).items():
        path = os.path.join(volume.host_path, relative)
        if kind == "file":
            assert read_elf(path).elf_class == (32 if relative.startswith("lib/") else 64)
        elif kind.startswith("link:"):
            assert "/" not in kind and os.path.isfile(path)
    for entry in host_entries:
        library = next((n for n in VENDOR_NEUTRAL if entry.name.startswith(n)), None)
        if library is None or not os.path.exists(entry.path):
            continue
        info = read_elf(os.path.realpath(entry.path))
        subdir = "lib" if info.elf_class == 32 else "lib64"
        present = os.path.lexists(os.path.join(volume.host_path, subdir, entry.name))
        assert present == (library_skip_reason(library, info) is None), entry


@pytest.mark.asyncio
async def test_a_noexec_filesystem_gets_a_tmpfs_over_the_volume(fake_driver, driver_cache, volume_dir,
                                                              caplog):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    noexec = volume_dir / "noexec"
    noexec.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=16m", "tmpfs", str(noexec)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    # (the volume_dir fixture unmounts everything under it afterwards)
    with caplog.at_level(logging.INFO, logger="actors.volume._mount"):
        async with Runtime():
            volume = await NvidiaVolume.create(str(noexec), V, ld_cache=str(driver_cache),
                                               search_path=fake_driver.search_path)
            assert volume.report.tmpfs_mounted
            mount = mount_of(os.path.realpath(volume.host_path), read_mount_table())
            assert mount.target == volume.host_path and mount.fs_type == "tmpfs"
            assert "noexec" not in mount.options and "nosuid" in mount.options
            smi = os.path.join(volume.host_path, "bin", "nvidia-smi")
            assert subprocess.run([smi], capture_output=True, text=True).stdout == "fake nvidia-smi\n"
            assert listing(volume.host_path) == expected_volume(fake_driver)
            # Rebuilding finds an executable filesystem: no second mount.
            again = await NvidiaVolume.create(str(noexec), V, ld_cache=str(driver_cache),
                                              search_path=fake_driver.search_path)
            assert not again.report.tmpfs_mounted
    assert f"Mounted a tmpfs over the NVIDIA volume '{volume.host_path}'" in caplog.text
    assert "mounted noexec" in caplog.text
