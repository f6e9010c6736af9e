"""An MPS share's cost: granting and returning one, its unit's daemon already up and cold.

``python -m benchmarks.mps_share [--shares 200] [--cold 30]``

- On the tests' stand-in ``nvidia-cuda-mps-control`` (built here with gcc)
  and a simulated 1-GPU node: the figures are ``MpsDaemons``' own work and
  the control program's processes, not a real MPS daemon's.
- Warm: another share keeps the unit's daemon up; each of ``--shares``
  shares is granted (``share``: the server list and the limit commands,
  two client runs) and returned (``release``: bookkeeping only).
- Cold: each of ``--cold`` shares is the unit's only one, so granting it
  starts the daemon (directories, compute mode, ``-d``, its pid file, the
  limits) and returning it stops it (``quit``, its exit, compute mode).
- p50 and p99 of each, in milliseconds, with the machine's load average.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time

import anyio

from actors.mps import MpsDaemons, ShareLimits
from actors.mps.testing import NO_GCC, build_mps_control
from actors.nvml import NvmlService, SimulatedNvml
from runtime import Runtime

from .reporting import emit, load_average, options

LIMITS = ShareLimits(memory_bytes=8 << 30, thread_percentage=50)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return round(statistics.median(ordered) * 1000, 3), round(p99 * 1000, 3)


async def _measure(control: str, runtime_dir: str, shares: int, cold: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    async with Runtime():
        nvml = SimulatedNvml.with_gpus(1)
        nvml.init()
        daemons = MpsDaemons(NvmlService(nvml), runtime_dir, control)
        uuid = nvml.uuid(0)
        try:
            for kind, count, keep in (("cold", cold, False), ("warm", shares, True)):
                if keep:
                    await daemons.share(uuid, "keeper", LIMITS)
                grants, returns = [], []
                for i in range(count):
                    start = time.perf_counter()
                    await daemons.share(uuid, f"{kind}-{i}", LIMITS)
                    middle = time.perf_counter()
                    await daemons.release(f"{kind}-{i}")
                    grants.append(middle - start)
                    returns.append(time.perf_counter() - middle)
                if keep:
                    await daemons.release("keeper")
                if count:
                    figures[f"{kind}_share_p50_ms"], figures[f"{kind}_share_p99_ms"] = _percentiles(grants)
                    figures[f"{kind}_release_p50_ms"], figures[f"{kind}_release_p99_ms"] = _percentiles(returns)
        finally:
            await daemons.close()
    return figures


def main() -> None:
    parser = options("benchmarks.mps_share", __doc__, repeat=1)
    parser.add_argument("--shares", type=int, default=200, help="warm shares (default 200)")
    parser.add_argument("--cold", type=int, default=30, help="cold shares (default 30)")
    args = parser.parse_args()
    logging.getLogger("actors.mps").setLevel(logging.WARNING)  # a line a share is not the figure
    with tempfile.TemporaryDirectory(prefix="mps-bench-", dir="/tmp") as directory:
        control = build_mps_control(directory)
        if control is None:
            raise SystemExit(NO_GCC)
        runtime_dir = tempfile.mkdtemp(prefix="run-", dir=directory)
        load_before = load_average()
        figures = anyio.run(_measure, str(control), runtime_dir, args.shares, args.cold)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    table = "\n".join([
        "an MPS share on the stand-in control daemon (simulated 1-GPU node), p50 / p99 in ms:",
        f"  warm ({args.shares} shares, daemon up): share {figures.get('warm_share_p50_ms')} /"
        f" {figures.get('warm_share_p99_ms')}, release {figures.get('warm_release_p50_ms')} /"
        f" {figures.get('warm_release_p99_ms')}",
        f"  cold ({args.cold} shares, daemon started and stopped): share {figures.get('cold_share_p50_ms')} /"
        f" {figures.get('cold_share_p99_ms')}, release {figures.get('cold_release_p50_ms')} /"
        f" {figures.get('cold_release_p99_ms')}",
    ])
    emit("mps_share", table, args.json_only, shares=args.shares, cold=args.cold, load_before=load_before, **figures)


if __name__ == "__main__":
    main()
