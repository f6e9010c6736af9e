"""Remote messages: round trips per second between two OS processes on
loopback, ours against compactor (a Python libprocess port) in the same run.

Rules of the measurement:
- A round trip: a ``ping`` message to a process ``echo`` in another OS
  process, which answers the sender with a ``pong`` carrying the same body
  (libprocess' wire form both ways: two HTTP POSTs, two 202s).
- "sequential": one ping in flight; "pipelined": ``--window`` (64) in
  flight, a new ping sent whenever a pong comes back.
- Ours: the pinger is a process in this benchmark's own runtime
  (``Runtime(listen="127.0.0.1:0")``), the echo a runtime in a child
  process (``benchmarks.remote_peers ours-echo``). compactor: pinger and
  echo are each a child process of their own (``compactor-ping``,
  ``compactor-echo``); the pinger times itself.
- Each run starts after a warm-up round trip (connections made) and times
  ``--n`` round trips. Runs alternate (ours, compactor, compactor, ours,
  ...) so a burst of load on a shared machine hits both alike; each figure
  is the median of ``--repeat`` runs (3).
- Ratio = ours ÷ compactor round trips/s: above 1.0 ours is faster.
  Output: a table, then one JSON line (``--json-only``: only the JSON).

Run: ``python -m benchmarks.remote [--n 2000] [--window 64] [--backend asyncio|trio]``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import anyio

from runtime import PID, Process, Promise, Runtime, dispatch, spawn

from .reporting import alternating, emit, options

MODES = ("sequential", "pipelined")
BODY = b"x" * 64


class Pinger(Process):
    """Sends ``ping`` to ``to`` and another each time a ``pong`` comes back,
    ``window`` in flight, until ``count`` came back."""

    def __init__(self) -> None:
        super().__init__("pinger")
        self._promise: Promise | None = None
        self._to: PID | None = None
        self._count = self._sent = self._received = 0

    def initialize(self) -> None:
        self.install("pong", self.pong, bytes)

    def run(self, to: PID, count: int, window: int) -> Any:
        self._promise = Promise()
        self._to, self._count, self._sent, self._received = to, count, 0, 0
        for _ in range(min(window, count)):
            self._sent += 1
            self.send(to, "ping", BODY)
        return self._promise.future

    def pong(self, sender: PID, body: bytes) -> None:
        self._received += 1
        if self._received >= self._count:
            self._promise.set_value(self._received)
        elif self._sent < self._count:
            self._sent += 1
            self.send(self._to, "ping", BODY)


@contextmanager
def peer(*args: str) -> Iterator[tuple[subprocess.Popen, PID]]:
    """A server program of ``benchmarks.remote_peers``: (process, its PID)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.remote_peers", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("PID "):
            raise RuntimeError(f"peer {' '.join(args)} did not start: {line!r}")
        yield proc, PID.parse(line.split()[1])
    finally:
        proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def ours(pid: PID, echo: PID, n: int, window: int) -> float:
    """Seconds for ``n`` round trips (after one warm-up) from our pinger."""
    await dispatch(pid, Pinger.run, echo, 1, 1)
    start = time.perf_counter()
    await dispatch(pid, Pinger.run, echo, n, window)
    return time.perf_counter() - start


def compactor(echo: PID, n: int, window: int) -> float:
    """Seconds for ``n`` round trips (after one warm-up) from compactor's pinger."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.remote_peers", "compactor-ping", str(echo),
         "--count", str(n), "--window", str(window), "--warmup", "1", "--body", BODY.decode()],
        capture_output=True, text=True, timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"compactor pinger failed ({done.returncode}): {done.stdout[-500:]} {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


async def measure(n: int, window: int, repeat: int, backend: str) -> dict[str, dict[str, Any]]:
    samples: dict[tuple[str, str], list[float]] = {(impl, mode): [] for impl in ("ours", "compactor") for mode in MODES}
    windows = {"sequential": 1, "pipelined": window}
    with peer("ours-echo", "--backend", backend) as (_, our_echo), peer("compactor-echo") as (_, their_echo):
        async with Runtime(listen="127.0.0.1:0"):
            pinger = spawn(Pinger())
            for i in range(repeat):
                for mode in MODES:
                    for impl in alternating(("ours", "compactor"), i):
                        if impl == "ours":
                            seconds = await ours(pinger, our_echo, n, windows[mode])
                        else:
                            seconds = await anyio.to_thread.run_sync(compactor, their_echo, n, windows[mode])
                        samples[(impl, mode)].append(n / seconds)
    results: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        mine = statistics.median(samples[("ours", mode)])
        theirs = statistics.median(samples[("compactor", mode)])
        results[mode] = {
            "window": windows[mode],
            "ours_rps": round(mine),
            "compactor_rps": round(theirs),
            "ratio": round(mine / theirs, 3),
            "ours_runs": [round(x) for x in samples[("ours", mode)]],
            "compactor_runs": [round(x) for x in samples[("compactor", mode)]],
        }
    return results


def format_table(results: dict[str, dict[str, Any]], n: int, repeat: int, backend: str) -> str:
    lines = [
        f"remote round trips between two OS processes on loopback ({backend}; {n} per run, median of {repeat})",
        f"{'mode':<22}{'ours rt/s':>12}{'compactor rt/s':>16}{'ratio':>8}",
        "-" * 58,
    ]
    for mode, row in results.items():
        label = f"{mode} (window {row['window']})"
        lines.append(f"{label:<22}{row['ours_rps']:>12,}{row['compactor_rps']:>16,}{row['ratio']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options("benchmarks.remote", __doc__)
    parser.add_argument("--n", type=int, default=2000, help="round trips per run (default 2000)")
    parser.add_argument("--window", type=int, default=64, help="pings in flight when pipelined (default 64)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="our runtime's event loop (default asyncio)")
    args = parser.parse_args(argv)
    results = anyio.run(measure, args.n, args.window, args.repeat, args.backend, backend=args.backend)
    emit("remote_round_trip", format_table(results, args.n, args.repeat, args.backend), args.json_only,
         n=args.n, repeat=args.repeat, backend=args.backend, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
