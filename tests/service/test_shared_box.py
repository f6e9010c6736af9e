"""The shared GPU box, secured (SPEC section 19, R-SC-1..8; issue 25): real
throwaway user accounts against the real service process, judged by the
real kernel (cgroups v1 and v2), every wait bounded.

One service per backend serves the whole module (each test leaves it
empty): ``--confine`` of a test cgroup that stands for ``user.slice`` (each
user's "session" is a cgroup below it), ``--max_gpus_per_user=3``,
``--max_waiting_per_user=2``, ``--max_connections_per_user=4``,
``--idle_timeout=2``, TCP on loopback with a bearer credential. Alice and
Bob are users; Mallory attacks, with ``tests.support.attacker`` and the
C tools of ``tests/native``. Each test names the finding of issue 25 it
answers; tests whose kernel side does not differ between v1 and v2 run on
v2 only."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import time
import uuid
from typing import Any, Iterator

import pytest

from isolators.service._host import cgroup_of
from tests.service.conftest import SECRET
from tests.support.kernel import (KERNEL_BACKENDS, attached_programs, detach_programs, hierarchy_of,
                                  remove_test_cgroups, skip_reason, wait_gone)
from tests.support.nodes import TEST_ROOT_PREFIX, Node
from tests.support.probes import DENIED, GRANTED, verdict
from tests.support.services import ServeProcess, ask, native_tool, tcp_message
from tests.support.users import ThrowawayUser, throwaway_group, throwaway_users

ALL = [0, 1, 2, 3]
V2_ONLY = pytest.mark.parametrize("box", [KERNEL_BACKENDS[-1]], indirect=True)
OWNER_TEXT = "Container '{}' belongs to another user"


class People:
    def __init__(self, alice: ThrowawayUser, bob: ThrowawayUser, mallory: ThrowawayUser, group: str) -> None:
        self.alice, self.bob, self.mallory, self.group = alice, bob, mallory, group


@pytest.fixture(scope="module")
def people() -> Iterator[People]:
    with throwaway_group() as group, throwaway_users(3) as (alice, bob, mallory):
        alice.join(group)
        yield People(alice, bob, mallory, group)


class Box:
    """The module's service, its confined "user.slice" and the users' sessions in it."""

    def __init__(self, service: ServeProcess, hierarchy: str, users: str) -> None:
        self.service = service
        self.hierarchy = hierarchy
        self.users = users
        self.backend = service.node.backend

    def session(self, user: ThrowawayUser) -> str:
        """The ``cgroup.procs`` of ``user``'s session, below the confined cgroup."""
        directory = os.path.join(self.hierarchy, self.users, f"session-{user.name}")
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, "cgroup.procs")

    def container_line(self, probe: dict[str, Any]) -> str:
        for line in probe["cgroup"].splitlines():
            number, controllers, path = line.split(":", 2)
            if (self.backend == "cgroups_v1" and "devices" in controllers.split(",")) or (
                    self.backend == "cgroups_v2" and number == "0"):
                return path
        raise AssertionError(f"no {self.backend} line in {probe['cgroup']!r}")

    def controller(self) -> str:
        return "devices" if self.backend == "cgroups_v1" else ""


@pytest.fixture(scope="module", params=KERNEL_BACKENDS)
def box(request: pytest.FixtureRequest, tmp_path_factory: Any, people: People) -> Iterator[Box]:
    backend = request.param
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    hierarchy = hierarchy_of(backend)
    users = f"{TEST_ROOT_PREFIX}users-{uuid.uuid4().hex[:8]}"  # stands for user.slice
    os.makedirs(os.path.join(hierarchy, users))
    directory = tmp_path_factory.mktemp(f"box-{backend}")
    node = Node(directory / "node", backend, 4, root_prefix=TEST_ROOT_PREFIX)
    service = ServeProcess(node, directory, listen="127.0.0.1:0", credential=SECRET, confine=(users,),
                           options=("--max_gpus_per_user=3", "--max_waiting_per_user=2",
                                    "--max_connections_per_user=4", "--idle_timeout=2"))
    try:
        yield Box(service.start(), hierarchy, users)
    finally:
        try:
            service.close()
        finally:
            try:
                node.teardown()
            finally:
                remove_test_cgroups(os.path.join(hierarchy, users), backend == "cgroups_v2")


def attack(user: ThrowawayUser, *args: str, stdin: Any = subprocess.DEVNULL, timeout: float = 60.0) -> Any:
    """``tests.support.attacker ARGS`` as ``user``: its JSON line."""
    process = user.popen("tests.support.attacker", *args, stdin=stdin, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err.decode()
    return json.loads(out.splitlines()[-1])


def asks(user: ThrowawayUser, box: Box, verb: str, body: dict[str, Any]) -> Any:
    return attack(user, "ask", box.service.socket, verb, json.dumps(body))


def reopen(process: subprocess.Popen, path: str) -> str:
    """The verdict on opening ``path`` again from a running ``exec_probe --serve``."""
    process.stdin.write(path.encode() + b"\n")
    process.stdin.flush()
    line = process.stdout.readline()
    assert line, f"the probe is gone: {process.stderr.read().decode() if process.poll() is not None else ''}"
    return verdict(int(line))


def expected(gpu_nodes: dict[int, str], granted: set[int]) -> dict[str, str]:
    wanted = {gpu_nodes[m]: GRANTED if m in granted else DENIED for m in ALL}
    wanted[gpu_nodes[255]] = GRANTED
    return wanted


def wait_until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not so within {timeout}s"
        time.sleep(0.05)


def undo_v1_confinement(*cgroups: str) -> bool:
    """Allow GPU 0 again on each v1 cgroup, parent first; False when the
    service denied the parent again before the child's write (EPERM)."""
    try:
        for directory in cgroups:
            with open(os.path.join(directory, "devices.allow"), "w") as allow:
                allow.write(f"c 195:{ALL[0]} rwm")
    except PermissionError:
        return False
    return True


def finish_empty(box: Box) -> None:
    box.service.wait_state(lambda s: not s["containers"] and not s["waiting"] and s["free"] == ALL)


# -- the command, as its user ------------------------------------------------------------------------------
def test_a_users_command_runs_as_them_in_its_cgroup_from_the_start_unable_to_gain_privileges(
        box: Box, people: People, gpu_nodes: dict[int, str]) -> None:
    """Must-show: ``exec --gpus 1`` started by the service runs with the
    caller's uid, gid and groups, ``NoNewPrivs: 1``, born inside the
    container's cgroup (its parent, the supervisor, forked it from there),
    opens its GPU and gets EPERM on every other; a setuid-root program in
    it stays the caller."""
    service, alice = box.service, people.alice
    setuid_id = os.path.join(os.path.dirname(native_tool("exec_probe")), "id-setuid")
    shutil.copy("/usr/bin/id", setuid_id)
    os.chmod(setuid_id, 0o4755)
    control = subprocess.run([setuid_id, "-u"], user=alice.uid, capture_output=True, text=True, check=True)
    assert control.stdout.strip() == "0"  # outside exec the kernel honours setuid here
    client = service.probe(*sorted(gpu_nodes.values()), gpus=1, hold=True, user=alice,
                           cwd=os.path.dirname(setuid_id))
    probe = service.probe_result(client)
    (name, view), = service.state_naming(probe)["containers"].items()
    assert (view["uid"], view["user"], view["state"]) == (alice.uid, alice.name, "running")
    assert (probe["uid"], probe["euid"], probe["gid"]) == (alice.uid, alice.uid, alice.gid)
    assert probe["Uid"].split() == [str(alice.uid)] * 4
    assert set(probe["groups"]) == set(alice.groups) and len(alice.groups) == 2  # her own and the joined one
    assert probe["NoNewPrivs"] == "1"
    assert probe["cwd"] == os.path.dirname(setuid_id)  # the client's directory, entered as her
    suffix = f"/{service.node.cgroups_root}/{name}"
    assert box.container_line(probe).endswith(suffix)
    assert cgroup_of(probe["ppid"], box.controller()).endswith(suffix)  # forked from inside the cgroup
    with open(f"/proc/{probe['ppid']}/status") as status:
        assert next(line for line in status if line.startswith("Uid:")).split()[1:] == ["0"] * 4  # root's
    assert probe["access"] == expected(gpu_nodes, set(view["gpus"]))
    client.stdin.close()
    assert service.finish(client)[0] == 0
    code, out, err = service.finish(service.exec(setuid_id, "-u", gpus=0, user=alice,
                                                 cwd=os.path.dirname(setuid_id)))
    assert (code, out.strip()) == (0, str(alice.uid)), err  # NO_NEW_PRIVS: setuid gains nothing
    finish_empty(box)


# -- finding 1: identity ------------------------------------------------------------------------------------
@V2_ONLY
def test_identity_comes_from_the_kernel_and_no_request_moves_a_process(box: Box, people: People,
                                                                        gpu_nodes: dict[int, str]) -> None:
    """Finding 1: nothing a request says makes Mallory someone else; there is
    no request that moves a process (the old ``start``); over TCP, without
    the credential, a forged sender gets 401 and no answer."""
    service, mallory = box.service, people.mallory
    job = service.probe(gpus=1, serve=True, user=people.alice)  # Alice's job, opening on request
    job_probe = service.probe_result(job)
    (name, view), = service.state_naming(job_probe)["containers"].items()
    mine = gpu_nodes[view["gpus"][0]]
    assert reopen(job, mine) == GRANTED
    forged = asks(mallory, box, "prepare", {"container_id": "evil", "gpus": 0, "command": ["true"], "cwd": "/",
                                            "uid": 0, "user": "root", "client": "x@127.0.0.1:1",
                                            "pid": job_probe["pid"]})
    assert forged["body"]["error"] == "Container evil: the command's stdin, stdout and stderr come with the request" \
                                      " (3 descriptors; got 0)"
    assert asks(mallory, box, "start", {"container_id": name, "token": "0" * 32, "pid": job_probe["pid"]}) == {
        "refused": "not a request the service takes: unknown request 'start' (expected one of cleanup, prepare,"
                   " state, update, usage)"}
    code, _, _ = service.finish(service.exec("true", gpus=0, user=mallory))
    assert code == 0
    with socket.socket() as root_listener:  # what finding 1 stood beside: a root listener
        root_listener.bind(("127.0.0.1", 0))
        root_listener.listen()
        root_listener.setblocking(False)
        sender = f"evil@127.0.0.1:{root_listener.getsockname()[1]}"
        for message, body in (("prepare", {"request": "p", "container_id": "evil", "gpus": 0, "command": ["x"]}),
                              ("start", {"request": "s", "container_id": "evil", "token": "t",
                                         "pid": job_probe["pid"]})):
            assert tcp_message(service, message, body, sender)[0] == 401
        assert tcp_message(service, "usage", {"request": "u", "container_id": "nobody"}, "agent@127.0.0.1:1",
                           SECRET)[0] == 202  # answered after the forged ones, had they been answered at all
        with pytest.raises(BlockingIOError):
            root_listener.accept()  # the service never connected to the address they named
    state = service.state()
    assert list(state["containers"]) == [name] and state["containers"][name]["uid"] == people.alice.uid
    assert cgroup_of(job_probe["pid"], box.controller()).endswith(f"/{name}")  # never moved
    assert reopen(job, mine) == GRANTED
    job.stdin.close()
    assert service.finish(job)[0] == 0
    finish_empty(box)


# -- finding 2: owners --------------------------------------------------------------------------------------
@V2_ONLY
def test_no_user_touches_another_users_container_or_waiting_request(box: Box, people: People,
                                                                    gpu_nodes: dict[int, str]) -> None:
    """Finding 2: Mallory cannot cancel, resize, free or read Alice's
    containers or root's, nor kill her execs between grant and start."""
    service, alice, mallory = box.service, people.alice, people.mallory
    assert ask(service, "prepare", container_id="agent-job", gpus=2)["error"] is None  # root's (no command)
    job = service.probe(gpus=1, serve=True, user=alice)
    job_probe = service.probe_result(job)
    state = service.state_naming(job_probe)
    name = next(n for n, v in state["containers"].items() if v["pid"] == job_probe["pid"])
    waiting = service.probe(gpus=2, wait=True, hold=True, user=alice)  # 1 held + 2 asked: within her limit of 3
    state = service.wait_state(lambda s: len(s["waiting"]) == 1)
    waiting_name = state["waiting"][0]["container_id"]
    before = service.metrics()["service_refused_by_owner_total"]
    for target in (name, "agent-job", waiting_name):
        for verb, body in (("cleanup", {}), ("update", {"gpus": 0}), ("usage", {})):
            answer = asks(mallory, box, verb, {"container_id": target, **body})["body"]
            assert answer["error"] == OWNER_TEXT.format(target) or (
                target == waiting_name and verb != "cleanup" and answer["error"] == "Unknown container"), answer
    assert service.metrics()["service_refused_by_owner_total"] >= before + 7
    after = service.state()
    assert after["containers"] == state["containers"] and after["waiting"] == state["waiting"]  # nothing changed
    assert reopen(job, gpu_nodes[state["containers"][name]["gpus"][0]]) == GRANTED
    assert ask(service, "cleanup", container_id="agent-job")["released"]  # root may
    job.stdin.close()
    assert service.finish(job)[0] == 0
    got = service.probe_result(waiting)
    waiting.stdin.close()
    assert service.finish(waiting)[0] == 0 and got["uid"] == alice.uid

    stop = os.path.join(service.public, "stop-the-race")
    race = mallory.popen("tests.support.attacker", "race", service.socket, stop, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        codes = [service.finish(service.exec("true", gpus=1, user=alice))[0] for _ in range(6)]
    finally:
        open(stop, "w").close()
        out, err = race.communicate(timeout=60)
    assert codes == [0] * 6  # before: 4 of 6 failed with 125
    refused = json.loads(out)["refused"]
    assert set(refused) <= {OWNER_TEXT.format("ID"), "ok", "Unknown container"}, refused  # vanished ones: "ok"
    finish_empty(box)


# -- finding 3: hoarding ------------------------------------------------------------------------------------
@V2_ONLY
def test_no_user_hoards_the_gpus(box: Box, people: People) -> None:
    """Finding 3: a container without a command is root's alone, TCP needs the
    credential, and --max_gpus_per_user bounds what a user's commands hold;
    a command's GPUs go with it."""
    service, mallory = box.service, people.mallory
    hoard = asks(mallory, box, "prepare", {"container_id": "hoard", "gpus": 4})["body"]
    assert hoard["error"] == ("Only root prepares a container without a command (as an agent does): run the command"
                              " with 'gpu-isolator exec', which holds its GPUs while it runs")
    assert tcp_message(service, "prepare", {"request": "h", "container_id": "hoard", "gpus": 4},
                       "nobody@127.0.0.1:1")[0] == 401
    assert service.state()["free"] == ALL
    code, _, err = service.finish(service.exec("true", gpus=4, user=mallory))
    assert (code, err) == (125, f"gpu-isolator exec: error: User '{mallory.name}' holds 0 GPU(s); 4 more would exceed"
                                " --max_gpus_per_user=3\n")
    held = service.probe(gpus=2, hold=True, user=mallory)
    held_probe = service.probe_result(held)
    code, _, err = service.finish(service.exec("true", gpus=2, user=mallory))
    assert (code, err) == (125, f"gpu-isolator exec: error: User '{mallory.name}' holds 2 GPU(s); 2 more would exceed"
                                " --max_gpus_per_user=3\n")
    assert service.finish(service.exec("true", gpus=2, user=people.alice))[0] == 0  # the others stay hers
    held.kill()  # his client goes: his command goes with it, and its GPUs
    held.wait()
    assert wait_gone(held_probe["pid"])
    finish_empty(box)


# -- findings 4 and 5: one user's connections cost only that user -----------------------------------------
@V2_ONLY
def test_bad_frames_stalls_and_waiting_requests_cost_only_their_own_connection(box: Box, people: People) -> None:
    """Finding 4 (and R-SC-4): bad frames, an unfinished frame and a forged
    huge sender close or refuse Mallory alone; Alice's waiting request keeps
    its place and is served."""
    service, alice, mallory = box.service, people.alice, people.mallory
    assert ask(service, "prepare", container_id="root-holds", gpus=4)["error"] is None
    alice_waits = service.exec("true", gpus=1, wait=True, user=alice)
    service.wait_state(lambda s: [w["uid"] for w in s["waiting"]] == [alice.uid])
    answers = attack(mallory, "frames", service.socket)
    assert [(a["case"], a["verb"]) for a in answers] == [
        ("over the limit", "error"), ("not JSON", "error"), ("fds with state", "error"),
        ("a 9000-character id", "prepared")]
    assert answers[0]["error"] == f"not a request the service takes: a frame length of {(1 << 20) + 1} bytes (1 to" \
                                  f" {1 << 20})"
    assert answers[3]["error"] == f"Invalid container id {'A' * 32!r}...: it is 9000 characters long, the limit is 242"
    stalled = attack(mallory, "stall", service.socket)
    assert stalled == {"verb": "error", "error": "closed after 2 s of a frame it did not finish (idle connections are"
                                                  " closed)"}
    assert tcp_message(service, "usage", {"request": "u", "container_id": "x"}, "A" * 9000 + "@127.0.0.1:1")[0] \
        in (400, 401, 431)
    assert [w["uid"] for w in service.state()["waiting"]] == [alice.uid]  # still there, still first
    shown = service.status(user=alice)
    assert shown.returncode == 0 and "waiting (first come, first served):" in shown.stdout
    assert ask(service, "cleanup", container_id="root-holds")["released"]
    assert service.finish(alice_waits)[0] == 0
    finish_empty(box)


@V2_ONLY
def test_one_users_waiting_quota_and_idle_connections_never_lock_another_out(box: Box, people: People) -> None:
    """Finding 5 (and R-SC-4): Mallory's connections beyond
    --max_connections_per_user are refused, his idle ones closed after the
    idle timeout, his waiting requests beyond --max_waiting_per_user
    refused; his 256 idle TCP connections do not reach the socket; Alice's
    exec and status go on throughout."""
    service, alice, mallory = box.service, people.alice, people.mallory
    assert ask(service, "prepare", container_id="root-holds", gpus=4)["error"] is None
    queued = [service.exec("true", gpus=1, wait=True, user=mallory) for _ in range(2)]
    service.wait_state(lambda s: len(s["waiting"]) == 2)
    code, _, err = service.finish(service.exec("true", gpus=1, wait=True, user=mallory))
    assert (code, err.splitlines()[-1]) == (125, f"gpu-isolator exec: error: User '{mallory.name}' has 2 requests"
                                                 " waiting for GPUs already (--max_waiting_per_user=2): wait for"
                                                 " them, or cancel one")
    for process in queued:
        process.kill()
        process.wait()
    service.wait_state(lambda s: not s["waiting"])
    assert ask(service, "cleanup", container_id="root-holds")["released"]

    idle_before = service.metrics()["service_connections_idle_total"]
    holder = mallory.popen("tests.support.attacker", "hold", service.socket, "6", stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        held = json.loads(holder.stdout.readline())
        assert held["answered"] == 4 and held["refused"] == [
            f"too many connections of uid {mallory.uid}: 4 are open (--max_connections_per_user); close some"] * 2
        assert service.finish(service.exec("true", gpus=1, user=alice))[0] == 0
        assert service.status(user=alice).returncode == 0
        assert service.status(user=people.bob).returncode == 0
        wait_until(lambda: service.metrics()["service_connections_idle_total"] >= idle_before + 4)
    finally:
        out, err = holder.communicate(b"", timeout=30)
    assert json.loads(out.splitlines()[-1]) == {"closed_by_service": 4}, err

    tcp = mallory.popen("tests.support.attacker", "tcp-hold", *service.address.rsplit(":", 1), "256",
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert json.loads(tcp.stdout.readline()) == {"held": 256}  # every TCP slot of 127.0.0.1
        assert service.finish(service.exec("true", gpus=1, user=alice))[0] == 0  # the socket does not care
        assert service.status(user=alice).returncode == 0
    finally:
        tcp.communicate(b"", timeout=30)
    finish_empty(box)


# -- finding 6: deny by default ---------------------------------------------------------------------------
@pytest.mark.skipif(platform.machine() != "x86_64", reason="tests/native/ptrace_open.c borrows an x86-64 syscall")
def test_a_confined_session_opens_no_gpu_and_a_command_gains_nothing_by_ptracing_it(
        box: Box, people: People, gpu_nodes: dict[int, str]) -> None:
    """Finding 6 (R-SC-8): a process in Mallory's session -- a cgroup below
    the --confine'd one -- gets EPERM on every GPU, again after someone
    undid the confinement (the service checks it every tick); his exec'd command,
    ptracing his exec client there, makes it open the GPUs -- EPERM too --
    and cannot ptrace its root supervisor at all."""
    service, mallory = box.service, people.mallory
    gpus = [gpu_nodes[m] for m in ALL]
    shell = subprocess.Popen([native_tool("exec_probe"), "--serve"], user=mallory.uid, group=mallory.gid,
                             extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        shell.stdout.readline()
        with open(box.session(mallory), "w") as procs:
            procs.write(str(shell.pid))  # his login shell's session
        assert [reopen(shell, path) for path in gpus] == [DENIED] * 4
        assert reopen(shell, "/dev/null") == GRANTED  # every other device kept
        confined = os.path.join(box.hierarchy, box.users)
        if box.backend == "cgroups_v2":  # someone takes the confinement away ...
            assert detach_programs(confined)
            wait_until(lambda: len(attached_programs(confined)) == 1)  # ... and the next tick puts it back
        else:  # v1: the confined cgroup and the session, as a root who allows the GPU again would
            wait_until(lambda: undo_v1_confinement(confined, os.path.dirname(box.session(mallory))))
        wait_until(lambda: reopen(shell, gpus[0]) == DENIED)  # denied again: only the service's tick did that
    finally:
        shell.kill()
        shell.wait()
    ptrace = native_tool("ptrace_open")
    script = f"read client; {ptrace} $client {' '.join(gpus)}; {ptrace} $PPID {gpus[0]}"
    client = mallory.cli("exec", f"--socket={service.socket}", "--gpus", "1", "--", "sh", "-c", script,
                         cgroup=box.session(mallory), cwd=service.public, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    service.children.append(client)
    out, err = client.communicate(f"{client.pid}\n".encode(), timeout=60)
    lines = out.decode().splitlines()
    assert [line.split()[1] for line in lines[:4]] == ["1"] * 4, (lines, err)  # EPERM: the client's cgroup judges
    assert lines[4:] == ["attach 1"], lines  # its supervisor is root's: EPERM
    assert client.returncode == 1  # that last ptrace_open's status, the command's
    finish_empty(box)


# -- finding 7: what a user reads, who the service connects to, ids -------------------------------------
@V2_ONLY
def test_a_user_reads_other_users_only_as_counts(box: Box, people: People) -> None:
    """Finding 7 (R-SC-5): no command line, pid or id of another user's."""
    service, alice, mallory = box.service, people.alice, people.mallory
    secret_job = service.exec("sh", "-c", "echo up; read line || :", "job", "--secret-token=hunter2", gpus=1,
                              user=alice)
    assert secret_job.stdout.readline() == b"up\n"
    state = service.state()
    (name, view), = state["containers"].items()
    assert "--secret-token=hunter2" in view["command"]  # root reads everything
    seen = service.status("--json", user=mallory)
    assert seen.returncode == 0, seen.stderr
    document = json.loads(seen.stdout)
    assert document["containers"] == {} and document["waiting"] == []
    assert document["others"] == {alice.name: {"gpus": 1, "mig_devices": 0, "waiting": 0}}
    for secret in ("hunter2", name, str(view["pid"])):
        assert secret not in seen.stdout
    table = service.status(user=mallory).stdout
    assert f"other users:    {alice.name} 1 GPU(s)" in table and "hunter2" not in table
    own = json.loads(service.status("--json", user=alice).stdout)
    assert list(own["containers"]) == [name] and own["containers"][name]["command"] == view["command"]
    secret_job.stdin.close()
    assert service.finish(secret_job)[0] == 0
    bidi = asks(mallory, box, "prepare", {"container_id": "exec-\u202egpjexe", "gpus": 0, "command": ["true"],
                                          "cwd": "/"})
    assert bidi["body"]["error"] == ("Invalid container id 'exec-\\u202egpjexe': only printable ASCII letters, digits"
                                     " and punctuation (no spaces, control or bidirectional characters)")
    finish_empty(box)


def test_serve_refuses_a_work_dir_a_user_could_replace_and_follows_no_link(serve_factory, people: People,
                                                                          tmp_path) -> None:
    """Finding 7 (R-SC-7): a work dir Mallory owns, or below a directory he
    may write, stops ``serve`` before it touches anything, naming the path;
    the links he planted for the records and the lock are never followed."""
    mallory = people.mallory
    secrets = [tmp_path / "root-only-1", tmp_path / "root-only-2"]
    for secret in secrets:
        secret.write_text("ROOT SECRET\n")
        os.chmod(secret, 0o600)
    work = tmp_path / "mallorys-work"
    (work / "service").mkdir(parents=True)
    (work / "service" / "containers.json.tmp").symlink_to(secrets[0])
    (work / "agent.lock").symlink_to(secrets[1])
    for path in (work, work / "service", work / "service" / "containers.json.tmp", work / "agent.lock"):
        os.lchown(path, mallory.uid, mallory.gid)
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    for work_dir, text in ((work, f"The work directory {work} is not safe: {work} is owned by uid {mallory.uid},"
                                  f" not root (chown root {work})"),
                           (open_parent / "work", f"The work directory {open_parent}/work is not safe: {open_parent}"
                                                  " has mode 0777, writable by others")):
        service = serve_factory("memory", work_dir=str(work_dir))
        process = subprocess.run(service.command(), capture_output=True, text=True, timeout=60)
        assert process.returncode == 2 and text in process.stderr, process.stderr
        assert not os.path.exists(service.socket)
    assert [secret.read_text() for secret in secrets] == ["ROOT SECRET\n"] * 2


def test_the_socket_is_the_front_door_only_for_its_group(people: People, tmp_path) -> None:
    """R-SC-1: --socket_group makes the socket 0660 for root and that group;
    the kernel keeps everyone else out before the service sees them."""
    group = people.group  # Alice is in it, Bob is not
    directory = tmp_path / "grouped"
    directory.mkdir()
    node = Node(directory / "node", "memory", 2, root_prefix=TEST_ROOT_PREFIX)
    service = ServeProcess(node, directory, options=(f"--socket_group={group}",))
    try:
        service.start()
        info = os.stat(service.socket)
        assert (oct(info.st_mode & 0o777), info.st_uid) == ("0o660", 0)
        assert service.status(user=people.alice).returncode == 0
        refused = service.status(user=people.bob)
        assert refused.returncode == 2 and "Permission denied" in refused.stderr
    finally:
        service.close()
        node.teardown()


def test_signals_reach_the_users_command_and_a_withdrawn_request_leaves(box: Box, people: People) -> None:
    """exec's experience as a user: SIGTERM to the client reaches the command
    (started by the service), its status comes back; a signal before the
    command starts withdraws the request."""
    service, alice = box.service, people.alice
    trapped = service.exec("sh", "-c", "trap 'echo got TERM; exit 42' TERM; echo ready; while :; do sleep 0.05; done",
                           gpus=1, user=alice)
    assert trapped.stdout.readline() == b"ready\n"
    trapped.send_signal(signal.SIGTERM)
    assert service.finish(trapped)[:2] == (42, "got TERM\n")
    assert ask(service, "prepare", container_id="root-holds", gpus=4)["error"] is None
    waiting = service.exec("true", gpus=1, wait=True, user=alice)
    service.wait_state(lambda s: len(s["waiting"]) == 1)
    waiting.send_signal(signal.SIGINT)
    code, _, err = service.finish(waiting)
    assert code == 128 + signal.SIGINT and "SIGINT before the command started: request withdrawn" in err
    service.wait_state(lambda s: not s["waiting"])
    assert ask(service, "cleanup", container_id="root-holds")["released"]
    finish_empty(box)
