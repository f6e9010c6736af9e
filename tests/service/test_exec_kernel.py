"""R-SV-2..4 on the real kernel (root; cgroups v1 and v2): ``gpu-isolator
serve`` and ``gpu-isolator exec`` as real OS processes on a simulated
4-GPU node. A probe run by exec opens mknod'ed GPU nodes from inside its
container: ENXIO (no driver behind major 195) = the kernel let it through,
EPERM = the device cgroup denied it. Every wait is bounded."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

import anyio
import pytest

from isolators.service import Cleanup, Prepare, ServiceClient, Start, Update
from isolators.service._host import cgroup_of
from runtime import spawn
from tests.support.probes import DENIED, GRANTED
from tests.support.services import ServeProcess, ask, client_of

ALL = [0, 1, 2, 3]


def expected(gpu_nodes: dict[int, str], granted: set[int]) -> dict[str, str]:
    """The verdict on opening each node for a process granted ``granted`` (nvidiactl always)."""
    wanted = {gpu_nodes[m]: GRANTED if m in granted else DENIED for m in ALL}
    wanted[gpu_nodes[255]] = GRANTED
    return wanted


def cgroup_line(probe: dict, backend: str) -> str:
    """The probe's own cgroup on the hierarchy that holds its device rules."""
    for line in probe["cgroup"].splitlines():
        number, controllers, path = line.split(":", 2)
        if (backend == "cgroups_v1" and "devices" in controllers.split(",")) or (
                backend == "cgroups_v2" and number == "0"):
            return path
    raise AssertionError(f"no {backend} line in {probe['cgroup']!r}")


def by_pid(state: dict) -> dict[int, tuple[str, dict]]:
    return {view["pid"]: (name, view) for name, view in state["containers"].items()}


def test_concurrent_execs_each_run_inside_their_cgroup_with_exactly_their_gpus(kernel_service: ServeProcess,
                                                                              gpu_nodes: dict[int, str]) -> None:
    service = kernel_service
    paths = sorted(gpu_nodes.values())
    before = service.metrics()
    one = service.probe(*paths, gpus=1, hold=True)
    two = service.probe(*paths, gpus=2, hold=True)
    none = service.probe(*paths, gpus=0, hold=True)
    results = {name: service.probe_result(process) for name, process in (("one", one), ("two", two), ("none", none))}
    state = service.state()
    views = by_pid(state)
    granted = {}
    for label, result in results.items():
        name, view = views[result["pid"]]
        granted[label] = set(view["gpus"])
        assert result["access"] == expected(gpu_nodes, granted[label]), label
        assert cgroup_line(result, service.node.backend).endswith(f"/{service.node.cgroups_root}/{name}")
        assert result["CUDA_VISIBLE_DEVICES"] == ",".join(view["uuids"])
        assert result["NVIDIA_VISIBLE_DEVICES"] == (",".join(view["uuids"]) or "none")
        assert view["state"] == "running" and view["user"] == "root"
        assert view["command"][0] == sys.executable
    assert [len(granted[label]) for label in ("one", "two", "none")] == [1, 2, 0]
    assert granted["one"].isdisjoint(granted["two"])
    assert all(uuid.startswith("GPU-") for view in state["containers"].values() for uuid in view["uuids"])
    assert state["free"] == sorted(set(ALL) - granted["one"] - granted["two"])
    for process in (one, two, none):
        process.stdin.close()
    assert [service.finish(p)[0] for p in (one, two, none)] == [0, 0, 0]
    service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)
    after = service.metrics()
    assert {name: after[name] - before[name] for name in ("service_exec_started_total",
                                                          "service_released_when_empty_total")} == {
        "service_exec_started_total": 3, "service_released_when_empty_total": 3}


def test_wait_queues_first_come_first_served_and_too_few_fails_with_the_mesos_text(
        kernel_service: ServeProcess, gpu_nodes: dict[int, str]) -> None:
    service = kernel_service
    paths = sorted(gpu_nodes.values())
    holder = service.probe(*paths, gpus=3, hold=True)
    service.probe_result(holder)
    code, out, err = service.finish(service.exec("true", gpus=2))
    assert (code, err) == (125, "gpu-isolator exec: error: Requested 2 gpus but only 1 available\n")

    first = service.probe(*paths, gpus=2, hold=True, wait=True)
    service.wait_state(lambda s: len(s["waiting"]) == 1)
    second = service.probe(*paths, gpus=1, hold=True, wait=True)
    state = service.wait_state(lambda s: len(s["waiting"]) == 2)
    assert [w["gpus"] for w in state["waiting"]] == [2, 1]
    assert len(state["free"]) == 1  # free, yet not handed to the second: the first is ahead of it
    shown = service.status()
    assert shown.returncode == 0 and "waiting (first come, first served):" in shown.stdout

    withdrawn = service.exec("true", gpus=1, wait=True)
    service.wait_state(lambda s: len(s["waiting"]) == 3)
    withdrawn.send_signal(signal.SIGTERM)
    code, _, err = service.finish(withdrawn)
    assert code == 128 + signal.SIGTERM and "SIGTERM before the command started" in err
    service.wait_state(lambda s: len(s["waiting"]) == 2)

    holder.stdin.close()
    assert service.finish(holder)[0] == 0
    got_first, got_second = service.probe_result(first), service.probe_result(second)
    views = by_pid(service.state())
    first_gpus, second_gpus = set(views[got_first["pid"]][1]["gpus"]), set(views[got_second["pid"]][1]["gpus"])
    assert (len(first_gpus), len(second_gpus)) == (2, 1) and first_gpus.isdisjoint(second_gpus)
    assert got_first["access"] == expected(gpu_nodes, first_gpus)
    assert got_second["access"] == expected(gpu_nodes, second_gpus)
    for process in (first, second):
        process.stdin.close()
    (code1, _, err1), (code2, _, _) = service.finish(first), service.finish(second)
    assert (code1, code2) == (0, 0)
    assert "gpu-isolator exec: waiting for 2 GPU(s): 1 free, 0 request(s) ahead" in err1
    service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)


def test_a_client_killed_with_sigkill_frees_its_gpus_once_its_command_is_gone(kernel_service: ServeProcess,
                                                                             gpu_nodes: dict[int, str]) -> None:
    service = kernel_service
    client = service.probe(*sorted(gpu_nodes.values()), gpus=1, hold=True)
    probe = service.probe_result(client)
    client.kill()
    client.wait()
    state = service.wait_state(lambda s: [v["state"] for v in s["containers"].values()] == ["releasing"])
    (name, view), = state["containers"].items()
    os.kill(probe["pid"], 0)  # the command outlived its client, and keeps its GPU
    shown = service.status()
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if line.startswith(name))
    assert row.split()[1:5] == [str(view["gpus"][0]), "root", str(probe["pid"]), "releasing"]
    client.stdin.close()  # the command's stdin: it ends
    service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)
    shown = service.status()
    assert "(no containers)" in shown.stdout and "free GPUs:      0,1,2,3" in shown.stdout


TRAP = r"""
import os, signal, time
def stop(signo, frame):  # os.write: the signal may come while print flushes "ready"
    os.write(1, b"got %d\n" % signo)
    os._exit(42)
signal.signal(signal.SIGTERM, stop)
os.write(1, b"ready\n")
time.sleep(60)
"""


def test_signals_are_forwarded_and_exit_statuses_are_the_commands(kernel_service: ServeProcess, tmp_path) -> None:
    service = kernel_service
    trap = tmp_path / "trap.py"
    trap.write_text(TRAP)
    trapped = service.exec(sys.executable, "-I", "-S", str(trap), gpus=1)
    killed = service.exec("sh", "-c", "kill -KILL $$", gpus=1)
    exits = service.exec("sh", "-c", "exit 7", gpus=0)
    missing = service.exec("no-such-command-for-gpu-isolator", gpus=0)
    assert trapped.stdout.readline() == b"ready\n"
    trapped.send_signal(signal.SIGTERM)
    result = service.finish(trapped)
    assert result[:2] == (42, "got 15\n"), result
    assert service.finish(killed)[0] == 128 + signal.SIGKILL
    assert service.finish(exits)[0] == 7
    code, _, err = service.finish(missing)
    assert (code, err) == (127, "gpu-isolator exec: error: cannot run 'no-such-command-for-gpu-isolator':"
                                " No such file or directory\n")
    service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)


COUNT_SIGINTS = r"""
import os, signal, time
seen = []
signal.signal(signal.SIGINT, lambda signo, frame: seen.append(signo))
os.write(1, b"ready\n")
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not seen:
    time.sleep(0.01)
time.sleep(0.5)  # a second delivery would come now
os.write(1, b"SIGINT x%d\n" % len(seen))
os._exit(len(seen))
"""


def test_ctrl_c_on_the_terminal_reaches_the_command_once(kernel_service: ServeProcess, tmp_path) -> None:
    """The terminal signals the whole foreground group (exec and its command):
    exec does not forward that one a second time."""
    script = tmp_path / "count.py"
    script.write_text(COUNT_SIGINTS)
    pid, terminal = pty.fork()
    if pid == 0:  # the child: exec on a terminal of its own, in the foreground
        try:
            os.execv(sys.executable, [sys.executable, "-m", "isolators", "exec", "--agent", kernel_service.address,
                                      "--gpus", "1", "--", sys.executable, "-I", "-S", str(script)])
        finally:
            os._exit(127)
    seen = b""
    status = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if b"ready" in seen and b"\x03" not in seen:
                os.write(terminal, b"\x03")  # Ctrl-C
                seen += b"\x03"
            if select.select([terminal], [], [], 0.2)[0]:
                try:
                    chunk = os.read(terminal, 1024)
                except OSError:  # the terminal closed: exec has exited
                    break
                if not chunk:
                    break
                seen += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(terminal)
        if status is None:  # not reaped: still ours to kill
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert b"SIGINT x1" in seen, seen
    assert os.waitstatus_to_exitcode(status) == 1, seen
    kernel_service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)


async def _start_is_guarded(service: ServeProcess) -> None:
    victim = await anyio.open_process(["sleep", "30"])
    try:
        async with client_of(service, id="owner") as owner:
            intruder = ServiceClient(owner.service, id="intruder")  # same address, another process
            spawn(intruder)
            prepared = await ask(owner, "prepare", Prepare(request="p", container_id="guarded", gpus=1,
                                                           command=["sleep", "30"]))
            assert prepared.error is None and len(prepared.token) == 32
            forged = await ask(intruder, "start", Start(request="s1", container_id="guarded", token=prepared.token,
                                                        pid=victim.pid))
            assert forged.error == "Container guarded: only the client that prepared it may start it (wrong token)"
            guessed = await ask(owner, "start", Start(request="s2", container_id="guarded", token="0" * 32,
                                                      pid=victim.pid))
            assert guessed.error == forged.error
            controller = "devices" if service.node.backend == "cgroups_v1" else ""
            assert not cgroup_of(victim.pid, controller).endswith("/guarded")  # refused: not moved
            started = await ask(owner, "start", Start(request="s3", container_id="guarded", token=prepared.token,
                                                      pid=victim.pid))
            assert started.error is None and started.cgroup == service.node.cgroup_dir("guarded")
            assert cgroup_of(victim.pid, controller) == f"/{service.node.cgroups_root}/guarded"
            with open(os.path.join(started.cgroup, "cgroup.procs")) as procs:
                assert str(victim.pid) in procs.read().split()
            again = await ask(owner, "start", Start(request="s4", container_id="guarded", token=prepared.token,
                                                    pid=victim.pid))
            assert again.error is not None
            changed = await ask(owner, "update", Update(request="u", container_id="guarded", gpus=2))
            assert changed.error == ("Container guarded runs a command of 'gpu-isolator exec': its GPUs cannot"
                                     " change while it runs")
            cleaned = await ask(owner, "cleanup", Cleanup(request="c", container_id="guarded"))
            assert cleaned.error is None and (cleaned.released, cleaned.processes) == (False, 1)
    finally:
        victim.kill()
        await victim.wait()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_start_moves_a_process_only_for_the_client_holding_the_token(kernel_service: ServeProcess,
                                                                          anyio_backend: str) -> None:
    await _start_is_guarded(kernel_service)
    await anyio.to_thread.run_sync(kernel_service.wait_state, lambda s: not s["containers"] and s["free"] == ALL)
