"""R-MP-1 across a stop of the front door's container: its MPS daemons are born out of its cgroup.

A container runtime stops a container by killing its cgroup, and the kubelet then kills what is left in the
pod's cgroup of every hierarchy. The daemon of a shared unit (and the server its running clients talk to)
must outlive that, for the front door that comes back to take over: ``--mps_cgroup=NAME`` starts each daemon
in ``<hierarchy>/NAME`` of every cgroup hierarchy. Judged by the kernel: ``/proc/<pid>/cgroup`` of the daemon,
and whether it lives after every process of the front door's cgroups was SIGKILLed as a runtime does.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import pytest

from actors.mps import MpsDaemons, MpsError, ShareLimits
from actors.mps._cgroup import cgroup_mounts, procs_files, validate_mps_cgroup
from actors.mps.testing import read_record
from actors.nvml import NvmlService, SimulatedNvml
from isolators.cli import main
from runtime import Runtime

from tests.kubernetes.device_plugin.test_kubelet_mig_and_sharing import DGX8
from tests.support.engines import remove_cgroup_trees
from tests.support.kernel import in_cgroups, stop_cgroups, wait_gone
from tests.support.kube_node import KubeNode, end_mps_daemons
from tests.support.kubelet import plugin_directory
from tests.support.ledger import leases, until

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="moving processes between cgroups needs root")


def test_a_bad_cgroup_name_is_one_usage_error(capsys: pytest.CaptureFixture) -> None:
    for bad, why in [("/abs", "it must be a relative path (under each hierarchy's root)"),
                     ("a/../b", "every component must be a plain name (no '..', '.' or empty component)"),
                     ("", "it must not be empty")]:
        with pytest.raises(MpsError) as refused:
            validate_mps_cgroup(bad)
        assert str(refused.value) == (f"invalid MPS daemons' cgroup {bad!r}: {why}; give a name such as"
                                      " 'gpu-isolator-mps' or 'none'")
        assert main(["kubelet-plugin", "--mps_replicas=2", f"--mps_cgroup={bad}"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"gpu-isolator kubelet-plugin: error: --mps_cgroup: {refused.value}")
    assert validate_mps_cgroup("gpu-isolator-mps/a") == "gpu-isolator-mps/a"


def test_each_hierarchy_gets_the_cgroup_and_a_v1_cpuset_its_parents_cpus_and_mems(tmp_path: Path) -> None:
    cpuset, unified = tmp_path / "cpuset", tmp_path / "unified"
    for directory in (cpuset, unified):
        directory.mkdir()
    (cpuset / "cpuset.cpus").write_text("0-1\n")
    (cpuset / "cpuset.mems").write_text("0\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"31 23 0:28 / {tmp_path} rw - tmpfs tmpfs rw\n"
        f"34 31 0:31 / {cpuset} rw,relatime - cgroup cgroup rw,cpuset\n"
        f"35 31 0:31 / {cpuset} rw,relatime - cgroup cgroup rw,cpuset\n"  # mounted twice: once is enough
        f"36 31 0:32 /kubepods/pod1 {tmp_path}/elsewhere rw - cgroup cgroup rw,memory\n"  # not the whole hierarchy
        f"41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw\n")
    assert cgroup_mounts(str(mountinfo)) == [(str(cpuset), "cgroup"), (str(unified), "cgroup2")]
    assert procs_files("mps/units", str(mountinfo)) == [str(cpuset / "mps/units/cgroup.procs"),
                                                         str(unified / "mps/units/cgroup.procs")]
    for level in (cpuset / "mps", cpuset / "mps/units"):
        assert [(level / f).read_text() for f in ("cpuset.cpus", "cpuset.mems")] == ["0-1", "0"]
    assert not (unified / "mps" / "cpuset.cpus").exists()
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "gone").mkdir()
    mountinfo.write_text(f"41 31 0:38 / {tmp_path}/gone/deeper rw - cgroup2 cgroup2 rw\n")
    with pytest.raises(MpsError, match=rf"^cannot make the MPS daemons' cgroup {tmp_path}/gone/deeper/mps: .*"
                                       r" or keep the daemons in its own cgroup with --mps_cgroup=none"):
        procs_files("mps", str(mountinfo))
    assert not (tmp_path / "gone" / "deeper").exists()  # nothing made above a mount point


def _cgroups_of(pid: int) -> set[str]:
    """Where ``pid`` is in each hierarchy (the paths of /proc/<pid>/cgroup)."""
    return {line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}


@pytest.fixture
def test_cgroup() -> str:
    name = f"gpu-isolator-test-mps-{uuid.uuid4().hex[:8]}"
    yield name
    remove_cgroup_trees(name)


@needs_root
@pytest.mark.asyncio
async def test_a_daemon_is_started_in_the_daemons_cgroup_of_every_hierarchy(mps_control: Path,
                                                                              test_cgroup: str) -> None:
    runtime_dir = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    nvml = SimulatedNvml.with_gpus(1)
    nvml.init()
    try:
        async with Runtime():
            daemons = MpsDaemons(NvmlService(nvml), runtime_dir, str(mps_control), timeout_s=5.0,
                                 cgroup=f"{test_cgroup}/mps")
            await daemons.share(nvml.uuid(0), "claim-a", ShareLimits(memory_bytes=1 << 30, thread_percentage=50))
            pid = daemons.daemon_pid(nvml.uuid(0))
            assert _cgroups_of(pid) == {f"/{test_cgroup}/mps"}
            await daemons.close()
    finally:
        end_mps_daemons(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)


@needs_root
@pytest.mark.asyncio
@pytest.mark.parametrize("kept", [True, False], ids=["mps_cgroup", "none"])
async def test_a_daemon_outlives_the_front_doors_container_and_the_next_one_takes_it_over(
        tmp_path: Path, mps_control: Path, test_cgroup: str, kept: bool) -> None:
    """The device plugin in a "container" (born in cgroups of the test's own); a pod's share starts the GPU's daemon;
    the container is stopped as a runtime stops it. With --mps_cgroup the daemon lives on, out of the
    container's cgroups, and the plugin started again takes it over (one start in the stand-in's record) and
    grants the running pod's share again; with ``none`` (the front door's own cgroup) it dies with the
    container, which is why the chart gives the cgroup."""
    from isolators.kubernetes.device_plugin import PLUGIN_OWNER

    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    record = tmp_path / "mps-record"
    container = f"{test_cgroup}/plugin"
    where = f"{test_cgroup}/mps" if kept else "none"
    with plugin_directory() as sockets:
        kube = KubeNode(tmp_path / "kube", sockets, DGX8, str(tmp_path / "ledger"), env={"FAKE_MPS_RECORD": str(record)},
                        device_plugin_options=("--mps_replicas=2", f"--mps_control={mps_control}",
                                               f"--runtime_dir={runtime_dir}", f"--mps_cgroup={where}"),
                        prefixes={"kubelet-plugin": in_cgroups(container)})
        try:
            kube.start(dra=False)
            gpu0 = kube.uuids["gpu-0"]
            kube.allocate("a", [f"{gpu0}::0"])
            await until(lambda: leases(kube.ledger).get("195:0") == (PLUGIN_OWNER, ("ns/a/gpu",)), "gpu-0 held for a")
            pid = int(Path(runtime_dir, "mps", gpu0, "pipe", "nvidia-cuda-mps-control.pid").read_text().split()[0])
            assert _cgroups_of(pid) == {f"/{where if kept else container}"}

            stop_cgroups(container)
            assert kube.device_plugin.process.wait(10) == -signal.SIGKILL
            if not kept:
                assert wait_gone(pid), "the daemon in the front door's cgroup died with its container"
                return
            os.kill(pid, 0)  # the daemon, and its clients' server, outlived the container
            kube.restart_device_plugin()
            kube.device_plugin.wait_log(f"MPS control daemon of {gpu0} taken over (pid {pid},")
            kube.device_plugin.wait_log(f"MPS share {gpu0}::0 of pod ns/a granted again")
            assert [e for _, e, _ in read_record(record) if e == "start"] == ["start"]
        finally:
            kube.close()
            end_mps_daemons(runtime_dir)
            shutil.rmtree(runtime_dir, ignore_errors=True)


@needs_root
def test_the_dra_drivers_daemon_outlives_its_container_and_the_next_driver_takes_it_over(
        tmp_path: Path, mps_control: Path, test_cgroup: str) -> None:
    """The same through ``dra-plugin --sharing=mps --mps_cgroup``: a prepared claim's daemon lives through the
    driver's container stop; the driver started again takes it over and the claim's unprepare stops it."""
    from tests.kubernetes.dra.test_dra_shares_on_a_node import daemon_commands, sharing_node

    container = f"{test_cgroup}/driver"
    with sharing_node(tmp_path, mps_control, (f"--mps_cgroup={test_cgroup}/mps",),
                      prefixes={"dra-plugin": in_cgroups(container)}) as kube:
        gpu0 = kube.uuids["gpu-0"]
        kube.wait_slice(lambda devices: len(devices) == 8, "the sharing slice published")
        claim = kube.share({"memory": "8Gi", "compute": "50"})
        assert [d["device_name"] for d in kube.prepare(claim)["devices"]] == ["gpu-0"]
        pid = int(Path(kube.runtime_dir, "mps", gpu0, "pipe", "nvidia-cuda-mps-control.pid").read_text().split()[0])
        assert _cgroups_of(pid) == {f"/{test_cgroup}/mps"}
        stop_cgroups(container)
        assert kube.dra_plugin.process.wait(10) == -signal.SIGKILL
        os.kill(pid, 0)  # the daemon, and the claim's clients' server, outlived the container
        kube.restart_dra_plugin()
        kube.dra_plugin.wait_log(f"MPS control daemon of {gpu0} taken over (pid {pid},")
        assert [e for _, e, _ in read_record(kube.record) if e == "start"] == ["start"]
        assert kube.unprepare(claim) == {}
        assert wait_gone(pid), "the daemon stopped with the claim's share"
        assert daemon_commands(kube, gpu0)[-1] == "quit"
