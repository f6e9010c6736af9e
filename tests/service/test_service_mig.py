"""``serve`` / ``exec`` / ``status`` on a MIG node (SPEC R-SV-2 with R-MG-3), on
the real kernel (root; cgroups v1 and v2) with mknod'ed GPU, control and
capability nodes (``tests.support.mig``: an H200 in MIG mode with the
balanced layout beside a whole one; caps of a dynamic major).

- ``mixed``: ``exec --mig PROFILE[:N]`` runs the command with exactly its
  MIG devices (their parent node and their two capability nodes: ENXIO;
  the other MIG devices' caps: EPERM) and their ``MIG-`` UUIDs; ``exec
  --gpus N`` beyond the whole GPUs is one error naming the MIG devices and
  how to ask for them; ``status`` lists the MIG devices and their holders.
- ``single``: ``exec --gpus N`` is N MIG devices.
- ``none``: MIG-mode GPUs go whole, and exec and status say what that means.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.kernel import KERNEL_BACKENDS
from tests.support.mig import CAPS_MAJOR, HOST, MIG, caps_of, expect, mknod_mig_nodes, write_mig_proc
from tests.support.probes import GRANTED, DeviceNodes
from tests.support.services import ServeProcess

UUIDS = {name: f"MIG-2b6e1a40-7f1c-5d0e-8a53-00000000000{gi}" for name, gi in
         (("3g", 1), ("2g", 2), ("1g-a", 3), ("1g-b", 4))}
NAMES = {"1g-a": "0:0", "1g-b": "0:1", "2g": "0:2", "3g": "0:3"}  # NVIDIA's <GPU index>:<MIG index>
OFFER = "1g.18gb (2), 2g.35gb (1), 3g.71gb (1)"


def host_with_uuids(gpus: int = 2) -> dict[str, Any]:
    """``HOST`` (the first ``gpus`` GPUs) with UUIDs on its MIG devices."""
    first = dict(HOST["gpus"][0])
    by_gi = {device.gi: name for name, device in MIG.items()}
    first["mig_devices"] = [dict(mig, uuid=UUIDS[by_gi[mig["gi"]]]) for mig in first["mig_devices"]]
    return {**HOST, "gpus": [first, *HOST["gpus"][1:gpus]]}


@pytest.fixture
def mig_nodes(tmp_path) -> DeviceNodes:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    directory = tmp_path / "mig-nodes"
    directory.mkdir()
    return mknod_mig_nodes(str(directory))


def mig_service(serve_factory, backend: str, strategy: str, gpus: int = 2) -> ServeProcess:
    host = host_with_uuids(gpus)
    service = serve_factory(backend, host=host, nvidia_mig_strategy=strategy)
    write_mig_proc(service.node.proc_dir, host)  # the caps major of tests.support.mig, not the default
    return service.start()


def probe_args(nodes: DeviceNodes) -> dict[str, str]:
    """Name -> the probe's argument: GPU nodes opened read-write, capability nodes read-only ("r:")."""
    args = {"nvidia0": nodes["c", 195, 0], "nvidia1": nodes["c", 195, 1], "nvidiactl": nodes["c", 195, 255]}
    for name, device in MIG.items():
        gi, ci = caps_of(device)
        args[f"{name}:gi"] = "r:" + nodes["c", CAPS_MAJOR, gi]
        args[f"{name}:ci"] = "r:" + nodes["c", CAPS_MAJOR, ci]
    return args


def seen(result: dict[str, Any], nodes: DeviceNodes) -> dict[str, str]:
    return {name: result["access"][arg.removeprefix("r:")] for name, arg in probe_args(nodes).items()}


def mig_exec(service: ServeProcess, nodes: DeviceNodes, **request: Any) -> Any:
    return service.probe(*probe_args(nodes).values(), hold=True, **request)


def assert_refused(service: ServeProcess, text: str, **request: Any) -> None:
    """exec of ``request`` is refused: exit 125, ``text`` as its one line, nothing run."""
    code, out, err = service.finish(service.exec("true", **request))
    assert (code, out, err) == (125, "", f"gpu-isolator exec: error: {text}\n")


def container_of(state: dict[str, Any], pid: int) -> tuple[str, dict[str, Any]]:
    return next((name, view) for name, view in state["containers"].items() if view["pid"] == pid)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_mixed_exec_gets_mig_devices_by_profile_and_gpus_beyond_the_whole_ones_is_one_clear_error(
        backend: str, serve_factory, mig_nodes: DeviceNodes) -> None:
    service = mig_service(serve_factory, backend, "mixed")
    assert service.ready_line.endswith("; 1 GPU(s), 4 MIG device(s) (mixed), 0 container(s) recovered)")

    assert_refused(service, "Requested 2 gpus but the node has only 1 whole"
                   " GPU(s) without MIG; GPU(s) 0 are in MIG mode: ask for their MIG devices by profile"
                   f" with --mig PROFILE[:N] (the node has {OFFER})", gpus=2)
    assert_refused(service, "Requested 1 mig-4g.71gb but the node has only 0 (its MIG"
                   f" devices by profile: {OFFER}; ask with --mig PROFILE[:N])", mig=["4g.71gb"])

    first = mig_exec(service, mig_nodes, mig=["1g.18gb"])
    one = service.probe_result(first)  # running before the second asks
    both = mig_exec(service, mig_nodes, gpus=1, mig=["1g.18gb", "2g.35gb:1"])
    two = service.probe_result(both)
    state = service.state_naming(one, two)
    name_one, view_one = container_of(state, one["pid"])
    name_two, view_two = container_of(state, two["pid"])
    assert (view_one["gpus"], view_one["mig_devices"]) == ([], ["195:0/gi3/ci0"])  # lowest first: GI 3, then GI 4
    assert (view_two["gpus"], view_two["mig_devices"]) == ([1], ["195:0/gi2/ci0", "195:0/gi4/ci0"])
    assert seen(one, mig_nodes) == expect("1g-a")
    assert seen(two, mig_nodes) == expect("2g", "1g-b", whole=True)
    assert one["CUDA_VISIBLE_DEVICES"] == one["NVIDIA_VISIBLE_DEVICES"] == UUIDS["1g-a"]
    gpu1 = view_two["uuids"][0]
    assert two["CUDA_VISIBLE_DEVICES"].split(",") == [UUIDS["2g"], UUIDS["1g-b"], gpu1]  # in unit order
    assert view_two["mig_uuids"] == [UUIDS["2g"], UUIDS["1g-b"]]
    assert state["free"] == [] and state["mig_strategy"] == "mixed"
    assert [(m["name"], m["profile"], m["resource"], m["container"]) for m in state["mig_devices"]] == [
        ("0:3", "3g.71gb", "mig-3g.71gb", None), ("0:2", "2g.35gb", "mig-2g.35gb", name_two),
        ("0:0", "1g.18gb", "mig-1g.18gb", name_one), ("0:1", "1g.18gb", "mig-1g.18gb", name_two)]

    assert_refused(service, "Requested 1 mig-1g.18gb but only 0 available", mig=["1g.18gb"])
    shown = service.status()
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].endswith(": cgroups_v1, 1 GPU(s): 0 free, 0 unhealthy, 4 MIG device(s): 1 free, 0 unhealthy,"
                             " 2 container(s), 0 waiting".replace("cgroups_v1", backend))
    assert any(line.split()[:2] == [name_one, "0:0"] for line in lines), lines
    assert any(line.split()[:2] == [name_two, "1,0:2,0:1"] for line in lines), lines
    table = lines[lines.index("MIG devices (--nvidia_mig_strategy=mixed: exec --mig PROFILE[:N]):") + 1:]
    assert [line.split() for line in table[:5]] == [
        ["MIG", "PROFILE", "DEVICE", "STATE"], ["0:3", "3g.71gb", "195:0/gi1/ci0", "free"],
        ["0:2", "2g.35gb", "195:0/gi2/ci0", name_two], ["0:0", "1g.18gb", "195:0/gi3/ci0", name_one],
        ["0:1", "1g.18gb", "195:0/gi4/ci0", name_two]]

    # --wait queues for a MIG profile and runs once one of that profile is free.
    waiter = mig_exec(service, mig_nodes, mig=["1g.18gb"], wait=True)
    state = service.wait_state(lambda s: len(s["waiting"]) == 1)
    assert (state["waiting"][0]["gpus"], state["waiting"][0]["mig"]) == (0, {"1g.18gb": 1})
    first.stdin.close()
    assert service.finish(first)[0] == 0
    assert seen(service.probe_result(waiter), mig_nodes) == expect("1g-a")  # the MIG device first held
    for process in (waiter, both):
        process.stdin.close()
    (code, _, err), (code_both, _, _) = service.finish(waiter), service.finish(both)
    assert (code, code_both) == (0, 0)
    assert err == "gpu-isolator exec: waiting for 1 MIG 1g.18gb: 0 MIG 1g.18gb free, 0 request(s) ahead\n"
    state = service.wait_state(lambda s: not s["containers"])
    assert state["free"] == [1] and all(m["container"] is None for m in state["mig_devices"])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_single_exec_gpus_are_mig_devices(backend: str, serve_factory, mig_nodes: DeviceNodes) -> None:
    service = mig_service(serve_factory, backend, "single", gpus=1)  # every GPU in MIG mode
    assert_refused(service, "Requested 5 gpus but the node has only 4 (MIG devices:"
                   " each is one of 'gpus' under --nvidia_mig_strategy=single)", gpus=5)
    assert_refused(service, "The 'mig-1g.18gb' resource is a MIG device resource: it is"
                   " offered only with '--nvidia_mig_strategy=mixed' (this node runs 'single'); here each"
                   " MIG device is one of 'gpus': ask for N of them with --gpus N", mig=["1g.18gb"])
    process = mig_exec(service, mig_nodes, gpus=1)
    result = service.probe_result(process)
    assert seen(result, mig_nodes) == expect("3g")  # lowest first: GI 1
    assert result["CUDA_VISIBLE_DEVICES"] == UUIDS["3g"]
    state = service.state()
    assert [m["resource"] for m in state["mig_devices"]] == ["gpus"] * 4 and state["total"] == []
    shown = service.status().stdout.splitlines()
    assert "MIG devices (--nvidia_mig_strategy=single: each is one of 'gpus': exec --gpus N):" in shown
    process.stdin.close()
    assert service.finish(process)[0] == 0
    service.wait_state(lambda s: not s["containers"])


def test_none_hands_mig_mode_gpus_out_whole_and_says_so(serve_factory, mig_nodes: DeviceNodes) -> None:
    backend = KERNEL_BACKENDS[-1]
    service = mig_service(serve_factory, backend, "none")
    assert_refused(service, "The 'mig-1g.18gb' resource is a MIG device resource: it is"
                   " offered only with '--nvidia_mig_strategy=mixed' (this node runs 'none'); here GPU(s)"
                   " 0 in MIG mode are handed out whole", mig=["1g.18gb"])
    process = mig_exec(service, mig_nodes, gpus=2)
    result = service.probe_result(process)
    assert seen(result, mig_nodes) == {**expect(whole=True), "nvidia0": GRANTED}  # whole: no cap at all
    state = service.state()
    assert (state["mig_mode"], state["mig_devices"]) == ([0], [])
    assert ("MIG mode:       GPU(s) 0 handed out whole (--nvidia_mig_strategy=none: no MIG device is handed out)"
            in service.status().stdout.splitlines())
    process.stdin.close()
    code, _, err = service.finish(process)
    assert code == 0
    assert err == ("gpu-isolator exec: note: GPU 0 is in MIG mode and is granted whole (the service runs"
                   " --nvidia_mig_strategy=none): CUDA runs on it only through its MIG devices, which this command"
                   " does not hold\n")
    service.wait_state(lambda s: not s["containers"])
