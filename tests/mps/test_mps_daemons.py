"""R-MP-1, R-MP-2: the MPS control daemons a front door runs, on the stand-in.

The stand-in (tests/native/fake_mps_control.c, built once a session) is a
real program that daemonizes with ``-d``, binds its control socket in
``$CUDA_MPS_PIPE_DIRECTORY``, writes ``control.log`` in
``$CUDA_MPS_LOG_DIRECTORY`` and records every command in
``$FAKE_MPS_RECORD``; the tests judge by that record, by the kernel
(``/proc``) and by NVML's compute mode (the simulated node here; the real
pynvml over the fake NVML in ``test_mps_over_the_fake_nvml``).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from actors.mps import MpsDaemonFailed, MpsDaemons, MpsError, ShareLimits
from actors.mps.testing import read_record
from actors.nvml import COMPUTE_MODE_EXCLUSIVE_PROCESS, NvmlService, SimulatedNvml
from runtime import Runtime, current_runtime
from tests.support.ledger import until

GIB = 1024**3
HALF = ShareLimits(memory_bytes=40 * GIB, thread_percentage=50)


@pytest.fixture
def runtime_dir() -> Path:
    # Short on purpose: a unix socket path takes 108 bytes, and pytest's tmp_path is long.
    path = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    yield path
    for pid_file in path.glob("mps/*/pipe/nvidia-cuda-mps-control.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # a daemon a failed test left
        except (ValueError, ProcessLookupError):
            pass
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "record"
    monkeypatch.setenv("FAKE_MPS_RECORD", str(path))
    monkeypatch.delenv("FAKE_MPS_FAIL", raising=False)
    monkeypatch.delenv("FAKE_MPS_IGNORE_QUIT", raising=False)
    return path


def commands(record: Path, uuid: str) -> list[str]:
    return [detail for unit, event, detail in read_record(record) if unit == uuid and event == "command"]


def starts(record: Path, uuid: str) -> list[int]:
    return [int(detail) for unit, event, detail in read_record(record) if unit == uuid and event == "start"]


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


async def manager(nvml: SimulatedNvml, runtime_dir: Path, control: Path, **options) -> MpsDaemons:
    nvml.init()
    return MpsDaemons(NvmlService(nvml), runtime_dir, str(control), timeout_s=5.0, backoff_s=0.05, **options)


@pytest.mark.asyncio
async def test_a_share_starts_the_units_daemon_sets_limits_through_it_and_the_last_return_stops_it(
        mps_control, runtime_dir, record):
    nvml = SimulatedNvml.with_gpus(2)
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        gpu0, gpu1 = nvml.uuid(0), nvml.uuid(1)
        first = await daemons.share(gpu0, "claim-a", HALF)
        pid = daemons.daemon_pid(gpu0)
        assert pid is not None and alive(pid)
        # One daemon, its directories under the runtime dir, the unit's UUID alone visible to it.
        paths = daemons.paths(gpu0)
        assert first.pipe_dir == paths.pipe == str(runtime_dir / "mps" / gpu0 / "pipe")
        assert stat.S_ISSOCK(os.stat(Path(paths.pipe) / "control").st_mode)
        assert (Path(paths.log) / "control.log").exists()
        modes = [stat.S_IMODE(os.stat(d).st_mode) for d in (paths.pipe, paths.log, paths.shm)]
        assert modes == [0o755, 0o755, 0o1777]  # shm as /dev/shm is: any container user makes segments there
        assert starts(record, gpu0) == [pid]
        assert Path(f"/proc/{pid}/environ").read_bytes().split(b"\0").count(f"CUDA_VISIBLE_DEVICES={gpu0}".encode())
        # Compute mode EXCLUSIVE_PROCESS before the daemon started.
        assert nvml.compute_mode(0) == COMPUTE_MODE_EXCLUSIVE_PROCESS and nvml.compute_mode(1) == 0
        # Limits through the daemon's commands (R-MP-2): 40 GiB in MiB, 50 %.
        assert commands(record, gpu0) == [
            "get_server_list",
            "set_default_device_pinned_mem_limit 0 40960M",
            "set_default_active_thread_percentage 50",
        ]
        # Set by the unit's index in its daemon (0), as the real daemon applies it; by UUID it would not.
        assert _answer(daemons, gpu0, "get_default_device_pinned_mem_limit 0").strip() == "40960M"
        snapshot = current_runtime().metrics.snapshot()
        assert (snapshot["mps/daemons"], snapshot["mps/shares"], snapshot["mps/daemon_restarts"]) == (1, 1, 0)

        # A second share of the unit joins the same daemon; a server already running gets the limits too.
        assert (await daemons.share(gpu0, "claim-b", HALF)).generation == 1
        assert daemons.daemon_pid(gpu0) == pid and starts(record, gpu0) == [pid]
        await daemons.executor.run(_start_server, daemons, gpu0)
        await daemons.share(gpu0, "claim-c", HALF)
        server = int(_answer(daemons, gpu0, "get_server_list"))  # recorded too: the last line
        assert commands(record, gpu0)[-6:-1] == [
            "get_server_list",
            "set_default_device_pinned_mem_limit 0 40960M",
            "set_default_active_thread_percentage 50",
            f"set_device_pinned_mem_limit {server} 0 40960M",
            f"set_active_thread_percentage {server} 50",
        ]
        # Shares of one unit are equal: other limits are refused by name, nothing changes.
        with pytest.raises(MpsError, match=r"its live shares have memory 40960M .*the shares of one unit are equal"):
            await daemons.share(gpu0, "claim-d", ShareLimits(memory_bytes=10 * GIB, thread_percentage=50))
        assert daemons.share_state("claim-d") is None
        # Another unit gets a daemon of its own.
        await daemons.share(gpu1, "claim-e", ShareLimits(memory_bytes=10 * GIB, thread_percentage=25))
        assert daemons.daemon_pid(gpu1) not in (None, pid)
        assert current_runtime().metrics.snapshot()["mps/daemons"] == 2

        for share_id in ("claim-a", "claim-b"):
            assert await daemons.release(share_id)
        assert alive(pid) and nvml.compute_mode(0) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        assert await daemons.release("claim-c")
        # The last share returned: quit, the daemon gone, compute mode DEFAULT again.
        assert commands(record, gpu0)[-1] == "quit"
        assert not alive(pid) and daemons.daemon_pid(gpu0) is None
        assert not alive(server)
        assert nvml.compute_mode(0) == 0
        assert [c for c in nvml.compute_mode_changes if c[0] == gpu0] == [(gpu0, COMPUTE_MODE_EXCLUSIVE_PROCESS),
                                                                          (gpu0, 0)]
        assert not await daemons.release("claim-a")
        await daemons.close()
        assert nvml.compute_mode(1) == 0 and daemons.daemon_pid(gpu1) is None
        assert commands(record, gpu1)[-1] == "quit"


def _start_server(daemons: MpsDaemons, uuid: str) -> None:
    from actors.mps import _daemon

    _daemon.configure(daemons.control, daemons.paths(uuid), ["start_server -uid 0"], 5.0)


def _answer(daemons: MpsDaemons, uuid: str, command: str) -> str:
    from actors.mps import _daemon

    return _daemon.send(daemons.control, daemons.paths(uuid), [command], 5.0).strip()


@pytest.mark.asyncio
async def test_a_killed_daemon_is_started_again_and_its_shares_are_told_apart_from_new_ones(
        mps_control, runtime_dir, record):
    nvml = SimulatedNvml.with_gpus(1)
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        gpu = nvml.uuid(0)
        old = await daemons.share(gpu, "before", HALF)
        pid = daemons.daemon_pid(gpu)
        stale = Path(daemons.paths(gpu).pipe) / "control_lock"  # what a real daemon may leave behind
        stale.write_text("")
        os.kill(pid, signal.SIGKILL)
        await until(lambda: daemons.restarts == 1, "the daemon started again")
        # Its limits are set again through the new daemon (3 commands a time: the server list, 2 limits).
        await until(lambda: len(commands(record, gpu)) == 6, "the limits set again")
        new_pid = daemons.daemon_pid(gpu)
        assert new_pid not in (None, pid) and alive(new_pid)
        assert not stale.exists()  # the dead daemon's leftovers went before the new one started
        assert starts(record, gpu) == [pid, new_pid]
        assert commands(record, gpu)[-2:] == ["set_default_device_pinned_mem_limit 0 40960M",
                                              "set_default_active_thread_percentage 50"]
        assert current_runtime().metrics.snapshot()["mps/daemon_restarts"] == 1
        # The share it served is told apart from a new one.
        assert old.generation == 1 and daemons.share_state("before").interrupted
        fresh = await daemons.share(gpu, "after", HALF)
        assert fresh.generation == 2 and not fresh.interrupted
        # The compute mode stayed EXCLUSIVE_PROCESS throughout.
        assert nvml.compute_mode(0) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        assert nvml.compute_mode_changes == [(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)]
        await daemons.close()
        assert not alive(new_pid) and nvml.compute_mode(0) == 0


@pytest.mark.asyncio
async def test_a_daemon_that_cannot_start_fails_the_share_naming_its_exit_and_its_log(
        mps_control, runtime_dir, record, monkeypatch):
    nvml = SimulatedNvml.with_gpus(1)
    monkeypatch.setenv("FAKE_MPS_FAIL", "3:Failed to start: no CUDA-capable device is detected")
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        gpu = nvml.uuid(0)
        with pytest.raises(MpsDaemonFailed) as failed:
            await daemons.share(gpu, "claim", HALF)
        assert failed.value.exit == 3
        message = str(failed.value)
        assert message.startswith(f"the MPS control daemon of {gpu} did not start: '{mps_control} -d' exited"
                                  " with status 3 saying 'Failed to start: no CUDA-capable device is detected'")
        assert f"the end of its log {runtime_dir}/mps/{gpu}/log/control.log:" in message
        assert message.splitlines()[-1].endswith("] Failed to start: no CUDA-capable device is detected")
        # Nothing left behind: no share, no daemon, compute mode DEFAULT again.
        assert daemons.share_state("claim") is None and daemons.daemon_pid(gpu) is None
        assert nvml.compute_mode_changes == [(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS), (gpu, 0)]
        assert current_runtime().metrics.snapshot()["mps/shares"] == 0
        # Once it can start, the next share gets it.
        monkeypatch.delenv("FAKE_MPS_FAIL")
        await daemons.share(gpu, "claim", HALF)
        assert daemons.daemon_pid(gpu) is not None
        await daemons.close()


@pytest.mark.asyncio
async def test_a_runtime_directory_it_cannot_use_is_a_clear_error(mps_control, runtime_dir, record):
    nvml = SimulatedNvml.with_gpus(1)
    blocked = runtime_dir / "state"
    blocked.write_text("a file where the runtime directory should be\n")
    async with Runtime():
        daemons = await manager(nvml, blocked, mps_control)
        gpu = nvml.uuid(0)
        with pytest.raises(MpsError) as failed:
            await daemons.share(gpu, "claim", HALF)
        assert str(failed.value) == (
            f"cannot create the MPS pipe directory {blocked}/mps/{gpu}/pipe: Not a directory;"
            " make the front door's runtime directory writable by it")
        assert nvml.compute_mode_changes == [] and read_record(record) == []
        await daemons.close()
        # A runtime directory so long that the control socket cannot be bound: refused before anything runs.
        deep = runtime_dir / ("d" * 60)
        daemons = await manager(nvml, deep, mps_control)
        with pytest.raises(MpsError, match=r"the MPS pipe directory .* is too long: its socket .* needs \d+ bytes,"
                                           r" a unix socket takes 108; give the front door a shorter runtime"):
            await daemons.share(gpu, "claim", HALF)
        await daemons.close()


@pytest.mark.asyncio
async def test_limits_a_share_cannot_have_are_refused(mps_control, runtime_dir, record):
    nvml = SimulatedNvml.with_gpus(1)
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        gpu = nvml.uuid(0)
        with pytest.raises(MpsError, match="thread percentage must be 1..100, got 0"):
            await daemons.share(gpu, "claim", ShareLimits(memory_bytes=GIB, thread_percentage=0))
        with pytest.raises(MpsError, match="memory limit must be at least 1 MiB, got 1000 bytes"):
            await daemons.share(gpu, "claim", ShareLimits(memory_bytes=1000, thread_percentage=10))
        assert read_record(record) == [] and nvml.compute_mode_changes == []
        await daemons.close()


def test_mps_over_the_fake_nvml(fake_nvml_lib, mps_control, runtime_dir, tmp_path, record):
    """The same daemons on the real pynvml (the fake libnvidia-ml.so.1, in a
    child process): a GPU unit is EXCLUSIVE_PROCESS while its daemon runs and
    DEFAULT after, as the driver's state records it; a MIG unit's daemon runs
    with no compute mode change (NVML sets it on whole GPUs only)."""
    from actors.nvml import load_host_file
    from tests.support.fake_nvml import HERE, NvmlProbe

    spec = load_host_file(Path(__file__).resolve().parents[1] / "inventory" / "data" / "h200-mig.toml")
    gpu = next(g for g in spec.gpus if not g.mig_devices)
    mig = next(m for g in spec.gpus for m in g.mig_devices)
    probe = NvmlProbe(fake_nvml_lib, tmp_path)
    state = tmp_path / "driver-state"
    [result] = probe.run([{"config": probe.config(spec), "state": str(state), "runtime_dir": str(runtime_dir),
                           "control": str(mps_control), "units": [gpu.uuid, mig.uuid]}],
                         script=HERE / "mps_probe.py")
    assert "error" not in result, result
    assert set(result["pids"]) == {gpu.uuid, mig.uuid}
    assert state.read_text() == f"compute\t{gpu.uuid}\t3\ncompute\t{gpu.uuid}\t0\n"
    for uuid, pid in result["pids"].items():
        assert starts(record, uuid) == [pid] and commands(record, uuid)[-1] == "quit" and not alive(pid)


@pytest.mark.asyncio
async def test_a_daemon_that_cannot_start_again_fails_new_shares_with_its_exit(
        mps_control, runtime_dir, record, monkeypatch):
    nvml = SimulatedNvml.with_gpus(1)
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control, max_restarts=2)
        gpu = nvml.uuid(0)
        await daemons.share(gpu, "before", HALF)
        monkeypatch.setenv("FAKE_MPS_FAIL", "1:Failed to open the GPU")
        os.kill(daemons.daemon_pid(gpu), signal.SIGKILL)
        await until(lambda: daemons.daemon_pid(gpu) is None, "the daemon's exit noticed")
        with pytest.raises(MpsDaemonFailed, match=r"exited with status 1 saying 'Failed to open the GPU'") as failed:
            await daemons.share(gpu, "during", HALF)
        assert failed.value.log_tail.endswith("] Failed to open the GPU")
        assert daemons.share_state("during") is None and daemons.share_state("before").interrupted
        monkeypatch.delenv("FAKE_MPS_FAIL")
        fresh = await daemons.share(gpu, "after", HALF)
        assert not fresh.interrupted and daemons.daemon_pid(gpu) is not None
        assert daemons.restarts == 1  # started again after its exit: by the share, before the restart's turn
        await daemons.close()


@pytest.mark.asyncio
async def test_a_daemon_left_by_an_earlier_life_is_taken_over_not_started_twice(mps_control, runtime_dir, record):
    nvml = SimulatedNvml.with_gpus(1)
    async with Runtime():
        earlier = await manager(nvml, runtime_dir, mps_control)
        gpu = nvml.uuid(0)
        await earlier.share(gpu, "claim", HALF)
        pid = earlier.daemon_pid(gpu)
        # The front door dies without stopping it (no close): a new life shares the unit again.
        later = await manager(nvml, runtime_dir, mps_control)
        await later.share(gpu, "claim", HALF)
        assert later.daemon_pid(gpu) == pid and starts(record, gpu) == [pid]
        assert commands(record, gpu)[-2:] == ["set_default_device_pinned_mem_limit 0 40960M",
                                              "set_default_active_thread_percentage 50"]
        await later.release("claim")
        assert not alive(pid) and nvml.compute_mode(0) == 0
        earlier._units.clear()  # its daemon is gone: nothing of it to close
        await earlier.close()


@pytest.mark.asyncio
async def test_a_daemon_an_earlier_life_left_with_no_share_is_named_and_stopped_unless_a_share_came_first(
        mps_control, runtime_dir, record):
    """R-MP-1 across a front door's death (issue 49's fault run): the unit's last share went while it was down."""
    nvml = SimulatedNvml.with_gpus(2)
    async with Runtime():
        earlier = await manager(nvml, runtime_dir, mps_control)
        gpu0, gpu1 = nvml.uuid(0), nvml.uuid(1)
        await earlier.share(gpu0, "pod-a", HALF)
        await earlier.share(gpu1, "pod-b", HALF)
        pids = {gpu: earlier.daemon_pid(gpu) for gpu in (gpu0, gpu1)}
        # The front door dies (no close); pod-a goes meanwhile; the next life grants pod-b again.
        later = await manager(nvml, runtime_dir, mps_control)
        await later.share(gpu1, "pod-b", HALF)
        assert await later.left_running() == [gpu0]
        assert await later.stop_left(gpu1) is False and alive(pids[gpu1])  # it has a share: kept
        assert await later.stop_left(gpu0) is True
        assert not alive(pids[gpu0]) and commands(record, gpu0)[-1] == "quit"
        assert nvml.compute_mode(0) == 0 and nvml.compute_mode(1) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        assert await later.left_running() == [] and await later.stop_left(gpu0) is False  # nothing runs there now
        await later.close()
        assert not alive(pids[gpu1])
        earlier._units.clear()  # its daemons are gone: nothing of it to close
        await earlier.close()


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
async def test_the_daemon_shares_memory_in_the_units_directory_only(mps_control, runtime_dir, record):
    """The daemon (and the servers it forks) see the unit's shm directory at
    /dev/shm, the directory a share's containers get there (R-MP-3), in a
    mount namespace of their own: the front door's /dev/shm is untouched."""
    nvml = SimulatedNvml.with_gpus(2)
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        shares = [await daemons.share(nvml.uuid(i), f"claim-{i}", HALF) for i in range(2)]
        seen = {unit: detail for unit, event, detail in read_record(record) if event == "shm"}
        for share in shares:
            own = os.stat(share.shm_dir)
            assert seen[share.unit] == f"{own.st_dev}:{own.st_ino}"
        host = os.stat("/dev/shm")
        assert f"{host.st_dev}:{host.st_ino}" not in seen.values()
        assert os.stat("/dev/shm").st_ino == host.st_ino  # nothing mounted over ours
        await daemons.close()


@pytest.mark.asyncio
async def test_a_daemon_that_ignores_quit_is_killed_within_the_bound(mps_control, runtime_dir, record, monkeypatch):
    nvml = SimulatedNvml.with_gpus(1)
    monkeypatch.setenv("FAKE_MPS_IGNORE_QUIT", "1")
    async with Runtime():
        daemons = MpsDaemons(NvmlService(nvml), runtime_dir, str(mps_control), timeout_s=0.3)
        nvml.init()
        gpu = nvml.uuid(0)
        await daemons.share(gpu, "claim", HALF)
        pid = daemons.daemon_pid(gpu)
        await daemons.release("claim")
        assert commands(record, gpu)[-1] == "quit"
        assert not alive(pid)  # quit answered but ignored: SIGKILL after 0.3 s
        assert nvml.compute_mode(0) == 0 and daemons.restarts == 0
        await daemons.close()


@pytest.mark.asyncio
async def test_a_compute_mode_nvml_refuses_fails_the_share_and_starts_nothing(mps_control, runtime_dir, record):
    nvml = SimulatedNvml.with_gpus(1)
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        gpu = nvml.uuid(0)
        nvml.fail("nvmlDeviceSetComputeMode", 4)  # NVML_ERROR_NO_PERMISSION: not root
        with pytest.raises(MpsError, match=rf"cannot set {gpu} to compute mode EXCLUSIVE_PROCESS for its MPS daemon:"
                                           r" nvmlDeviceSetComputeMode failed: .*NO_PERMISSION.*needs root"):
            await daemons.share(gpu, "claim", HALF)
        assert read_record(record) == [] and daemons.share_state("claim") is None
        # Restoring it fails after a share: the share is returned, the failure logged, close() tries again.
        nvml.fail("nvmlDeviceSetComputeMode", None)
        await daemons.share(gpu, "claim", HALF)
        nvml.fail("nvmlDeviceSetComputeMode", 4)
        assert await daemons.release("claim") and daemons.daemon_pid(gpu) is None
        assert nvml.compute_mode(0) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        nvml.fail("nvmlDeviceSetComputeMode", None)
        await daemons.close()
        assert nvml.compute_mode(0) == 0


@pytest.mark.asyncio
async def test_where_selinux_is_on_the_pipe_and_shm_directories_are_labeled_for_containers(
        mps_control, runtime_dir, record, tmp_path, monkeypatch):
    """NVIDIA's MPS users' most reported failure is a client "waiting for MPS daemon" behind SELinux: the pipe
    directory must be a type containers may open. Where selinuxfs says SELinux is on, the pipe and shm
    directories get container_file_t; where it is off, nothing is labeled."""
    from actors.mps import _daemon

    nvml = SimulatedNvml.with_gpus(2)
    try:
        os.setxattr(tmp_path, "security.selinux", b"probe\0")
    except OSError as exc:
        pytest.skip(f"this filesystem takes no security.selinux label: {exc.strerror}")
    enforce = tmp_path / "enforce"
    monkeypatch.setattr(_daemon, "SELINUX_ENFORCE", str(enforce))
    async with Runtime():
        daemons = await manager(nvml, runtime_dir, mps_control)
        await daemons.share(nvml.uuid(0), "off", HALF)  # no selinuxfs: nothing labeled
        enforce.write_text("1")
        await daemons.share(nvml.uuid(1), "on", HALF)
        paths = [daemons.paths(nvml.uuid(i)) for i in (0, 1)]
        await daemons.close()

    def label(directory: str) -> bytes | None:
        try:
            return os.getxattr(directory, "security.selinux")
        except OSError:
            return None

    assert [label(paths[0].pipe), label(paths[0].shm)] == [None, None]
    assert [label(paths[1].pipe), label(paths[1].shm)] == [b"system_u:object_r:container_file_t:s0\0"] * 2
    assert label(paths[1].log) is None  # the daemon's own: no container reads it
