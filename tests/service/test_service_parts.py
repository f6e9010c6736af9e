"""The service's parts on their own: who is asking (the kernel's peer
credentials) and the one owner check, container ids, frames, exit
statuses, the records file and the directories it trusts (StrictModes),
the waiting line, flags from a file and options, what a request asks for
(GPUs and MIG devices by profile), and the status table."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from actors.file_format import UnreadableFile
from isolators.service import (
    Caller,
    ContainerRecord,
    ContainerView,
    MigDeviceView,
    Prepare,
    RecordsError,
    RecordsFile,
    ServiceError,
    ServiceState,
    UntrustedPath,
    UserShare,
    WaitingView,
    authorize,
    check_trusted_dir,
    exit_code,
    render_state,
    service_flags,
    visible_devices_env,
)
from isolators.service._caller import container_id, peer_caller
from isolators.service._frames import FrameError, FrameReader, encode
from isolators.service._host import cgroup_of, cgroup_pids
from isolators.service._demand import demand_of, describe, merge_mig_options, resources_text
from isolators.service._line import GRANT, QUEUE, PendingPrepare, WaitingLine


def test_the_caller_is_what_the_kernel_says_of_the_other_end() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        caller = peer_caller(left, {})
    assert (caller.uid, caller.gid, caller.pid) == (os.getuid(), os.getgid(), os.getpid())
    assert set(caller.groups) == set(os.getgroups()) and caller.peer == f"pid {os.getpid()}"


def test_one_owner_check_for_every_verb_naming_a_container() -> None:
    alice = Caller(uid=1001, gid=1001, user="alice")
    authorize(alice, "mine", 1001)
    for owner in (1002, 0, None):  # another user's, root's (no command), one found at start without a record
        with pytest.raises(ServiceError, match=r"^Container 'theirs' belongs to another user$"):
            authorize(alice, "theirs", owner)
    authorize(Caller(uid=0, gid=0), "theirs", 1002)  # root
    authorize(Caller.agent("agent@127.0.0.1:1"), "theirs", 1002)  # an agent holding the credential


@pytest.mark.parametrize("text", ["exec-\u202egpjexe", "bad id", "tab\tid", "bell\x07", "caf\u00e9", "", "a.b",
                                  "../x", 5])
def test_container_ids_are_printable_ascii_only(text: object) -> None:
    with pytest.raises(ServiceError, match=r"^Invalid container id "):
        container_id(text)
    assert str(container_id("exec-0123abcd_X")) == "exec-0123abcd_X"


def test_frames_and_what_is_not_one() -> None:
    reader = FrameReader()
    data = encode("prepare", {"container_id": "c", "gpus": 1}) + encode("state", {})
    reader.feed(data[:7])
    assert reader.next() is None and reader.partial
    reader.feed(data[7:])
    assert [(f.verb, f.body) for f in (reader.next(), reader.next())] == [
        ("prepare", {"container_id": "c", "gpus": 1}), ("state", {})]
    for bad, text in ((b"\0\0\0\0", "a frame length of 0"), (b"\x7f\0\0\0", "a frame length of"),
                      (b"\0\0\0\x02[]", 'not {"verb"'), (b"\0\0\0\x02{x", "not JSON")):
        reader = FrameReader()
        reader.feed(bad)
        with pytest.raises(FrameError, match=text):
            reader.next()


def test_exit_statuses_as_a_shell_reports_them(tmp_path: Path) -> None:
    for argv, code in ((["sh", "-c", "exit 3"], 3), (["sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM)):
        process = subprocess.Popen(argv)
        _, status = os.waitpid(process.pid, 0)
        assert exit_code(status) == code
    assert cgroup_of(os.getpid(), "") is not None
    assert cgroup_pids([str(tmp_path / "no-such-cgroup")]) == [[]]


def test_only_trusted_directories_are_used(tmp_path: Path) -> None:
    """R-SC-7: a directory (or a parent) others may write or own is refused, naming it and the fix."""
    if os.geteuid() != 0:
        pytest.skip("needs root to own directories as another user")
    work = tmp_path / "work"
    assert check_trusted_dir(str(work), "work directory") == str(work)  # not there yet: made by the service
    work.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    assert check_trusted_dir(str(work), "work directory") == str(work)
    os.chmod(work, 0o777)
    with pytest.raises(UntrustedPath, match=rf"is not safe: {work} has mode 0777, writable by others \(chmod go-w"):
        check_trusted_dir(str(work), "work directory")
    os.chmod(work, 0o700)
    os.chown(work, 65534, 65534)
    with pytest.raises(UntrustedPath, match=rf"is not safe: {work} is owned by uid 65534, not root \(chown root"):
        check_trusted_dir(str(work / "service"), "work directory")
    os.chown(work, 0, 0)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: a parent whose entries only their owners replace
    (sticky / "mine").mkdir(mode=0o700)
    assert check_trusted_dir(str(sticky / "mine"), "work directory") == str(sticky / "mine")
    with pytest.raises(UntrustedPath, match="writable by others"):
        check_trusted_dir(str(sticky), "work directory")  # but not as the work dir itself
    link = tmp_path / "link"
    link.symlink_to(work)
    assert check_trusted_dir(str(link), "work directory") == str(work)  # resolved, then checked


def test_the_records_are_never_written_or_read_through_a_link(tmp_path: Path) -> None:
    """R-SC-7 (issue 25, finding 7): links planted where the records go are refused, never followed."""
    victim = tmp_path / "root-only"
    victim.write_text("ROOT SECRET\n")
    service = tmp_path / "work" / "service"
    service.mkdir(parents=True, mode=0o700)
    records = RecordsFile(str(service / "containers.json"), "/sys/fs/cgroup/devices/root")
    data = records.encode([ContainerRecord(container_id="a")])
    (service / "containers.json").symlink_to(victim)
    with pytest.raises(RecordsError, match=r"cannot read it \(Too many levels of symbolic links\)"):
        records.load()
    (service / "containers.json").unlink()
    for stale in ("containers.json.1.0.tmp", "containers.json.99.7.tmp"):  # a crash's leftovers, or planted links
        (service / stale).symlink_to(victim)
    assert records.load() == [] and sorted(os.listdir(service)) == []  # removed, not followed
    records.write(data)
    assert [r.container_id for r in records.load()] == ["a"] and victim.read_text() == "ROOT SECRET\n"
    moved = tmp_path / "elsewhere"
    moved.mkdir(mode=0o700)
    os.rename(service, tmp_path / "work" / "old")
    (tmp_path / "work" / "service").symlink_to(moved)
    with pytest.raises(RecordsError, match="a symbolic link is never followed"):
        records.write(data)
    assert os.listdir(moved) == []


def test_records_round_trip_and_a_file_it_cannot_read_is_never_read_as_empty(tmp_path: Path) -> None:
    """SPEC R-SH-3: an unreadable records file is one ``UnreadableFile`` naming it and why (the recovery then
    moves it aside and rebuilds from the kernel: tests/upgrades/test_upgrade_serve.py)."""
    path = tmp_path / "service" / "containers.json"
    records = RecordsFile(str(path), "/sys/fs/cgroup/devices/root")
    assert records.load() == []
    saved = [ContainerRecord(container_id="b", command=["python", "x.py"], client="c@127.0.0.1:1", uid=0,
                             user="root", pid=42, since=1.5),
             ContainerRecord(container_id="a", recovered=True)]
    records.write(records.encode(saved))
    assert json.loads(path.read_bytes())["version"] == 1
    assert [r.container_id for r in records.load()] == ["a", "b"] and records.load()[1] == saved[0]
    assert not (tmp_path / "service" / "containers.json.tmp").exists()
    for content, reason in ((b"", "the file is empty"), (b"{not json", "it is not a JSON object: truncated"),
                            (json.dumps({"version": 9, "root": "x", "containers": []}).encode(),
                             "it is in format version 9, and this release reads versions 1 (a later release"),
                            (json.dumps({"root": "x", "containers": []}).encode(),
                             "it is in format version 0, and this release reads versions 1")):
        path.write_bytes(content)
        with pytest.raises(UnreadableFile) as caught:
            records.load()
        assert caught.value.path == str(path) and caught.value.reason.startswith(reason)
    path.write_bytes(records.encode(saved))
    with pytest.raises(UnreadableFile, match="it holds the records of the cgroups root '/sys/fs/cgroup/devices/root',"
                                             " not of '/elsewhere'"):
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
    (["serve", "--listen", "127.0.0.1:99999", "--device_backend=memory"],
     "gpu-isolator serve: error: Invalid address '127.0.0.1:99999'"),
    (["serve", "--max_connections_per_user=0", "--device_backend=memory"], "expected a whole number >= 1, got '0'"),
    (["exec", "--agent", "127.0.0.1:5052", "--gpus", "1", "--", "true"], "unrecognized arguments: --agent"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv: list[str], text: str, capsys: pytest.CaptureFixture) -> None:
    from isolators.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err


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


def test_the_status_table_shows_other_users_only_as_counts() -> None:
    """R-SC-5: what a user who is not root reads of others."""
    state = ServiceState(
        containers={"exec-1": ContainerView(gpus=[0], command=["python", "mine.py"], user="alice", uid=1001, pid=12,
                                            since=1000.0, state="running")},
        free=[3], unhealthy={}, total=[0, 1, 2, 3], backend="cgroups_v2", address="gpu-isolator",
        socket="/run/gpu-isolator/gpu-isolator.sock",
        others={"bob": UserShare(gpus=2, waiting=1), "carol": UserShare(mig_devices=1)})
    assert render_state(state, now=1100.0).splitlines()[:5] == [
        "/run/gpu-isolator/gpu-isolator.sock: cgroups_v2, 4 GPU(s): 1 free, 0 unhealthy, 1 container(s), 0 waiting",
        "CONTAINER  GPUS  USER   PID  STATE    AGE    COMMAND",
        "exec-1     0     alice  12   running  1m40s  python mine.py",
        "other users:    bob 2 GPU(s), 1 waiting, carol 0 GPU(s) 1 MIG device(s)",
        "free GPUs:      3",
    ]
