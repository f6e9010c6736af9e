"""The entry point: arguments, the contenders started, measured, stopped, the output.

Rules:
- ``main(argv)`` parses the arguments (bad ones: exit 2 with one line),
  starts every contender picked (one that is missing, or fails to start,
  is reported with why and left out), measures them (``measure``), stops
  them (also on an error), takes the memory figures (``memory``), prints
  the table and the JSON line and returns 0.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..reporting import emit, load_average, options
from . import __doc__ as package_doc
from .contender import Contender
from .lineup import lineup, pick
from .measure import Counts, bars, measure, summarise
from .memory import rss_per_actor
from .report import format_table

DEFAULT = Counts(n=20_000, width=100, actors=1_000, tells=50_000, rounds=5)
QUICK = Counts(n=10_000, width=100, actors=1_000, tells=20_000, rounds=3)


async def _run(contenders: list[Contender], counts: Counts, missing: dict[str, str]) -> dict[str, Any]:
    started: list[Contender] = []
    try:
        for contender in contenders:
            try:
                await contender.start()
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                missing[contender.key] = f"could not start: {type(e).__name__}: {e}"
                continue
            started.append(contender)
        contenders[:] = started
        return summarise(await measure(started, counts))
    finally:
        for contender in reversed(started):
            await contender.stop()


def main(argv: list[str] | None = None) -> int:
    parser = options("benchmarks.peers", package_doc, repeat=DEFAULT.rounds)
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller run: {QUICK.n:,} round trips, {QUICK.tells:,} tells, {QUICK.rounds} rounds "
                             "(unless given)")
    parser.add_argument("--n", type=int, default=None, help=f"round trips a run (default {DEFAULT.n:,})")
    parser.add_argument("--callers", type=int, default=DEFAULT.width, help=f"concurrent callers (default {DEFAULT.width})")
    parser.add_argument("--actors", type=int, default=DEFAULT.actors, help=f"fan-out actors (default {DEFAULT.actors:,})")
    parser.add_argument("--batches", type=int, default=DEFAULT.batches,
                        help=f"fan-out batches run back to back, each timed (default {DEFAULT.batches})")
    parser.add_argument("--tells", type=int, default=None, help=f"tells a run (default {DEFAULT.tells:,})")
    parser.add_argument("--tell-burst", type=int, default=DEFAULT.burst,
                        help="tells sent before each loop turn (default 0: all of them at once)")
    parser.add_argument("--memory-actors", type=int, default=2_000,
                        help="live actors for the RSS figure (default 2,000; 0: no memory figures)")
    parser.add_argument("--only", default=None,
                        help="comma-separated contenders besides the runtime (default: all): "
                             + ",".join(c.key for c in lineup()[1:]))
    parser.set_defaults(repeat=None)  # DEFAULT's or QUICK's rounds, unless given
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    counts = Counts(args.n if args.n is not None else base.n, args.callers, args.actors,
                    args.tells if args.tells is not None else base.tells,
                    args.repeat if args.repeat is not None else base.rounds, args.batches, args.tell_burst)
    everyone = lineup()
    keys = None
    if args.only is not None:
        keys = {k.strip() for k in args.only.split(",") if k.strip()}
        unknown = keys - {c.key for c in everyone}
        if unknown:
            parser.error(f"unknown contender(s) {', '.join(sorted(unknown))}: choose from "
                         + ", ".join(c.key for c in everyone))
    if counts.n < counts.width or counts.width < 1 or counts.actors < 1 or counts.tells < 1 or counts.rounds < 1 \
            or counts.batches < 1 or counts.burst < 0 or args.memory_actors < 0:
        parser.error(f"need --n >= --callers >= 1, --actors, --batches, --tells and --repeat >= 1 and --tell-burst, "
                     f"--memory-actors >= 0, got n={counts.n} callers={counts.width} actors={counts.actors} "
                     f"batches={counts.batches} tells={counts.tells} tell-burst={counts.burst} "
                     f"repeat={counts.rounds} memory-actors={args.memory_actors}")
    chosen = pick(everyone, keys)
    missing = {c.key: why for c in chosen if (why := c.missing()) is not None}
    contenders = [c for c in chosen if c.key not in missing]
    summary = asyncio.run(_run(contenders, counts, missing))
    memory: dict[str, Any] = {}
    if args.memory_actors:
        for c in contenders:
            if c.spawns_actors():
                figure, why = rss_per_actor(c.key, args.memory_actors)
                memory[c.key] = figure if figure is not None else why
    bar_rows = bars(summary, contenders)
    load = load_average()
    table = format_table(contenders, summary, memory, bar_rows, missing, counts, load)
    emit("peers", table, args.json_only,
         counts=counts._asdict(), memory_actors=args.memory_actors,
         contenders={c.key: {"label": c.label, "version": c.version(), "bar": c.bar, "workloads": summary[c.key],
                             "rss_kib_per_actor": memory.get(c.key) if not isinstance(memory.get(c.key), str) else None}
                     for c in contenders},
         missing=missing, memory_errors={k: v for k, v in memory.items() if isinstance(v, str)},
         bars=bar_rows, bars_met=all(row["met"] for row in bar_rows))
    return 0
