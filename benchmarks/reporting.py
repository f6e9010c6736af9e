"""What the benchmarks here share: their common options, the order of
interleaved runs, and how a result is printed.

Rules:
- ``options(prog, doc, repeat=3)``: an ``argparse`` parser for ``python -m
  <prog>`` described by the first line of ``doc``, with ``--repeat`` (runs
  per figure; the median is reported) and ``--json-only``.
- ``alternating(items, i)``: the order of run ``i`` when two take turns:
  as given for an even ``i``, reversed for an odd one (A B, B A, A B...).
  ``round_robin(items, i)``: the order of round ``i`` when several do:
  rotated by ``i`` (A B C, B C A, C A B...). Either way a burst of load on
  a shared machine hits every contender alike.
- ``load_average()``: the machine's 1, 5 and 15 minute load averages
  (``/proc/loadavg``; None where the system has none). Every wall-clock
  figure is reported with it.
- ``emit(benchmark, table, json_only, **fields)``: prints the table (unless
  ``json_only``), then one JSON line ``{"benchmark": ..., **fields,
  "python": ..., "load_average": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


def options(prog: str, doc: str, repeat: int = 3) -> argparse.ArgumentParser:
    """A parser with the options every benchmark here takes."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.strip().split("\n")[0])
    parser.add_argument("--repeat", type=int, default=repeat,
                        help=f"runs per figure; the median is reported (default {repeat})")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    return parser


def alternating(items: Sequence[T], i: int) -> list[T]:
    """Run ``i``'s order of two (or more) taking turns: as given, then reversed."""
    return list(items) if i % 2 == 0 else list(reversed(items))


def round_robin(items: Sequence[T], i: int) -> list[T]:
    """Round ``i``'s order of several contenders: ``items`` rotated by ``i``."""
    if not items:
        return []
    shift = i % len(items)
    return list(items[shift:]) + list(items[:shift])


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, None where there are none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def emit(benchmark: str, table: str, json_only: bool, **fields: Any) -> None:
    """The table (unless ``json_only``), then the result as one JSON line."""
    if not json_only:
        print(table)
    print(json.dumps({
        "benchmark": benchmark,
        **fields,
        "python": platform.python_version(),
        "load_average": load_average(),
    }))
