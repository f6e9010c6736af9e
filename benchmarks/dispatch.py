"""Dispatch round trip: the runtime against a minimal hand-written actor.

Rules of the measurement:
- One actor, a method that returns its argument. "sequential": one caller
  awaiting ``n`` round trips one after another. "concurrent": ``callers``
  tasks (100 by default) sharing the ``n`` round trips, all in flight at once.
- Baseline, measured in the same run and the same event loop: on asyncio a
  serving task reading ``(message, future)`` pairs from an ``asyncio.Queue``
  and setting each future; on trio a serving task reading ``(message, reply)``
  from a trio memory channel and setting a ``trio.Event`` on the reply.
- Runs are interleaved after one warm-up of each: every run of ``n`` round
  trips is cut into ``CHUNKS`` pieces and runtime and baseline alternate
  piece by piece (runtime, baseline, baseline, runtime, ...), so a burst of
  load on a shared machine hits both alike. Every figure is the median of
  ``--repeat`` runs (3).
- Ratio = runtime round trips/s ÷ baseline round trips/s: above 1.0 the
  runtime is faster. Output: a table, then one JSON line (``--json-only``
  prints only the JSON line).

Run: ``python -m benchmarks.dispatch [--backend asyncio|trio|both] [--n 30000]``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any, Awaitable, Callable

from runtime import PID, Process, Runtime, dispatch, spawn, terminate, wait

from .reporting import alternating, emit, options

MODES = ("sequential", "concurrent")


class Echo(Process):
    """The actor under test: one sync method returning its argument."""

    def __init__(self) -> None:
        super().__init__()

    def echo(self, value: Any) -> Any:
        return value


class _Handler:
    """What the baseline actors call per message (same work as ``Echo``)."""

    def echo(self, value: Any) -> Any:
        return value


# -- the runtime --------------------------------------------------------------
async def runtime_calls(pid: PID, count: int) -> None:
    method = Echo.echo
    for i in range(count):
        await dispatch(pid, method, i)


# -- asyncio baseline: asyncio.Queue + serving task ----------------------------
async def queue_actor(queue: asyncio.Queue, handler: _Handler) -> None:
    while True:
        message, future = await queue.get()
        future.set_result(handler.echo(message))


async def queue_calls(queue: asyncio.Queue, count: int) -> None:
    create_future = asyncio.get_running_loop().create_future
    put = queue.put_nowait
    for i in range(count):
        future = create_future()
        put((i, future))
        await future


# -- trio baseline: memory channel + serving task ------------------------------
class _Reply:
    __slots__ = ("value", "event")

    def __init__(self, event: Any) -> None:
        self.value: Any = None
        self.event = event


async def channel_actor(receive: Any, handler: _Handler) -> None:
    async for message, reply in receive:
        reply.value = handler.echo(message)
        reply.event.set()


async def channel_calls(send: Any, count: int) -> None:
    import trio

    send_nowait = send.send_nowait
    event_type = trio.Event
    for i in range(count):
        reply = _Reply(event_type())
        send_nowait((i, reply))
        await reply.event.wait()


# -- harness ------------------------------------------------------------------
CHUNKS = 5


async def _timed(
    backend: str, calls: Callable[[Any, int], Awaitable[None]], target: Any, n: int, callers: int
) -> tuple[int, float]:
    """(round trips made, seconds) for ``n`` calls by ``callers`` concurrent callers."""
    per_caller = n // callers
    start = time.perf_counter()
    if callers == 1:
        await calls(target, n)
    elif backend == "asyncio":
        await asyncio.gather(*(calls(target, per_caller) for _ in range(callers)))
    else:
        import trio

        async with trio.open_nursery() as nursery:
            for _ in range(callers):
                nursery.start_soon(calls, target, per_caller)
    return (n if callers == 1 else per_caller * callers), time.perf_counter() - start


async def _measure(backend: str, n: int, callers: int, repeat: int) -> dict[str, dict[str, float]]:
    handler = _Handler()
    samples: dict[tuple[str, str], list[float]] = {
        (impl, mode): [] for impl in ("runtime", "baseline") for mode in MODES
    }
    async with Runtime():
        pid = spawn(Echo())
        if backend == "asyncio":
            queue: asyncio.Queue = asyncio.Queue()
            server = asyncio.get_running_loop().create_task(queue_actor(queue, handler))
            baseline: tuple[Callable[[Any, int], Awaitable[None]], Any] = (queue_calls, queue)
            stop = server.cancel
            await _run_rounds(backend, pid, baseline, n, callers, repeat, samples)
            stop()
        else:
            import trio

            send, receive = trio.open_memory_channel(float("inf"))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel_actor, receive, handler)
                await _run_rounds(backend, pid, (channel_calls, send), n, callers, repeat, samples)
                await send.aclose()
        terminate(pid)
        await wait(pid)
    result: dict[str, dict[str, float]] = {}
    for mode in MODES:
        rt = statistics.median(samples[("runtime", mode)])
        base = statistics.median(samples[("baseline", mode)])
        result[mode] = {"runtime_rps": round(rt), "baseline_rps": round(base), "ratio": round(rt / base, 3)}
    return result


async def _run_rounds(
    backend: str,
    pid: PID,
    baseline: tuple[Callable[[Any, int], Awaitable[None]], Any],
    n: int,
    callers: int,
    repeat: int,
    samples: dict[tuple[str, str], list[float]],
) -> None:
    impls = {"runtime": (runtime_calls, pid), "baseline": baseline}
    warmup = max(callers, n // 10)
    for mode in MODES:  # warm-up, not counted
        width = 1 if mode == "sequential" else callers
        for calls, target in impls.values():
            await _timed(backend, calls, target, warmup, width)
    for _ in range(repeat):
        for mode in MODES:
            width = 1 if mode == "sequential" else callers
            made = {impl: 0 for impl in impls}
            seconds = {impl: 0.0 for impl in impls}
            for chunk in range(CHUNKS):
                for impl in alternating(("runtime", "baseline"), chunk):
                    calls, target = impls[impl]
                    count, elapsed = await _timed(backend, calls, target, n // CHUNKS, width)
                    made[impl] += count
                    seconds[impl] += elapsed
            for impl in impls:
                samples[(impl, mode)].append(made[impl] / seconds[impl])


def run(backend: str, n: int, callers: int = 100, repeat: int = 3) -> dict[str, dict[str, float]]:
    """Measure one backend; returns {mode: {runtime_rps, baseline_rps, ratio}}."""
    if backend == "asyncio":
        return asyncio.run(_measure(backend, n, callers, repeat))
    if backend == "trio":
        import trio

        return trio.run(_measure, backend, n, callers, repeat)
    raise ValueError(f"Unknown backend {backend!r}: use asyncio, trio or both")


BASELINE_NAMES = {"asyncio": "asyncio.Queue actor", "trio": "trio channel actor"}


def format_table(results: dict[str, dict[str, dict[str, float]]], callers: int) -> str:
    header = f"{'backend':<8} {'mode':<22} {'runtime rt/s':>13} {'baseline rt/s':>14} {'ratio':>6}  baseline"
    lines = [header, "-" * len(header)]
    for backend, modes in results.items():
        for mode, row in modes.items():
            label = mode if mode == "sequential" else f"concurrent ({callers} callers)"
            lines.append(
                f"{backend:<8} {label:<22} {row['runtime_rps']:>13,} {row['baseline_rps']:>14,} "
                f"{row['ratio']:>6.2f}  {BASELINE_NAMES[backend]}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options("benchmarks.dispatch", __doc__)
    parser.add_argument("--backend", choices=("asyncio", "trio", "both"), default="both")
    parser.add_argument("--n", type=int, default=30_000, help="round trips per measurement (default 30000)")
    parser.add_argument("--callers", type=int, default=100, help="concurrent callers (default 100)")
    args = parser.parse_args(argv)
    if args.n < args.callers * CHUNKS or args.callers < 1 or args.repeat < 1:
        parser.error(
            f"need --n >= {CHUNKS} x --callers, --callers >= 1 and --repeat >= 1, "
            f"got n={args.n} callers={args.callers} repeat={args.repeat}"
        )
    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    results = {backend: run(backend, args.n, args.callers, args.repeat) for backend in backends}
    emit("dispatch_round_trip", format_table(results, args.callers), args.json_only,
         n=args.n, callers=args.callers, repeat=args.repeat, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
