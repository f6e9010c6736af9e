"""R-SH-1: the image, built offline by real podman from the repository's
``Containerfile`` (``tests.support.image``: a Debian base from Debian's
packages, the wheels made outside the build, ``podman build
--network=none``), and run: ``--version``, ``demo``, and the device plugin
registering with the suite's fake kubelet (``tests.support.kubelet``)
through a mounted directory. The build is the session's ``image`` fixture,
shared by every test here; the Containerfile's own checks need no podman.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
import uuid
from importlib import metadata
from pathlib import Path

import pytest

from actors.nvml import load_host_file
from scripts import image as image_script

from tests.support.image import ImageBuild, ImagePluginCommand
from tests.support.kubelet import DGX8, FakeKubelet, flag_args, plugin_directory, plugin_node

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
GPU = "nvidia.com/gpu"
SIZE_BOUND = 80 * 1000 * 1000
"""Bytes the image may add to its base: the venv with the project and its dependencies (~46 MB, 2026-12)."""


# -- the Containerfile and its context (no podman) -------------------------------------------------
def test_the_containerfiles_default_version_is_the_packages() -> None:
    text = (ROOT / "Containerfile").read_text()
    assert re.findall(r"^ARG VERSION=(\S+)$", text, re.MULTILINE) == [VERSION] == [image_script.VERSION]
    assert re.findall(r"^ARG BASE=(\S+)$", text, re.MULTILINE) == ["docker.io/library/python:3.11-slim-bookworm"]
    assert 'ENTRYPOINT ["gpu-isolator"]' in text
    assert "--no-index --find-links /tmp/wheelhouse" in text


def test_the_build_context_is_the_wheelhouse_alone() -> None:
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines == ["*", f"!{image_script.WHEELHOUSE}/"]
    assert f"{image_script.WHEELHOUSE}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_wheelhouse_asks_for_binary_wheels_of_the_images_python() -> None:
    assert image_script.platforms("x86_64", "2.36")[:2] == ["manylinux_2_36_x86_64", "manylinux_2_35_x86_64"]
    assert image_script.platforms("aarch64", "2.17") == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    with pytest.raises(ValueError, match=r"glibc '2.5': expected 2.17 or newer"):
        image_script.platforms("x86_64", "2.5")


# -- the image -------------------------------------------------------------------------------------
def test_it_is_built_offline_from_the_wheels_with_the_packages_labels(image: ImageBuild) -> None:
    config = image.inspect()["Config"]
    assert config["Labels"]["org.opencontainers.image.version"] == VERSION == metadata.version("gpu-isolator")
    assert config["Labels"]["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert config["Labels"]["org.opencontainers.image.title"] == "gpu-isolator"
    assert config["Labels"]["org.opencontainers.image.source"].startswith("https://")
    assert config["Labels"]["org.opencontainers.image.description"]
    assert config["Entrypoint"] == ["gpu-isolator"]
    assert "PATH=/opt/gpu-isolator/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in config["Env"]
    # Built with no network (the engine's build line says so) from the wheelhouse: pip found every wheel there.
    [build] = [line for line in image.engine.lines if line.startswith("podman build")]
    assert "--network none" in build and f"BASE={image.base}" in build
    assert "--no-index --find-links /tmp/wheelhouse" in image.output


def test_version_in_the_image_is_the_packages(image: ImageBuild) -> None:
    done = image.run(["--version"])
    assert (done.returncode, done.stdout, done.stderr) == (0, f"gpu-isolator {VERSION}\n", "")


def test_demo_in_the_image_prints_what_the_demo_prints(image: ImageBuild) -> None:
    done = image.run(["demo"])
    assert done.returncode == 0, done.stderr
    here = subprocess.run([sys.executable, "-m", "isolators", "demo"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert here.returncode == 0, here.stderr

    def steady(text: str) -> str:  # the run's duration is the one line that changes
        return re.sub(r" in \d+\.\d+ s:", " in N s:", text)

    assert steady(done.stdout) == steady(here.stdout)
    assert "13 passed, 0 failed" in done.stdout


def test_the_image_holds_the_venv_without_pip_wheels_or_compilers(image: ImageBuild) -> None:
    probe = ("import importlib.util, os, shutil, sys;"
             " print(sys.prefix, importlib.util.find_spec('pip') is not None, os.path.exists('/tmp/wheelhouse'),"
             " [tool for tool in ('gcc', 'cc', 'make') if shutil.which(tool)])")
    done = image.run(["-c", probe], entrypoint="/opt/gpu-isolator/bin/python")
    assert (done.returncode, done.stdout.strip()) == (0, "/opt/gpu-isolator False False []"), done.stderr


def test_the_image_has_what_the_daemonsets_scripts_run(image: ImageBuild) -> None:
    """deploy/'s DaemonSets run a shell script in the image: ``ldconfig`` (a loader cache of the host's driver
    directory), ``install`` of the CDI hook, whose file ``python3`` (the venv's: the project imports) names;
    a sharing front door starts each MPS daemon through ``unshare`` and ``mount`` (``actors.mps``)."""
    script = ("for tool in sh mkdir ln ldconfig install unshare mount; do command -v $tool >/dev/null || echo missing $tool; done;"
              " python3 -c 'from isolators.cdi import HOOK_FILE; import os; print(os.path.isfile(HOOK_FILE))';"
              " command -v python3; command -v gpu-isolator-cdi-hook")
    done = image.run(["-c", script], entrypoint="/bin/sh")
    assert (done.returncode, done.stdout.split()) == (0, ["True", "/opt/gpu-isolator/bin/python3",
                                                          "/opt/gpu-isolator/bin/gpu-isolator-cdi-hook"]), done.stderr


def test_the_image_adds_under_80_mb_to_its_base(image: ImageBuild) -> None:
    size, base = image.inspect()["Size"], image.inspect(image.base)["Size"]
    added = size - base
    steps = json.dumps({step: round(seconds, 1) for step, seconds in image.timings.items()})
    print(f"image {size / 1e6:.1f} MB, base {base / 1e6:.1f} MB, added {added / 1e6:.1f} MB; build steps (s): {steps}")
    assert 0 < added < SIZE_BOUND


def test_the_device_plugin_in_the_image_registers_with_the_kubelet_through_a_mounted_directory(
        image: ImageBuild, tmp_path: Path) -> None:
    node, cdi = plugin_node(tmp_path)
    uuids = [gpu.uuid for gpu in load_host_file(DGX8).gpus]
    with plugin_directory() as directory:
        kubelet = FakeKubelet(directory).start()
        args = [*flag_args(node.flag_values(cdi_spec_dir=str(cdi))), f"--device_plugin_dir={directory}"]
        # The node's files (its host file read-only) and the kubelet's device-plugins directory, at the same paths.
        volumes = [f"{DGX8}:{DGX8}:ro", f"{tmp_path}:{tmp_path}", f"{directory}:{directory}"]
        plugin = ImagePluginCommand(image, args, tmp_path, volumes=volumes)
        try:
            plugin.start()
            assert f"offering {GPU} (8 devices) in {directory};" in plugin.first_line, plugin.first_line
            [registration] = kubelet.wait_registrations(1)
            assert (registration["resource"], registration["endpoint"], registration["version"]) == (
                GPU, "gpu-isolator-gpu.sock", "v1beta1")
            _, devices = kubelet.wait_list(GPU)
            assert devices == [(uuids[i], "Healthy", [0 if i < 4 else 1]) for i in range(8)]
            assert kubelet.preferred(GPU, uuids, [], 2) == uuids[0:2]
            answer = kubelet.allocate(GPU, [uuids[5]])
            assert [device.name for device in answer.cdi_devices] == [f"nvidia.com/gpu={uuids[5]}"]
            spec = json.loads((cdi / "gpu-isolator-node.json").read_text())  # written inside, read here
            assert f"nvidia.com/gpu={uuids[5]}" in {f"{spec['kind']}={d['name']}" for d in spec["devices"]}
            assert plugin.stop(signal.SIGTERM) == 0, plugin.log()
            assert not (directory / "gpu-isolator-gpu.sock").exists()  # it removed its socket on the way out
            assert (directory / "kubelet.sock").exists()  # and only its own
        finally:
            plugin.close()
            kubelet.close()


def test_a_sharing_plugin_in_the_image_leaves_its_mps_daemon_to_the_next_one_when_its_container_stops(
        image: ImageBuild, tmp_path: Path) -> None:
    """R-MP-1 under a real container runtime, run as the chart runs a sharing plugin (privileged, the host's
    PID namespace and cgroups, ``--mps_cgroup``): a pod's share starts the GPU's MPS daemon (the stand-in) from
    inside the container, through the image's ``unshare`` and ``mount``, in a cgroup of the test's own; the
    container stops (podman, then runc, which kills what is left in the container's cgroup), the daemon lives
    on, and the plugin in a new container takes it over, grants the running pod's share again and stops the
    daemon with the pod."""
    from actors.mps.testing import NO_GCC, build_mps_control
    from isolators.kubernetes.device_plugin import PLUGIN_OWNER
    from tests.mps.test_daemon_cgroup import _cgroups_of
    from tests.support.engines import remove_cgroup_trees
    from tests.support.kernel import process_state, wait_gone
    from tests.support.kube_node import KubeNode, end_mps_daemons
    from tests.support.ledger import leases

    stand_in_dir = tmp_path / "mps-control"
    stand_in_dir.mkdir()
    control = build_mps_control(stand_in_dir, static=True)  # the image has no compiler; a static stand-in runs there
    if control is None:
        pytest.skip(NO_GCC)
    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")  # short: the daemon's socket path is bounded
    test_cgroup = f"gpu-isolator-test-mps-{uuid.uuid4().hex[:8]}"
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), device_plugin_options=(
            "--mps_replicas=2", f"--mps_control={control}", f"--runtime_dir={runtime_dir}",
            f"--mps_cgroup={test_cgroup}/mps", "--device_worker=thread"))
        volumes = [f"{DGX8}:{DGX8}:ro", f"{tmp_path}:{tmp_path}", f"{sockets}:{sockets}", f"{runtime_dir}:{runtime_dir}",
                   "/sys/fs/cgroup:/sys/fs/cgroup"]

        def plugin_in_a_container() -> ImagePluginCommand:
            command = ImagePluginCommand(image, kube.device_plugin_args, kube.base, volumes=volumes,
                                         options=["--privileged", "--pid=host", "--cgroupns=host"])
            kube.device_plugin = command.start()
            kube.registrations += 1
            kube.kubelet.wait_registrations(kube.registrations)
            return command

        try:
            kube.pod_resources.start()
            kube.kubelet.start()
            kube._started = True
            first = plugin_in_a_container()
            gpu0 = kube.uuids["gpu-0"]
            answer = kube.allocate("a", [f"{gpu0}::0"])
            assert [d.name for d in answer.cdi_devices] == [f"{GPU}={gpu0}", f"nvidia.com/gpu-mps={gpu0}"]
            pid_file = Path(runtime_dir, "mps", gpu0, "pipe", "nvidia-cuda-mps-control.pid")
            pid = int(pid_file.read_text().split()[0])  # the host's PID: the container shares its namespace
            assert _cgroups_of(pid) == {f"/{test_cgroup}/mps"}  # out of the container's, in every hierarchy

            assert first.stop(signal.SIGTERM) == 0, first.log()
            assert process_state(pid) not in (None, "Z"), "the daemon died with the plugin's container"
            second = plugin_in_a_container()
            second.wait_log(f"MPS control daemon of {gpu0} taken over (pid {pid},")
            second.wait_log(f"MPS share {gpu0}::0 of pod ns/a granted again")
            assert leases(kube.ledger)["195:0"] == (PLUGIN_OWNER, ("ns/a/gpu",))
            kube.remove_pod("a")
            assert wait_gone(pid, 30), "the daemon stopped with the pod's share"
            assert second.stop(signal.SIGTERM) == 0, second.log()
        finally:
            kube.close()
            end_mps_daemons(runtime_dir)
            remove_cgroup_trees(test_cgroup)
            shutil.rmtree(runtime_dir, ignore_errors=True)
