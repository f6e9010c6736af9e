"""Fencing the device worker of an agent that died (issue 20, item 3).

An agent (here: a subprocess running device control with a worker
process) is SIGKILLed while its worker is SIGSTOPped in the middle of a
batch. The worker must die with its agent, and a new agent must not start
until nothing of the old one can still touch the kernel: then, after
SIGCONT, the stale worker applies nothing (no cgroup created or removed,
no device rule or program changed). The work directory's lock says who holds
it when a second agent cannot start. A worker stopped before it even asked
for the parent-death signal (which the kernel then never sends) is fenced
by its own parent check once continued. Judged by the kernel; every wait is
bounded.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import pytest

from actors.devices import DeviceControl, DeviceControlError, bpf, container_policy
from runtime import Runtime, collect
from tests.support.kernel import process_state, wait_gone

AGENT = r"""
import json, os, sys
import anyio
from runtime import Runtime
from actors.devices import DeviceControl, container_policy

async def main(backend, hierarchy, cgroups_root, work_dir, count):
    async with Runtime():
        control = await DeviceControl.create(backend, hierarchy=hierarchy, cgroups_root=cgroups_root,
                                             work_dir=work_dir, worker="process")
        policy = container_policy([], ["c 195:0 rwm"])
        await control.configure("first", *policy)
        print(json.dumps({"agent": os.getpid(), "worker": control.worker_pid}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        calls = [control.configure(f"c{i}", *policy) for i in range(count)]
        calls += [control.remove("first")]
        calls += [control.configure(f"d{i}", *policy) for i in range(count)]
        await anyio.sleep(3600)

anyio.run(main, *sys.argv[1:5], int(sys.argv[5]))
"""


def read_line(process: subprocess.Popen, timeout: float = 30.0) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "the agent did not answer in time"
    return process.stdout.readline()


def cgroups(root: str) -> set[str]:
    return {name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name))}


def device_rules(root: str) -> dict[str, Any]:
    """What the kernel holds for each cgroup: v1 its devices.list, v2 its programs' ids."""
    held: dict[str, Any] = {}
    for name in cgroups(root):
        path = os.path.join(root, name)
        if os.path.exists(os.path.join(path, "devices.list")):
            with open(os.path.join(path, "devices.list")) as handle:
                held[name] = handle.read()
        else:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                held[name] = bpf.prog_query(fd)[1]
            finally:
                os.close(fd)
    return held


@pytest.mark.asyncio
async def test_a_stale_worker_of_a_killed_agent_applies_nothing_after_a_new_agent_started(kernel, sandbox, tmp_path):
    backend = "cgroups_v1" if kernel == "v1" else "cgroups_v2"
    work_dir = str(tmp_path / "work")
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, backend, sandbox.hierarchy, sandbox.cgroups_root, work_dir, "3000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    stale = None
    try:
        pids = json.loads(read_line(agent))
        stale = pids["worker"]
        assert stale and stale != agent.pid
        agent.stdin.write("go\n")
        agent.stdin.flush()
        deadline = time.monotonic() + 30
        while len(cgroups(sandbox.root)) < 3:  # the batch is being applied
            assert time.monotonic() < deadline, "the agent's worker applied nothing"
            time.sleep(0.001)
        os.kill(stale, signal.SIGSTOP)  # stalled mid-batch (a slow rmdir, an fsync ...)
        agent.kill()
        agent.wait(timeout=10)
        # the worker dies with its agent; the new agent waits until it has
        assert wait_gone(stale), "the worker outlived its agent"
        async with Runtime():
            with anyio.fail_after(30):
                control = await DeviceControl.create(backend, hierarchy=sandbox.hierarchy,
                                                     cgroups_root=sandbox.cgroups_root, work_dir=work_dir,
                                                     worker="process")
            before = cgroups(sandbox.root)
            rules = device_rules(sandbox.root)
            try:
                os.kill(stale, signal.SIGCONT)
            except ProcessLookupError:
                pass
            time.sleep(1.0)  # a stale worker would go on with its batch now
            assert cgroups(sandbox.root) == before, "cgroups changed after the new agent started"
            assert device_rules(sandbox.root) == rules, "device rules changed after the new agent started"
            assert "first" in before  # its remove was never applied
            with anyio.fail_after(60):
                assert all(await collect([control.remove(name) for name in sorted(before)]))
            await control.close()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
        if stale is not None and process_state(stale) not in (None, "Z"):
            os.kill(stale, signal.SIGKILL)
            wait_gone(stale)


@pytest.mark.asyncio
async def test_a_second_agent_waits_for_the_work_dir_lock_then_refuses_naming_the_holder(kernel, sandbox, tmp_path):
    backend = "cgroups_v1" if kernel == "v1" else "cgroups_v2"
    work_dir = str(tmp_path / "work")
    kwargs: dict[str, Any] = dict(hierarchy=sandbox.hierarchy, cgroups_root=sandbox.cgroups_root,
                                  work_dir=work_dir, worker="process")
    async with Runtime():
        first = await DeviceControl.create(backend, **kwargs)
        started = time.monotonic()
        with anyio.fail_after(30):
            with pytest.raises(DeviceControlError) as refused:
                await DeviceControl.create(backend, lock_timeout=0.5, **kwargs)
        assert time.monotonic() - started >= 0.5  # it waited before refusing
        message = str(refused.value)
        assert f"work directory {work_dir}" in message
        assert f"process {os.getpid()}" in message and f"device worker process {first.worker_pid}" in message
        assert "another agent" in message.lower()
        # a waiting agent starts once the holder has gone
        second = anyio.Event()

        async def close_first() -> None:
            await anyio.sleep(0.3)
            await first.close()
            second.set()

        async with anyio.create_task_group() as group:
            group.start_soon(close_first)
            with anyio.fail_after(30):
                control = await DeviceControl.create(backend, lock_timeout=20, **kwargs)
        assert second.is_set()
        assert await control.configure("c1", *container_policy([], [])) is not None
        assert await control.remove("c1") is True
        await control.close()


AGENT_WITH_A_WORKER_STOPPED_AT_BIRTH = r"""
import sys
import anyio
from runtime import Runtime
from actors.devices import DeviceControl, _worker

# The worker stops itself before it asks for the parent-death signal.
_worker.BOOT = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP); " + _worker.BOOT

async def main(backend, hierarchy, cgroups_root, work_dir):
    async with Runtime():
        await DeviceControl.create(backend, hierarchy=hierarchy, cgroups_root=cgroups_root, work_dir=work_dir,
                                   worker="process")

anyio.run(main, *sys.argv[1:5])
"""

SUPERVISOR = r"""
import ctypes, json, os, signal, subprocess, sys, time

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None

def child_worker(parent):
    for name in os.listdir("/proc"):
        fields = stat(name) if name.isdigit() else None
        if fields and int(fields[1]) == parent:
            try:
                with open(f"/proc/{name}/cmdline", "rb") as cmdline:
                    if b"_worker_child" in cmdline.read():
                        return int(name)
            except OSError:
                pass
    return None

assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: the agent's orphans come here
agent = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]])
deadline = time.monotonic() + 30
worker = None
while worker is None or stat(worker)[0] not in ("T", "t"):
    assert time.monotonic() < deadline, "the agent's worker did not start and stop"
    worker = worker or child_worker(agent.pid)
    time.sleep(0.01)
agent.kill()
agent.wait()
reparented = int(stat(worker)[1]) == os.getpid()
os.kill(worker, signal.SIGCONT)
while True:
    pid, status = os.waitpid(worker, os.WNOHANG)
    if pid:
        break
    assert time.monotonic() < deadline + 30, "the worker did not exit once continued"
    time.sleep(0.01)
print(json.dumps({"worker": worker, "reparented": reparented, "exit": os.waitstatus_to_exitcode(status)}))
"""


def test_a_worker_stopped_before_asking_for_the_parent_death_signal_is_fenced_by_its_parent_check(
    kernel, sandbox, tmp_path
):
    """The kernel sends no parent-death signal to a worker that asked for it
    only after its agent died: its first parent check must exit it (status
    FENCED_EXIT) before it builds a backend or says it is ready. A
    subreaper of our own stands in for init and reads the exit status."""
    from actors.devices._worker_child import FENCED_EXIT

    backend = "cgroups_v1" if kernel == "v1" else "cgroups_v2"
    supervisor = subprocess.run(
        [sys.executable, "-c", SUPERVISOR, AGENT_WITH_A_WORKER_STOPPED_AT_BIRTH, backend, sandbox.hierarchy,
         sandbox.cgroups_root, str(tmp_path / "work")],
        capture_output=True, text=True, timeout=120,
    )
    assert supervisor.returncode == 0, supervisor.stderr[-3000:]
    outcome = json.loads(supervisor.stdout.strip().splitlines()[-1])
    assert outcome["reparented"] is True
    assert outcome["exit"] == FENCED_EXIT, outcome  # not 0: it went on, built a backend and said ready


def test_the_lock_is_never_followed_through_a_symbolic_link(tmp_path) -> None:
    """SPEC R-SC-7 (issue 25, finding 7): a link planted at the lock's name
    is refused, and the file it names is left as it was."""
    from actors.devices._lock import WorkDirLock

    victim = tmp_path / "root-only"
    victim.write_text("ROOT SECRET\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "agent.lock").symlink_to(victim)
    with pytest.raises(DeviceControlError, match=r"agent\.lock: Too many levels of symbolic links \(a symbolic link"):
        WorkDirLock.acquire(str(work), timeout=0.1)
    assert victim.read_text() == "ROOT SECRET\n"
    (work / "agent.lock").unlink()
    os.mkfifo(work / "agent.lock")  # not a regular file: refused without blocking on the FIFO
    with pytest.raises(DeviceControlError, match="is not a regular file"):
        WorkDirLock.acquire(str(work), timeout=0.1)
