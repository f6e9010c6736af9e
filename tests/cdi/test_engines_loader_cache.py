"""R-DR-2 with a real engine: a container keeps the environment it was
started with, and finds the driver through its own loader cache.

``gpu-isolator cdi generate`` builds the driver volume from a fake driver
(gcc-built libraries in a real loader cache, an ``nvidia-smi`` on the
search path) and writes the node spec; podman runs a busybox image that
has a (static) ``ldconfig``, started with ``PATH=/opt/conda/bin:/bin`` as a
conda image would be. The spec's createContainer hook (this project's
``update-ldcache``) has put the volume's libraries into the container's
``/etc/ld.so.cache``: ``ldconfig -p`` lists ``libnvidia-ml.so.1``; the
container's PATH and LD_LIBRARY_PATH are its own; ``nvidia-smi`` is at
``/usr/bin``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from isolators import cli
from tests.support.engines import add_ldconfig, ldconfig_skip_reason
from tests.support.fake_driver import build_fake_driver, have_tool

from .test_engines_static_spec import PCIE

OWN_PATH = "/opt/conda/bin:/bin"
SCRIPT = ('echo "PATH=$PATH"; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH-unset}"; /sbin/ldconfig -p;'
          ' /usr/bin/nvidia-smi; cat /etc/ld.so.conf.d/00-gpu-isolator.conf; true')


@pytest.fixture(scope="module")
def ldconfig_image(podman, busybox_rootfs: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    reason = ldconfig_skip_reason()
    if reason:
        pytest.skip(reason)
    rootfs = str(tmp_path_factory.mktemp("busybox-ldconfig") / "rootfs")
    shutil.copytree(busybox_rootfs, rootfs, symlinks=True)
    return podman.import_rootfs(add_ldconfig(rootfs), "localhost/gpu-isolator-test/busybox-ldconfig:latest",
                                default=False)


def test_a_container_keeps_its_own_path_and_finds_the_driver_through_its_loader_cache(
        podman, ldconfig_image: str, gpu_dev: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not have_tool("gcc") or not have_tool("ldconfig"):
        pytest.skip("the fake driver needs gcc and ldconfig")
    driver = build_fake_driver(tmp_path / "driver")
    cache = driver.cache("driver", ["lib64"])
    monkeypatch.setenv("PATH", f"{driver.search_path}{os.pathsep}{os.environ.get('PATH', '')}")  # its nvidia-smi
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    code = cli.main(["cdi", "generate", "--host-file", PCIE, "--dev-dir", gpu_dev, "--ld-cache", str(cache),
                     "--proc-dir", str(tmp_path), "--volume-dir", str(tmp_path / "volume"),
                     "--output", str(cdi / "nvidia.json")])
    assert code == 0
    result = podman.run(ldconfig_image, ["/bin/sh", "-c", SCRIPT], devices=["nvidia.com/gpu=0"],
                        env={"PATH": OWN_PATH}, cdi_dir=str(cdi))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == [f"PATH={OWN_PATH}", "LD_LIBRARY_PATH=unset"]  # the container's own, untouched
    assert "\tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/local/nvidia/lib64/libnvidia-ml.so.1" in lines
    assert "\tlibcuda.so.1 (libc6,x86-64) => /usr/local/nvidia/lib64/libcuda.so.1" in lines
    assert "fake nvidia-smi" in lines  # the driver's binary at its usual path
    assert lines[-2:] == ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"]  # for the image's own ldconfig runs
