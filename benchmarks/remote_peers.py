"""Peer programs for remote messaging: ours and compactor's, each in its own
OS process. Used by ``benchmarks.remote`` and by the network tests.

Rules:
- ``python -m benchmarks.remote_peers ours-echo [--backend asyncio|trio]``
  and ``... compactor-echo``: a libprocess runtime on 127.0.0.1 (any free
  port) with one process ``echo`` that answers every ``ping`` message with a
  ``pong`` carrying the same body to its sender. ``ours-echo --link PID``
  also links ``echo`` to PID and prints ``EXITED <pid>`` when told it
  exited.
- ``... compactor-ping TARGET --count N [--window W] [--body TEXT]
  [--warmup K]``: a compactor process ``pinger`` sends ``ping`` to TARGET
  and the next one whenever a ``pong`` comes back, W in flight, until N
  came back (after K untimed ones); prints one JSON line ``{"count",
  "seconds", "first": {"from", "body"}, "pid"}``. It gives up after
  ``--timeout`` seconds (exit 1).
- A server program prints ``PID <pid>`` on its first line of stdout and
  serves until its stdin closes (so a parent that dies takes it along).
- compactor (PyPI 0.3.0: tornado 4.1, trollius) is imported only in these
  programs' own processes; it runs unchanged on Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any


# -- ours -----------------------------------------------------------------
def ours_echo(backend: str, link: str | None) -> int:
    import anyio

    from runtime import PID, Process, Runtime, spawn

    class Echo(Process):
        def __init__(self) -> None:
            super().__init__("echo")

        def initialize(self) -> None:
            self.install("ping", self.ping, bytes)
            if link:
                self.link(PID.parse(link))

        def ping(self, sender: PID, body: bytes) -> None:
            self.send(sender, "pong", body)

        def exited(self, pid: PID) -> None:
            print(f"EXITED {pid}", flush=True)

    async def main() -> None:
        async with Runtime(listen="127.0.0.1:0"):
            pid = spawn(Echo())
            print(f"PID {pid}", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)

    anyio.run(main, backend=backend)
    return 0


# -- compactor --------------------------------------------------------------
def _compactor_context() -> Any:
    import logging

    from compactor.context import Context

    # compactor 0.3.0 reports every closed connection twice, the second time
    # as "ERROR ... no stream found": noise, not a fault of the peer
    logging.getLogger("compactor.context").setLevel(logging.CRITICAL)

    context = Context(ip="127.0.0.1")
    context.start()
    return context


def compactor_echo() -> int:
    from compactor.process import Process

    class Echo(Process):
        @Process.install("ping")
        def ping(self, from_pid: Any, body: bytes) -> None:
            self.send(from_pid, "pong", body)

    context = _compactor_context()
    echo = Echo("echo")
    context.spawn(echo)
    print(f"PID {echo.pid}", flush=True)
    sys.stdin.read()
    os._exit(0)  # compactor's stop() logs tracebacks of its own streams


def compactor_ping(target: str, count: int, window: int, body: bytes, timeout: float, warmup: int) -> int:
    from compactor.pid import PID
    from compactor.process import Process

    done = threading.Event()
    to = PID.from_string(target)
    goal = [count]

    class Pinger(Process):
        def __init__(self) -> None:
            super().__init__("pinger")
            self.sent = 0
            self.received = 0
            self.first: dict[str, str] | None = None

        @Process.install("pong")
        def pong(self, from_pid: Any, reply: bytes) -> None:
            if self.first is None:
                self.first = {"from": str(from_pid), "body": reply.decode("utf-8", "replace")}
            self.received += 1
            if self.received >= goal[0]:
                done.set()
            elif self.sent < goal[0]:
                self.sent += 1
                self.send(to, "ping", body)

    def rounds(n: int) -> bool:
        done.clear()
        goal[0], pinger.sent, pinger.received = n, 0, 0
        for _ in range(min(window, n)):
            pinger.sent += 1
            pinger.send(to, "ping", body)
        return done.wait(timeout)

    context = _compactor_context()
    pinger = Pinger()
    context.spawn(pinger)
    finished = rounds(warmup) if warmup else True
    start = time.perf_counter()
    finished = finished and rounds(count)
    seconds = time.perf_counter() - start
    print(json.dumps({"count": pinger.received, "seconds": seconds, "first": pinger.first, "pid": str(pinger.pid)}), flush=True)
    os._exit(0 if finished else 1)  # compactor's stop() logs tracebacks of its own streams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remote_peers", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="program", required=True)
    echo = sub.add_parser("ours-echo")
    echo.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    echo.add_argument("--link", default=None, help="link echo to this PID; print EXITED when it exits")
    sub.add_parser("compactor-echo")
    ping = sub.add_parser("compactor-ping")
    ping.add_argument("target")
    ping.add_argument("--count", type=int, default=1)
    ping.add_argument("--window", type=int, default=1)
    ping.add_argument("--body", default="ping")
    ping.add_argument("--timeout", type=float, default=30.0)
    ping.add_argument("--warmup", type=int, default=0, help="round trips before the timed ones")
    args = parser.parse_args(argv)
    if args.program == "ours-echo":
        return ours_echo(args.backend, args.link)
    if args.program == "compactor-echo":
        return compactor_echo()
    return compactor_ping(args.target, args.count, args.window, args.body.encode(), args.timeout, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
