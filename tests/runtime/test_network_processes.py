"""R-NW-2..4 across OS processes: ours against ours (asyncio and trio in the
child), a linked peer killed with SIGKILL, and compactor (PyPI's Python
libprocess port, run in its own process) both ways. The peer programs are
``benchmarks.remote_peers``; every wait is bounded."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtime import PID, Process, Runtime, dispatch, spawn

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
needs_compactor = pytest.mark.skipif(
    importlib.util.find_spec("compactor") is None,
    reason="compactor (PyPI) is not installed: python -m pip install -e '.[test]'",
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the children vary the backend; this side stays on asyncio


@asynccontextmanager
async def peer(*args: str) -> AsyncIterator[tuple[Any, PID]]:
    """A server program of ``benchmarks.remote_peers`` in its own OS process."""
    process = await anyio.open_process([sys.executable, "-m", "benchmarks.remote_peers", *args], cwd=ROOT)
    try:
        with anyio.fail_after(20):
            line = await _line(process.stdout)
        assert line.startswith("PID "), line
        yield process, PID.parse(line.split()[1])
    finally:
        await process.stdin.aclose()
        with anyio.move_on_after(5):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _line(stream: Any) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive(1)
        if not chunk:
            break
        data += chunk
    return data.decode()


class Asker(Process):
    def __init__(self) -> None:
        super().__init__("asker")
        self.replies: list[tuple[PID, bytes]] = []
        self.exits: list[PID] = []
        self.changed = anyio.Event()

    def initialize(self) -> None:
        self.install("pong", self.pong, bytes)

    def ask(self, to: PID, bodies: list[bytes]) -> None:
        for body in bodies:
            self.send(to, "ping", body)

    def watch(self, pid: PID) -> None:
        self.link(pid)

    def pong(self, sender: PID, body: bytes) -> None:
        self.replies.append((sender, body))
        self.changed.set()

    def exited(self, pid: PID) -> None:
        self.exits.append(pid)
        self.changed.set()

    async def until(self, condition: Any, timeout: float = 10.0) -> None:
        with anyio.fail_after(timeout):
            while not condition():
                self.changed = anyio.Event()
                await self.changed.wait()


class Echo(Process):
    def __init__(self) -> None:
        super().__init__("echo")

    def initialize(self) -> None:
        self.install("ping", self.ping, bytes)

    def ping(self, sender: PID, body: bytes) -> None:
        self.send(sender, "pong", body)


@asynccontextmanager
async def asking(*peer_command: str) -> AsyncIterator[tuple[Any, PID, Asker]]:
    """A peer OS process (``peer(*peer_command)``) and, in a listening Runtime
    of ours, an Asker to talk to it: the peer's process, its echo's PID, the
    Asker."""
    async with peer(*peer_command) as (process, echo):
        async with Runtime(listen="127.0.0.1:0"):
            asker = Asker()
            spawn(asker)
            yield process, echo, asker


@pytest.mark.parametrize("child_backend", ["asyncio", "trio"])
async def test_two_os_processes_of_ours_exchange_messages_and_sigkill_gives_exited(child_backend: str) -> None:
    async with asking("ours-echo", "--backend", child_backend) as (process, echo, asker):
        bodies = [f"m{i}".encode() for i in range(100)]
        await dispatch(asker.pid, Asker.watch, echo)
        await dispatch(asker.pid, Asker.ask, echo, bodies)
        await asker.until(lambda: len(asker.replies) == 100)
        assert asker.replies == [(echo, body) for body in bodies]
        assert asker.exits == []
        os.kill(process.pid, signal.SIGKILL)
        await asker.until(lambda: asker.exits)
        assert asker.exits == [echo]


async def test_a_peer_linked_to_us_sees_exited_when_our_runtime_goes_away() -> None:
    rt = Runtime(listen="127.0.0.1:0")
    await rt.__aenter__()
    running = True
    try:
        spawn(Echo())
        target = f"echo@{rt.address}"
        async with peer("ours-echo", "--link", target) as (process, _echo):
            with anyio.fail_after(10):  # its link's connection to us is made (the only one we get)
                while rt.metrics.snapshot()["runtime/http/connections"] < 1:
                    await anyio.sleep(0.01)
            running = False
            await rt.__aexit__(None, None, None)
            with anyio.fail_after(10):
                assert (await _line(process.stdout)).strip() == f"EXITED {target}"
    finally:
        if running:
            await rt.__aexit__(None, None, None)


@needs_compactor
async def test_ours_sends_first_and_compactor_answers() -> None:
    async with asking("compactor-echo") as (_process, echo, asker):
        bodies = [b"hello", b"\x00\xff binary", b"", b"x" * 100_000]
        await dispatch(asker.pid, Asker.ask, echo, bodies)
        await asker.until(lambda: len(asker.replies) == len(bodies))
    assert asker.replies == [(echo, body) for body in bodies]


@needs_compactor
async def test_compactor_sends_first_and_ours_answers_the_sender() -> None:
    async with Runtime(listen="127.0.0.1:0") as rt:
        echo = spawn(Echo())
        done = await anyio.run_process(
            [sys.executable, "-m", "benchmarks.remote_peers", "compactor-ping", str(echo), "--count", "20", "--window", "5", "--body", "from compactor", "--timeout", "20"],
            cwd=ROOT, check=False,
        )
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert result["count"] == 20
    assert result["first"] == {"from": str(echo), "body": "from compactor"}
    assert rt.metrics.snapshot()["runtime/messages/received"] == 20


@needs_compactor
async def test_a_link_to_a_compactor_process_gives_exited_when_it_is_killed() -> None:
    async with asking("compactor-echo") as (process, echo, asker):
        await dispatch(asker.pid, Asker.watch, echo)
        await dispatch(asker.pid, Asker.ask, echo, [b"ping"])
        await asker.until(lambda: asker.replies)
        os.kill(process.pid, signal.SIGKILL)
        await asker.until(lambda: asker.exits)
    assert asker.exits == [echo]
