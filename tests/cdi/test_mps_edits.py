"""R-MP-3: what a container holding an MPS share gets through CDI -- the
unit's device nodes (the grant's), the daemon's pipe directory at
/tmp/nvidia-mps with CUDA_MPS_PIPE_DIRECTORY naming it, the unit's shared
memory at /dev/shm; nothing of another unit."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors import Gpu
from actors.devices import DeviceRule
from actors.mps import DaemonPaths
from isolators.cdi import add_mps, container_grant, container_spec, encode_spec, validate_spec

UUIDS = {Gpu.nvidia(i): f"GPU-{i:04d}" for i in range(2)}
CONTROL = {"/tmp/dev/nvidiactl": DeviceRule("c", 195, 255, "rwm")}


def test_a_share_gets_its_units_nodes_its_daemons_pipes_and_shared_memory_and_nothing_else() -> None:
    ours = DaemonPaths.under("/run/gpu-isolator", "GPU-0001")
    theirs = DaemonPaths.under("/run/gpu-isolator", "GPU-0000")
    spec = container_spec("pod-a", container_grant({Gpu.nvidia(1)}, UUIDS, CONTROL, "/tmp/dev"))
    shared = validate_spec(add_mps(spec, ours.pipe, ours.shm))
    edits = shared.devices[0].container_edits
    assert edits.env == ["NVIDIA_VISIBLE_DEVICES=GPU-0001", "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert [(m.host_path, m.container_path, m.options) for m in edits.mounts] == [
        ("/run/gpu-isolator/mps/GPU-0001/pipe", "/tmp/nvidia-mps", ["rw", "nosuid", "nodev", "rbind"]),
        ("/run/gpu-isolator/mps/GPU-0001/shm", "/dev/shm", ["rw", "nosuid", "nodev", "rbind"]),
    ]
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia1", "/dev/nvidiactl"]
    text = encode_spec(shared).decode()
    assert "GPU-0000" not in text and theirs.root not in text and "nvidia0" not in text
    assert "/log" not in text  # the daemon's log stays the front door's
    assert spec.devices[0].container_edits.mounts == []  # the spec given is unchanged


def test_a_container_holds_one_share_and_paths_are_absolute() -> None:
    ours = DaemonPaths.under("/run/gpu-isolator", "GPU-0001")
    spec = add_mps(container_spec("pod-a", container_grant({Gpu.nvidia(1)}, UUIDS, CONTROL, "/tmp/dev")),
                   ours.pipe, ours.shm)
    other = DaemonPaths.under("/run/gpu-isolator", "GPU-0000")
    with pytest.raises(ValueError, match=r"Container device 'pod-a' already has /tmp/nvidia-mps, /dev/shm,"
                                         r" CUDA_MPS_PIPE_DIRECTORY: a container holds one MPS share"):
        add_mps(spec, other.pipe, other.shm)
    with pytest.raises(ValueError, match=r"The MPS pipe directory must be an absolute path, got 'mps/pipe'"):
        add_mps(container_spec("pod-b", container_grant(set(), {}, {}, "/dev")), "mps/pipe", "/x/shm")


@pytest.mark.asyncio
async def test_podman_gives_a_share_its_daemons_pipes_and_shared_memory(podman, gpu_dev, tmp_path, monkeypatch):
    """With a real engine: the container sees CUDA_MPS_PIPE_DIRECTORY, the
    running daemon's pipe directory at /tmp/nvidia-mps (a client in the
    container reaches the daemon through it), writes into the unit's shared
    memory at /dev/shm, and has its unit's node only."""
    import shutil
    import tempfile

    from actors.mps import MpsDaemons
    from actors.mps.testing import NO_GCC, build_mps_control
    from actors.nvml import NvmlService, SimulatedNvml
    from runtime import Runtime

    (tmp_path / "static").mkdir()
    control = build_mps_control(tmp_path)
    client = build_mps_control(tmp_path / "static", static=True)  # the busybox image has no C library
    if control is None or client is None:
        pytest.skip(NO_GCC)
    record = tmp_path / "record"
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    runtime_dir = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    nvml = SimulatedNvml.with_gpus(2)
    nvml.init()
    try:
        async with Runtime():
            daemons = MpsDaemons(NvmlService(nvml), runtime_dir, str(control), timeout_s=5.0)
            try:
                await _share_through_podman(daemons, nvml, podman, gpu_dev, cdi, client, record)
            finally:
                await daemons.close()
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def _share_through_podman(daemons, nvml, podman, gpu_dev, cdi, client, record) -> None:
    from actors.mps import ShareLimits
    from actors.mps.testing import read_record
    from isolators import ContainerID
    from isolators.cdi import container_spec_file_name

    uuid = nvml.uuid(1)
    share = await daemons.share(uuid, "pod-a", ShareLimits(memory_bytes=8 << 30, thread_percentage=50))
    other = await daemons.share(nvml.uuid(0), "pod-b", ShareLimits(memory_bytes=8 << 30, thread_percentage=50))
    (Path(other.shm_dir) / "another-unit").write_text("not yours\n")
    grant = container_grant({Gpu.nvidia(1)}, {Gpu.nvidia(1): uuid}, {}, gpu_dev)
    spec = add_mps(container_spec("pod-a", grant), share.pipe_dir, share.shm_dir)
    (cdi / container_spec_file_name(ContainerID("pod-a"))).write_bytes(encode_spec(spec))
    script = ("echo $CUDA_MPS_PIPE_DIRECTORY; ls /tmp/nvidia-mps; echo hello > /dev/shm/from-the-container;"
              " ls /dev/shm;"
              " ls /dev | grep '^nvidia'; echo get_default_active_thread_percentage | /mps/client")
    result = await daemons.executor.run(lambda: podman.run(
        podman.image, ["/bin/sh", "-c", script], devices=["gpu-isolator/container=pod-a"],
        volumes=[f"{client}:/mps/client:ro"], cdi_dir=str(cdi)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["/tmp/nvidia-mps", "control", "nvidia-cuda-mps-control.pid",
                                          "from-the-container", "nvidia1",
                                          "50.0"]  # the last: the daemon answering a client in the container
    assert (Path(share.shm_dir) / "from-the-container").read_text() == "hello\n"
    # The daemon that answered is the unit's own (its CUDA_VISIBLE_DEVICES), not the other unit's.
    assert read_record(record)[-1] == (uuid, "command", "get_default_active_thread_percentage")
