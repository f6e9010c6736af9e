"""What the peers benchmark prints: rates and ratios, CPU per operation, memory, the bars.

Rules:
- ``format_table(...)``: a header naming the setup and the load average;
  one row a contender with each workload's median rate and the runtime's
  ratio to it (``-`` for the runtime itself, blank where the contender
  does not run that workload), and its peak RSS per live actor; then the
  CPU µs per operation in the same layout; then each bar with its ratio,
  its need and whether it is met; then the contenders not measured and
  why.
"""

from __future__ import annotations

from typing import Any

from .contender import WORKLOADS, Contender
from .measure import Counts

HEADINGS = {"sequential": "sequential/s", "callers": "{width} callers/s", "fan_out": "fan-out actors/s",
            "tells": "tells/s"}
NAMES = {"sequential": "sequential", "callers": "{width} callers", "fan_out": "fan-out", "tells": "tells",
         "fan_out_slowest": "fan-out slowest batch ÷ median"}


def _cell(row: dict[str, Any] | None, key: str) -> tuple[str, str]:
    if row is None:
        return "", ""
    ratio = "-" if key == "runtime" else (f"{row['ratio']:.2f}" if row["ratio"] is not None else "?")
    return f"{row['ops_per_s']:,}", ratio


def format_table(contenders: list[Contender], summary: dict[str, dict[str, Any]], memory: dict[str, Any],
                 bar_rows: list[dict[str, Any]], missing: dict[str, str], counts: Counts,
                 load: list[float] | None) -> str:
    load_text = " ".join(f"{x:.2f}" for x in load) if load else "unknown"
    lines = [
        f"Actor frameworks side by side: one process (asyncio), interleaved round robin, "
        f"medians of {counts.rounds} rounds; ratio = runtime / contender",
        f"{counts.n:,} round trips a run ({counts.width} callers share them in the callers run), "
        f"fan-out of {counts.actors:,} actors {counts.batches} times in a row (collector on), {counts.tells:,} tells"
        + (f" in bursts of {counts.burst:,}" if counts.burst else "") + f"; load average {load_text}",
        "",
    ]
    measured = [c for c in contenders if c.key in summary]
    width = max([len(c.title()) for c in measured] + [9])
    head = f"{'contender':<{width}}"
    for w in WORKLOADS:
        head += f"  {HEADINGS[w].format(width=counts.width):>16} {'ratio':>6}"
    head += f"  {'KiB/actor':>9}"
    lines += [head, "-" * len(head)]
    for c in measured:
        line = f"{c.title():<{width}}"
        for w in WORKLOADS:
            rate, ratio = _cell(summary[c.key].get(w), c.key)
            line += f"  {rate:>16} {ratio:>6}"
        rss = memory.get(c.key)
        line += f"  {rss:>9.2f}" if isinstance(rss, (int, float)) else f"  {'':>9}"
        lines.append(line)
    lines += ["", "CPU µs per operation (every thread of the process)"]
    head = f"{'contender':<{width}}" + "".join(f"  {NAMES[w].format(width=counts.width):>12}" for w in WORKLOADS)
    lines += [head, "-" * len(head)]
    for c in measured:
        line = f"{c.title():<{width}}"
        for w in WORKLOADS:
            row = summary[c.key].get(w)
            line += f"  {row['cpu_us_per_op']:>12.2f}" if row is not None else f"  {'':>12}"
        lines.append(line)
    batch_rows = [(c, summary[c.key]["fan_out"]["batches"]) for c in measured
                  if "batches" in summary[c.key].get("fan_out", {})]
    if batch_rows:
        lines += ["", "Fan-out batches (actors/s of each batch run back to back, over the rounds)"]
        for c, b in batch_rows:
            lines.append(f"  {c.title():<{width}}  median {b['median']:>10,}  slowest {b['slowest']:>10,}"
                         f"  slowest ÷ median {b['slowest_to_median']:.2f}")
    if bar_rows:
        titles = {c.key: c.title() for c in contenders}
        lines += ["", "Bars (the runtime's ratio, median of the rounds)"]
        names = [NAMES[row["workload"]].format(width=counts.width) for row in bar_rows]
        name_width = max(len(n) for n in names)
        for row, name in zip(bar_rows, names):
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "?"
            verdict = "met" if row["met"] else "NOT MET"
            against = "" if row["against"] == "runtime" else f"vs {titles[row['against']]}"
            lines.append(f"  {name:<{name_width}} {against:<{width + 3}} {ratio:>6} >= {row['need']:.1f}  {verdict}")
    notes = {k: v for k, v in memory.items() if isinstance(v, str)}
    if missing or notes:
        lines.append("")
    for key, why in missing.items():
        lines.append(f"Not measured: {key}: {why}")
    for key, why in notes.items():
        lines.append(f"No memory figure: {key}: {why}")
    return "\n".join(lines)
