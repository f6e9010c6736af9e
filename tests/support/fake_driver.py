"""A fake NVIDIA driver built with gcc, real loader caches written by
``ldconfig``, hand-written caches for the corrupt cases, and mount hygiene
(for the NVIDIA volume tests).

Rules:
- ``build_fake_driver(base)`` builds the driver's libraries (64-bit, and
  32-bit when ``gcc -m32`` links here) and binaries under ``base``; it needs
  gcc and ldconfig (``have_tool``). The libraries live under an ldconfig
  root (``ldconfig -r ROOT``) so a cache lists only the fake libraries,
  never the host's; each library directory a cache names
  (``<base>/lib64`` ...) is a symlink to the real directory inside that
  root, so the cache's paths resolve on the host. ``FakeDriver.cache``
  writes a cache of some of its directories.
- ``new_cache_bytes`` (from ``actors.volume.testing``) / ``old_cache_bytes``:
  caches written by hand, for what ``ldconfig`` never writes (corrupt,
  foreign byte order, old format).
- ``unmount_all_under(path)``: unmount everything a test mounted there.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from actors.volume.testing import new_cache_bytes

VERSION = "550.54.15"

ABI_NOTE = (
    '__asm__(".section .note.ABI-tag,\\"a\\",@note\\n.p2align 2\\n'
    '.long 4,16,1\\n.asciz \\"GNU\\"\\n.long 0,{major},{minor},{tiny}\\n.previous\\n");\n'
)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True)


def have_tool(name: str) -> bool:
    return shutil.which(name) is not None


@dataclass
class Library:
    """One fake library: its file, its soname and what links to it."""

    directory: str          # key of FakeDriver.dirs
    filename: str
    soname: str
    needed: tuple[str, ...] = ()   # filenames (same directory) it links against
    abi: tuple[int, int, int] | None = None
    dev_link: str | None = None    # e.g. libcuda.so -> soname


@dataclass
class FakeDriver:
    base: Path
    root: Path
    dirs: dict[str, Path] = field(default_factory=dict)     # name -> host path
    libraries: list[Library] = field(default_factory=list)
    bin_dirs: list[Path] = field(default_factory=list)
    has_32bit: bool = False
    no_32bit_reason: str = ""

    @property
    def search_path(self) -> str:
        return ":".join(str(d) for d in self.bin_dirs)

    def host_dir(self, name: str) -> Path:
        path = self.base / name
        real = self.root / str(path).lstrip("/")
        real.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.symlink_to(real)
        self.dirs[name] = path
        return path

    def real_file(self, lib: Library) -> Path:
        return Path(os.path.realpath(self.dirs[lib.directory] / lib.filename))

    def cache(self, name: str, dirs: list[str], fmt: str = "new") -> Path:
        """Write a loader cache of ``dirs`` with ``ldconfig -c fmt``."""
        conf = self.root / f"{name}.conf"
        conf.write_text("".join(f"{self.dirs[d]}\n" for d in dirs))
        result = _run("ldconfig", "-c", fmt, "-r", str(self.root), "-C", f"/{name}.cache",
                      "-f", f"/{name}.conf", "-X", "-i")
        assert result.returncode == 0, result.stderr
        return self.root / f"{name}.cache"


def compile_library(driver: FakeDriver, lib: Library, m32: bool = False) -> None:
    directory = driver.dirs[lib.directory]
    source = driver.base / "src" / f"{lib.directory}-{lib.filename}.c"
    source.parent.mkdir(exist_ok=True)
    symbol = "".join(c if c.isalnum() else "_" for c in lib.filename)
    text = f"int {symbol}_{lib.directory}(void) {{ return 1; }}\n"
    if lib.abi is not None:
        major, minor, tiny = lib.abi
        text += ABI_NOTE.format(major=major, minor=minor, tiny=tiny)
    source.write_text(text)
    argv = ["gcc", "-shared", "-fPIC", "-nostdlib", "-o", str(directory / lib.filename),
            f"-Wl,-soname,{lib.soname}", str(source)]
    if m32:
        argv.insert(1, "-m32")
    if lib.needed:  # no symbols are used, so keep the NEEDED entries explicitly
        argv += ["-Wl,--no-as-needed"] + [str(directory / dep) for dep in lib.needed]
    result = _run(*argv)
    assert result.returncode == 0, result.stderr
    if lib.soname != lib.filename:
        (directory / lib.soname).symlink_to(lib.filename)
    if lib.dev_link:
        (directory / lib.dev_link).symlink_to(lib.soname)
    driver.libraries.append(lib)


def probe_32bit(base: Path) -> str:
    """'' if ``gcc -m32 -shared -nostdlib`` links, else why not."""
    source = base / "probe32.c"
    source.write_text("int probe(void) { return 0; }\n")
    result = _run("gcc", "-m32", "-shared", "-fPIC", "-nostdlib", "-o",
                  str(base / "probe32.so"), str(source))
    if result.returncode != 0:
        return f"gcc -m32 -shared -nostdlib fails here: {result.stderr.strip()[:200]}"
    return ""


def build_fake_driver(base: Path) -> FakeDriver:
    """The fake driver under ``base`` (see the module rules)."""
    driver = FakeDriver(base=base, root=base / "root")
    driver.host_dir("lib64")
    driver.host_dir("extra64")
    v = VERSION
    for lib in [
        Library("lib64", f"libnvidia-ml.so.{v}", "libnvidia-ml.so.1", dev_link="libnvidia-ml.so"),
        Library("lib64", f"libcuda.so.{v}", "libcuda.so.1", dev_link="libcuda.so"),
        Library("lib64", f"libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0"),
        Library("lib64", "libGLdispatch.so.0.0.0", "libGLdispatch.so.0"),
        Library("lib64", "libEGL.so.1.1.0", "libEGL.so.1", needed=("libGLdispatch.so.0.0.0",)),
        Library("lib64", "libGL.so.1.7.0", "libGL.so.1"),          # vendor-neutral, not GLVND
        Library("lib64", f"libnvidia-glcore.so.{v}", f"libnvidia-glcore.so.{v}"),
        Library("lib64", "libGLESv2.so.2.1.0", "libGLESv2.so.2",
                needed=(f"libnvidia-glcore.so.{v}",)),
        Library("lib64", f"libnvidia-tls.so.{v}", f"libnvidia-tls.so.{v}", abi=(2, 3, 99)),
        Library("lib64", "libnvidia-tls.so.1.0", "libnvidia-tls.so.1"),             # no note
        Library("lib64", "libnvidia-tls.so.2.0", "libnvidia-tls.so.2", abi=(2, 3, 0)),
        Library("lib64", "libfoo.so.1.0", "libfoo.so.1"),           # not a driver library
        Library("extra64", f"libnvidia-encode.so.{v}", "libnvidia-encode.so.1"),
    ]:
        compile_library(driver, lib)
    driver.no_32bit_reason = probe_32bit(base)
    if not driver.no_32bit_reason:
        driver.host_dir("lib32")
        for lib in [
            Library("lib32", f"libcuda.so.{v}", "libcuda.so.1"),
            Library("lib32", f"libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0"),
        ]:
            compile_library(driver, lib, m32=True)
        driver.has_32bit = True

    # Binaries: nvidia-smi in the second search directory; nvidia-debugdump
    # a symlink to a script elsewhere (copied by its real path).
    sbin, bin_, elsewhere = base / "sbin", base / "bin", base / "elsewhere"
    for d in (sbin, bin_, elsewhere):
        d.mkdir()
    smi = bin_ / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho fake nvidia-smi\n")
    smi.chmod(0o755)
    dump = elsewhere / "debugdump.sh"
    dump.write_text("#!/bin/sh\necho fake nvidia-debugdump\n")
    dump.chmod(0o755)
    (bin_ / "nvidia-debugdump").symlink_to(dump)
    driver.bin_dirs = [sbin, bin_]
    return driver


def _mounts_under(path: str) -> list[str]:
    targets = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split(" ")[4]
            if target == path or target.startswith(path.rstrip("/") + "/"):
                targets.append(target)
    return targets


def unmount_all_under(path: str) -> None:
    """Unmount (innermost first) everything mounted at or under ``path``."""
    for _ in range(20):
        targets = _mounts_under(os.path.realpath(path))
        if not targets:
            return
        for target in sorted(targets, key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True)


def old_cache_bytes(entries: list[tuple[str, str, int]]) -> bytes:
    """An old-format-only cache (``ld.so-1.7.0``) of (name, path, flags)."""
    strings = bytearray()
    packed = []
    for name, path, flags in entries:
        key = len(strings)
        strings += name.encode() + b"\0"
        value = len(strings)
        strings += path.encode() + b"\0"
        packed.append(struct.pack("=iII", flags, key, value))
    return struct.pack("=11sxI", b"ld.so-1.7.0", len(entries)) + b"".join(packed) + bytes(strings)
