"""This project's CDI hook, ``update-ldcache`` (R-DR-2), run as a runtime runs it: the hook file by
itself under ``python3 -I`` (no package on the path), the container's OCI state on stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from isolators.cdi import HOOK_FILE
from tests.support.fake_driver import have_tool

FOLDERS = ["--folder", "/usr/local/nvidia/lib64", "--folder", "/usr/local/nvidia/lib"]


def run_hook(state: object, *args: str) -> subprocess.CompletedProcess:
    data = state if isinstance(state, bytes) else json.dumps(state).encode()
    return subprocess.run([sys.executable, "-I", HOOK_FILE, "update-ldcache", *args], input=data,
                          capture_output=True, timeout=60)


def bundle(tmp_path: Path, root: str = "rootfs") -> Path:
    directory = tmp_path / "bundle"
    (directory / "rootfs").mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": root}}))
    return directory


@pytest.mark.skipif(os.geteuid() != 0 or not have_tool("gcc") or not os.path.isfile("/sbin/ldconfig"),
                    reason="the hook chroots (root) and runs the host's ldconfig on a gcc-built library")
def test_the_hook_puts_the_folders_in_the_containers_own_cache_and_writes_nothing_outside(tmp_path: Path) -> None:
    directory = bundle(tmp_path)
    root = directory / "rootfs"
    lib64 = root / "usr/local/nvidia/lib64"
    lib64.mkdir(parents=True)
    source = tmp_path / "ml.c"
    source.write_text("int nvml(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libnvidia-ml.so.1", "-o",
                    str(lib64 / "libnvidia-ml.so.550.54.15"), str(source)], check=True)
    (lib64 / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")
    outside = tmp_path / "host-etc"  # absent on the host
    inside = root / str(outside).lstrip("/")
    inside.mkdir(parents=True)
    (root / "etc").symlink_to(outside)  # an image whose /etc names a host path: resolved inside its root
    done = run_hook({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1, "bundle": str(directory)},
                    *FOLDERS)
    assert done.returncode == 0, done.stderr
    assert not outside.exists()
    assert (inside / "ld.so.conf.d/00-gpu-isolator.conf").read_text() == "/usr/local/nvidia/lib64\n/usr/local/nvidia/lib\n"
    assert oct((inside / "ld.so.conf.d/00-gpu-isolator.conf").stat().st_mode & 0o777) == "0o644"
    listing = subprocess.run(["ldconfig", "-p", "-C", str(inside / "ld.so.cache")], capture_output=True, text=True,
                             check=True).stdout
    assert "libnvidia-ml.so.1 (libc6,x86-64) => /usr/local/nvidia/lib64/libnvidia-ml.so.1" in listing


@pytest.mark.parametrize("case, error", [
    ("not-json", "Cannot read the container's OCI state on stdin (JSONDecodeError"),
    ("relative-bundle", "The container's OCI state names no absolute bundle (got 'bundle')"),
    ("no-config", "Cannot read root.path from {bundle}/config.json (FileNotFoundError"),
    ("host-root", "{bundle}/config.json names the host's / as the container's root"),
    ("bad-folder", "Invalid --folder '/usr/../etc'"),
])
def test_what_the_hook_cannot_use_is_one_line_and_exit_1(tmp_path: Path, case: str, error: str) -> None:
    directory = bundle(tmp_path, root="/" if case == "host-root" else "rootfs")
    if case == "no-config":
        (directory / "config.json").unlink()
    state = {"bundle": "bundle" if case == "relative-bundle" else str(directory)}
    done = run_hook(b"{not json" if case == "not-json" else state,
                    *(["--folder", "/usr/../etc"] if case == "bad-folder" else FOLDERS))
    assert done.returncode == 1
    [line] = done.stderr.decode().splitlines()
    assert line.startswith("gpu-isolator-cdi-hook update-ldcache: error: " + error.format(bundle=directory))
    assert os.listdir(directory / "rootfs") == []  # nothing written
