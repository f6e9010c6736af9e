"""R-SV-2..4 with R-SC-2 on the real kernel (root; cgroups v1 and v2):
``gpu-isolator serve`` and ``gpu-isolator exec`` as real OS processes on a
simulated 4-GPU node; the service starts each command itself, inside its
container. A probe run by exec opens mknod'ed GPU nodes from inside its
container: ENXIO (no driver behind major 195) = the kernel let it through,
EPERM = the device cgroup denied it. Every wait is bounded. (The same as
throwaway users, and the attacks of issue 25: ``test_shared_box``.)"""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

from tests.support.kernel import wait_gone
from tests.support.probes import DENIED, GRANTED
from tests.support.services import ServeProcess, ask

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
    state = service.state_naming(*results.values())
    views = by_pid(state)
    granted = {}
    for label, result in results.items():
        name, view = views[result["pid"]]
        granted[label] = set(view["gpus"])
        assert result["access"] == expected(gpu_nodes, granted[label]), label
        assert cgroup_line(result, service.node.backend).endswith(f"/{service.node.cgroups_root}/{name}")
        assert result["CUDA_VISIBLE_DEVICES"] == ",".join(view["uuids"])
        assert result["NVIDIA_VISIBLE_DEVICES"] == (",".join(view["uuids"]) or "none")
        assert view["state"] == "running" and (view["user"], result["uid"]) == ("root", 0)
        assert result["NoNewPrivs"] == "1" and view["command"][0].endswith("/exec_probe")
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
    views = by_pid(service.state_naming(got_first, got_second))
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


def test_a_client_killed_with_sigkill_takes_its_command_with_it_and_frees_its_gpus(
        kernel_service: ServeProcess, gpu_nodes: dict[int, str]) -> None:
    """R-SC-2: the client's connection closing kills the command's process group."""
    service = kernel_service
    client = service.probe(*sorted(gpu_nodes.values()), gpus=1, hold=True)
    probe = service.probe_result(client)
    client.kill()
    client.wait()
    assert wait_gone(probe["pid"]), "the command outlived its killed client"
    service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)


LEAVES_ONE_BEHIND = "setsid sleep 60 </dev/null >/dev/null 2>&1 & echo $!"


def test_a_command_that_leaves_processes_behind_keeps_its_gpus_until_they_exit(kernel_service: ServeProcess) -> None:
    service = kernel_service
    code, out, err = service.finish(service.exec("sh", "-c", LEAVES_ONE_BEHIND, gpus=1))
    left = int(out.split()[0])
    try:
        assert code == 0
        assert err.startswith("gpu-isolator exec: 1 process(es) the command left are still running in exec-")
        state = service.wait_state(lambda s: [v["state"] for v in s["containers"].values()] == ["releasing"])
        (name, view), = state["containers"].items()
        shown = service.status()
        assert shown.returncode == 0, shown.stderr
        row = next(line for line in shown.stdout.splitlines() if line.startswith(name))
        assert row.split()[1:5] == [str(view["gpus"][0]), "root", str(view["pid"]), "releasing"]
    finally:
        os.kill(left, signal.SIGKILL)
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
            os.execv(sys.executable, [sys.executable, "-m", "isolators", "exec", f"--socket={kernel_service.socket}",
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


def test_an_exec_containers_gpus_cannot_change_and_its_cleanup_waits_for_its_processes(
        kernel_service: ServeProcess, gpu_nodes: dict[int, str]) -> None:
    service = kernel_service
    holder = service.probe(gpu_nodes[0], gpus=1, hold=True)
    probe = service.probe_result(holder)
    (name, _view), = service.state()["containers"].items()
    changed = ask(service, "update", container_id=name, gpus=2)
    assert changed["error"] == (f"Container {name} runs a command of 'gpu-isolator exec': its GPUs cannot"
                                " change while it runs")
    cleaned = ask(service, "cleanup", container_id=name)
    assert cleaned["error"] is None and (cleaned["released"], cleaned["processes"]) == (False, 1)
    assert service.state()["containers"][name]["state"] == "releasing"
    holder.stdin.close()
    assert service.finish(holder)[0] == 0 and wait_gone(probe["pid"])
    service.wait_state(lambda s: not s["containers"] and s["free"] == ALL)
