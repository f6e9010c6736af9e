"""The service's parts on their own: who owns a listening socket, the
command held back until it is told to run, exit statuses, the records
file, the waiting line, flags from a file and options, what a request
asks for (GPUs and MIG devices by profile), and the status table."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isolators.service import (
    ContainerRecord,
    ContainerView,
    MigDeviceView,
    PendingCommand,
    Prepare,
    RecordsError,
    RecordsFile,
    ServiceState,
    WaitingView,
    exit_code,
    render_state,
    service_flags,
    visible_devices_env,
)
from isolators.service._host import HostError, cgroup_of, listener_uid, move_into, process_owner
from isolators.service._demand import demand_of, describe, merge_mig_options, resources_text
from isolators.service._line import GRANT, QUEUE, PendingPrepare, WaitingLine


def test_listener_uid_names_the_owner_of_the_socket_listening_there() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert listener_uid("127.0.0.1", port) == os.getuid()
        assert listener_uid("localhost", port) == os.getuid()
        closed.bind(("127.0.0.1", 0))  # bound, not listening
        assert listener_uid("127.0.0.1", closed.getsockname()[1]) is None
    with socket.socket() as wildcard:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        assert listener_uid("127.0.0.1", wildcard.getsockname()[1]) == os.getuid()


def _ipv6_loopback() -> socket.socket:
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    six = socket.socket(socket.AF_INET6)
    try:
        six.bind(("::1", 0))
    except OSError as error:
        six.close()
        pytest.skip(f"cannot bind the IPv6 loopback [::1]: {error}")
    return six


def test_listener_uid_tells_an_ipv6_listener_from_an_ipv4_one() -> None:
    with _ipv6_loopback() as six:
        six.listen()
        assert listener_uid("::1", six.getsockname()[1]) == os.getuid()
        assert listener_uid("127.0.0.1", six.getsockname()[1]) is None


def test_process_facts_and_a_move_that_is_refused() -> None:
    me = os.getpid()
    assert process_owner(me) == (os.getuid(), os.geteuid())
    assert cgroup_of(me, "") is not None
    with pytest.raises(HostError, match="Process 4194304 does not exist"):
        process_owner(4194304)
    if os.getuid() != 0:
        with pytest.raises(HostError, match="belongs to uid"):
            move_into(1, "/nonexistent", "/x", "", os.getuid())


def test_a_pending_command_runs_nothing_until_told_and_nothing_when_aborted(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = f"import os, sys; open({str(marker)!r}, 'a').write(os.environ.get('GRANT', '?') + '\\n'); sys.exit(3)"
    aborted = PendingCommand.fork([sys.executable, "-c", script])
    time.sleep(0.2)
    assert not marker.exists()
    aborted.abort()
    assert exit_code(aborted.wait()) == 125 and not marker.exists()
    aborted.close()

    told = PendingCommand.fork([sys.executable, "-c", script])
    assert told.run({"GRANT": "GPU-x"}) is None
    assert exit_code(told.wait()) == 3 and marker.read_text() == "GPU-x\n"
    told.close()

    missing = PendingCommand.fork(["no-such-command-for-gpu-isolator"])
    error = missing.run({})
    assert error is not None and error.errno == 2
    assert exit_code(missing.wait()) == 127
    missing.close()


def test_a_signal_sent_before_the_command_runs_is_delivered_when_it_does() -> None:
    held = PendingCommand.fork(["sleep", "30"])
    time.sleep(0.2)
    os.kill(held.pid, signal.SIGTERM)  # blocked while it waits: nothing happens yet
    time.sleep(0.1)
    assert os.waitpid(held.pid, os.WNOHANG) == (0, 0)
    held.run({})  # the signal is delivered as it unblocks, before the command runs
    assert exit_code(held.wait()) == 128 + signal.SIGTERM
    held.close()


def test_records_round_trip_and_refuse_to_be_read_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "service" / "containers.json"
    records = RecordsFile(str(path), "/sys/fs/cgroup/devices/root")
    assert records.load() == []
    saved = [ContainerRecord(container_id="b", command=["python", "x.py"], client="c@127.0.0.1:1", uid=0,
                             user="root", pid=42, since=1.5),
             ContainerRecord(container_id="a", recovered=True)]
    records.write(records.encode(saved))
    assert [r.container_id for r in records.load()] == ["a", "b"] and records.load()[1] == saved[0]
    assert not (tmp_path / "service" / "containers.json.tmp").exists()
    for content, reason in ((b"", "it is empty"), (b"{not json", "truncated or garbled"),
                            (json.dumps({"version": 9, "root": "x", "containers": []}).encode(), "unknown version 9")):
        path.write_bytes(content)
        with pytest.raises(RecordsError, match=reason) as caught:
            records.load()
        assert "delete it to start afresh" in str(caught.value)
    path.write_bytes(records.encode(saved))
    with pytest.raises(RecordsError, match="belong to the cgroups root '/sys/fs/cgroup/devices/root'"):
        RecordsFile(str(path), "/elsewhere").load()


def test_flags_come_from_the_file_with_options_over_them(tmp_path: Path) -> None:
    file = tmp_path / "flags.toml"
    file.write_text('device_backend = "memory"\ncgroups_root = "from-file"\ngpu_allocation = "lowest"\n')
    flags = service_flags(str(file), ["--cgroups-root=from-option", "--reconcile_interval", "30secs"])
    assert (flags.device_backend, flags.cgroups_root, flags.gpu_allocation, flags.reconcile_interval) == (
        "memory", "from-option", "lowest", 30.0)
    assert service_flags(None, []).cgroups_root == "gpu-isolator"
    with pytest.raises(ValueError, match="Failed to load unknown flag 'nope'"):
        service_flags(str(file), ["--nope=1"])


def test_visible_devices_and_the_status_table() -> None:
    assert visible_devices_env(["GPU-a", "GPU-b"]) == {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b",
                                                       "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    assert visible_devices_env([]) == {"NVIDIA_VISIBLE_DEVICES": "none", "CUDA_VISIBLE_DEVICES": ""}
    state = ServiceState(
        containers={"exec-1": ContainerView(gpus=[0, 1], command=["python", "train.py", "--lr", "0.1 x"],
                                            user="alice", pid=123, since=1000.0, state="running")},
        free=[2], unhealthy={"3": "Xid 79"}, total=[0, 1, 2, 3], backend="cgroups_v2",
        address="gpu-isolator@127.0.0.1:5052",
        waiting=[WaitingView(container_id="exec-2", gpus=2, command=["sleep", "1"], user="bob", since=1090.0)])
    assert render_state(state, now=1100.0).splitlines() == [
        "gpu-isolator@127.0.0.1:5052: cgroups_v2, 4 GPU(s): 1 free, 1 unhealthy, 1 container(s), 1 waiting",
        "CONTAINER  GPUS  USER   PID  STATE    AGE    COMMAND",
        "exec-1     0,1   alice  123  running  1m40s  python train.py --lr '0.1 x'",
        "free GPUs:      2",
        "unhealthy GPUs: 3 (Xid 79)",
        "waiting (first come, first served):",
        "  CONTAINER  GPUS  USER  AGE  COMMAND",
        "  exec-2     2     bob   10s  sleep 1",
    ]


@pytest.mark.parametrize("argv, text", [
    (["serve", "--listen", "127.0.0.1:0", "--bogus=1"], "gpu-isolator: error: Failed to load unknown flag 'bogus'"),
    (["serve", "--poll-interval", "0", "--device_backend=memory"], "--poll-interval must be > 0, got 0.0"),
    (["exec", "--gpus", "-1", "--", "true"], "gpu-isolator exec: error: --gpus must be a whole number >= 0, got -1"),
    (["exec", "--gpus", "two", "--", "true"], "argument --gpus: invalid int value: 'two'"),
    (["exec", "--", "true"], "gpu-isolator exec: error: say what the command gets: --gpus N (0: no GPU) and/or"
                             " --mig PROFILE[:N]"),
    (["exec", "--mig", "1g.18gb:0", "--", "true"],
     "gpu-isolator exec: error: --mig '1g.18gb:0': the count after ':' must be a whole number above 0"),
    (["exec", "--mig", "big", "--", "true"], "gpu-isolator exec: error: Invalid MIG profile 'big': "),
    (["status", "--agent", "127.0.0.1:99999"], "gpu-isolator status: error: Invalid address '127.0.0.1:99999'"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv: list[str], text: str, capsys: pytest.CaptureFixture) -> None:
    from isolators.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err


def test_a_process_of_another_user_is_never_moved(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to start a process as another user")
    other = subprocess.Popen(["sleep", "30"], user=65534)
    try:
        target = tmp_path / "cgroup"
        target.mkdir()
        with pytest.raises(HostError, match=f"Process {other.pid} belongs to uid 65534, not to the sender"
                                            r" \(uid 1000\); a client may move only its own processes"):
            move_into(other.pid, str(target), "/x", "", 1000)
        assert not (target / "cgroup.procs").exists()  # refused before anything was written
    finally:
        other.kill()
        other.wait()


def test_the_waiting_line_is_first_come_first_served() -> None:
    line = WaitingLine()

    def arrive(name: str, gpus: int, wait: bool, sender: str = "client") -> PendingPrepare:
        pending = PendingPrepare(sender, Prepare(request=name, container_id=name, gpus=gpus, wait=wait))
        line.arrive(pending)
        assert line.next_arrival() is pending
        return pending

    two, free_one, free_two = {"gpus": 2}, {"gpus": 1}, {"gpus": 2}
    assert line.admission(two, wait=False, free=free_one) == GRANT  # the isolator refuses it, with Mesos' text
    assert line.admission(two, wait=True, free=free_one) == QUEUE
    assert line.admission(two, wait=True, free=free_two) == GRANT
    big = arrive("big", 3, True)
    assert line.enqueue(big) == 1
    assert line.admission({"gpus": 1}, wait=False, free=free_two) == (
        "Requested 1 gpus but only 0 available: the free GPUs are held for 1 earlier request(s) for 3 GPU(s) waiting"
        " in line")
    assert line.admission({"gpus": 1}, wait=True, free=free_two) == QUEUE  # behind "big", though it would fit
    small = arrive("small", 1, True, sender="other")
    assert line.enqueue(small) == 2
    assert line.head() is big and line.holds("small") and [p.view().container_id for p in line.waiting()] == [
        "big", "small"]
    assert line.cancel("big") == [big] and big.cancelled
    assert line.head() is small and line.enqueue(arrive("late", 1, True)) == 2
    assert line.drop_sender("other") == [small] and line.head().body.container_id == "late"
    assert line.pop_head().body.container_id == "late" and line.head() is None
    line.arrive(PendingPrepare("client", Prepare(request="x", container_id="x", gpus=1)))
    assert [p.body.container_id for p in line.close()] == ["x"] and line.next_arrival() is None


def test_a_request_asks_for_gpus_and_mig_devices_by_profile() -> None:
    assert demand_of(2) == {"gpus": 2}
    mig = merge_mig_options(["1g.18gb", "mig-1g.18gb:2", "3g.71gb:1"])
    assert mig == {"1g.18gb": 3, "3g.71gb": 1}
    demand = demand_of(0, {**mig, "2g.35gb": 0})
    assert demand == {"gpus": 0, "mig-1g.18gb": 3, "mig-3g.71gb": 1}
    assert resources_text(demand) == "gpus:0;mig-1g.18gb:3;mig-3g.71gb:1"
    assert (describe(demand), describe({**demand, "gpus": 1}), describe({"gpus": 0})) == (
        "3 MIG 1g.18gb and 1 MIG 3g.71gb", "1 GPU(s) and 3 MIG 1g.18gb and 1 MIG 3g.71gb", "0 GPU(s)")
    with pytest.raises(ValueError, match=r"^Invalid MIG profile 'mig-18gb': "):
        demand_of(1, {"mig-18gb": 1})


def test_the_waiting_line_counts_mig_devices_per_profile() -> None:
    line = WaitingLine()
    body = Prepare(request="a", container_id="a", mig={"1g.18gb": 2}, wait=True)
    assert line.admission(demand_of(0, body.mig), wait=True, free={"gpus": 4, "mig-1g.18gb": 1}) == QUEUE
    assert line.admission(demand_of(0, body.mig), wait=True, free={"gpus": 0, "mig-1g.18gb": 2}) == GRANT
    waiting = PendingPrepare("client", body, demand_of(0, body.mig))
    line.enqueue(waiting)
    assert waiting.view().mig == {"1g.18gb": 2}
    assert line.admission({"gpus": 0, "mig-3g.71gb": 1}, wait=False, free={"mig-3g.71gb": 1}) == (
        "Requested 1 mig-3g.71gb but only 0 available: the free GPUs are held for 1 earlier request(s) for 2 MIG"
        " 1g.18gb waiting in line")


def test_the_status_table_of_a_mig_node() -> None:
    def mig(name: str, gi: int, profile: str, **more: object) -> MigDeviceView:
        return MigDeviceView(device=f"195:0/gi{gi}/ci0", name=name, gpu=0, profile=profile,
                             resource=f"mig-{profile}", **more)

    state = ServiceState(
        containers={"exec-1": ContainerView(gpus=[1], mig_devices=["195:0/gi3/ci0"], command=["nvidia-smi", "-L"],
                                            user="alice", pid=123, since=1000.0, state="running")},
        free=[], unhealthy={}, total=[1], backend="cgroups_v2", address="gpu-isolator@127.0.0.1:5052",
        mig_strategy="mixed",
        mig_devices=[mig("0:3", 1, "3g.71gb", unhealthy="Xid 79"), mig("0:2", 2, "2g.35gb"),
                     mig("0:0", 3, "1g.18gb", container="exec-1")],
        waiting=[WaitingView(container_id="exec-2", gpus=0, mig={"1g.18gb": 2}, command=["sleep", "1"], user="bob",
                             since=1090.0)])
    assert render_state(state, now=1100.0).splitlines() == [
        "gpu-isolator@127.0.0.1:5052: cgroups_v2, 1 GPU(s): 0 free, 0 unhealthy, 3 MIG device(s): 1 free,"
        " 1 unhealthy, 1 container(s), 1 waiting",
        "CONTAINER  GPUS   USER   PID  STATE    AGE    COMMAND",
        "exec-1     1,0:0  alice  123  running  1m40s  nvidia-smi -L",
        "free GPUs:      -",
        "unhealthy GPUs: -",
        "MIG devices (--nvidia_mig_strategy=mixed: exec --mig PROFILE[:N]):",
        "  MIG  PROFILE  DEVICE         STATE",
        "  0:3  3g.71gb  195:0/gi1/ci0  unhealthy (Xid 79)",
        "  0:2  2g.35gb  195:0/gi2/ci0  free",
        "  0:0  1g.18gb  195:0/gi3/ci0  exec-1",
        "waiting (first come, first served):",
        "  CONTAINER  GPUS       USER  AGE  COMMAND",
        "  exec-2     1g.18gb:2  bob   10s  sleep 1",
    ]
    whole = ServiceState(containers={}, free=[0, 1], unhealthy={}, total=[0, 1], backend="cgroups_v1",
                         address="gpu-isolator@127.0.0.1:5052", mig_mode=[0])
    assert render_state(whole, now=0.0).splitlines()[-1] == (
        "MIG mode:       GPU(s) 0 handed out whole (--nvidia_mig_strategy=none: no MIG device is handed out)")
