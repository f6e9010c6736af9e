"""Peak RSS per live actor: each contender alone in a child process.

Rules:
- ``python -m benchmarks.peers.memory KEY --actors K`` starts contender
  KEY, runs one fan-out of K/10 actors (code loaded, caches filled),
  collects garbage, resets the process's peak RSS (``/proc/self/clear_refs``
  ``5``; where the kernel refuses, the peak so far stands and
  ``peak_reset`` says so) and reads the RSS; then spawns K actors, each
  called once (``live``), and reads the peak: ``(peak - RSS before) / K``
  in KiB. One JSON line ``{"key", "actors", "rss_kib_per_actor",
  "peak_reset"}``; then it exits at once, so no framework's shutdown
  counts or hangs.
- Each contender runs in a process of its own because a peak is one per
  process and memory one framework freed would be reused by the next.
- ``rss_per_actor(key, k)`` runs that child: the figure, or None and why.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


async def _measure(key: str, k: int) -> dict:
    from .lineup import OWNERS, lineup

    contenders = {c.key: c for c in lineup()}
    contender = contenders[key]
    owner = contenders.get(OWNERS.get(key, ""))
    if owner is not None:
        await owner.start()
    await contender.start()
    await contender.fan_out(max(1, k // 10))
    gc.collect()
    reset = _reset_peak()
    before = _status_kib("VmRSS")
    actors = await contender.live(k)
    peak = _status_kib("VmHWM")
    del actors
    return {"key": key, "actors": k, "rss_kib_per_actor": round((peak - before) / k, 2), "peak_reset": reset}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.memory", description=__doc__.split("\n")[0])
    parser.add_argument("key")
    parser.add_argument("--actors", type=int, default=2000)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(_measure(args.key, args.actors))), flush=True)
    os._exit(0)


def rss_per_actor(key: str, k: int, timeout: float = 120.0) -> tuple[float | None, str | None]:
    """KiB of peak RSS per live actor of ``key`` (None and the reason when it failed)."""
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.peers.memory", key, "--actors", str(k)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"the memory run of {key} took over {timeout:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None, f"the memory run of {key} failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    return json.loads(lines[-1])["rss_kib_per_actor"], None


if __name__ == "__main__":
    sys.exit(main())
