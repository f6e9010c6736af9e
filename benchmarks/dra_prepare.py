"""DRA NodePrepareResources latency: one 1-GPU claim at a time, and 100 claims at once.

Rules of the measurement:
- The driver is the real ``gpu-isolator dra-plugin`` process on the 8-GPU
  host-file node (``tests/inventory/data/dgx8-nvlink.toml``), its claims
  read through lightkube from the fake API server on 127.0.0.1
  (``tests.support.kube_api``), called by the fake kubelet over the unix
  socket (``tests.support.dra_kubelet``, grpcio's synchronous stub).
- "one": ``--n`` times, a fresh claim (a new uid) of one GPU is prepared
  (timed: the kubelet's call, its API read, the CDI spec and checkpoint
  writes) and then unprepared (not timed). p50 and p90 in ms.
- "concurrent": ``--concurrent`` (100) claims, one NodePrepareResources
  call each, all sent at once from as many threads; the node has 8 GPUs,
  so the claims share them by ``shareID`` (the same path, conflicts
  checked). Wall time until every call answered, claims/s, and the calls'
  p50; then all are unprepared (not timed).
- Each figure is the median over ``--repeat`` runs (3); the load average
  is printed with it. Output: a table, then one JSON line.

Run: ``python -m benchmarks.dra_prepare [--n 200] [--concurrent 100]`` (root: the node's device nodes are mknod'ed).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .reporting import emit, options

REPO = Path(__file__).resolve().parents[1]
NODE = "bench-node"
DRIVER = "gpu.isolator.dev"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(n: int, concurrent: int, repeat: int) -> dict:
    sys.path.insert(0, str(REPO))
    from isolators.simulated_node import SimulatedNode
    from tests.support.dra_kubelet import DraPluginCommand, FakeDraKubelet
    from tests.support.kube_api import FakeApiServer, allocation_result
    from tests.support.kubelet import flag_args, plugin_directory

    base = Path(tempfile.mkdtemp(prefix="dra-bench-"))
    node = SimulatedNode(base / "node", host=REPO / "tests" / "inventory" / "data" / "dgx8-nvlink.toml")
    node.create_files()
    (base / "cdi").mkdir()
    api = FakeApiServer().start()
    with plugin_directory() as sockets:
        plugin = DraPluginCommand(flag_args(node.flag_values(cdi_spec_dir=str(base / "cdi"))) + [
            f"--plugins_registry_dir={sockets}/registry", f"--plugins_dir={sockets}/plugins", f"--node_name={NODE}",
            f"--kubeconfig={api.kubeconfig(base / 'kubeconfig')}"], base)
        kubelet = FakeDraKubelet(sockets / "registry")
        try:
            plugin.start()
            kubelet.register()

            def claim(device: str, **shared: object) -> tuple[str, str, str]:
                uid = str(uuid.uuid4())
                api.add_claim("bench", f"c-{uid[:13]}", [allocation_result("gpus", DRIVER, NODE, device, **shared)],
                              uid=uid)
                return ("bench", f"c-{uid[:13]}", uid)

            def prepare_one(ref: tuple[str, str, str]) -> float:
                started = time.perf_counter()
                answer = kubelet.prepare([ref])[ref[2]]
                took = time.perf_counter() - started
                if "devices" not in answer:
                    raise AssertionError(f"prepare failed: {answer}")
                return took

            warm = claim("gpu-0")  # warm-up: connections made
            prepare_one(warm)
            kubelet.unprepare([warm])
            runs = []
            for _ in range(repeat):
                one = []
                for _ in range(n):
                    ref = claim("gpu-0")
                    one.append(prepare_one(ref))
                    kubelet.unprepare([ref])
                refs = [claim(f"gpu-{i % 8}", share_id=f"s{i}") for i in range(concurrent)]
                with ThreadPoolExecutor(concurrent) as pool:
                    started = time.perf_counter()
                    calls = list(pool.map(prepare_one, refs))
                    wall = time.perf_counter() - started
                kubelet.unprepare(refs)
                runs.append({"one_p50_ms": statistics.median(one) * 1e3, "one_p90_ms": _percentile(one, 0.9) * 1e3,
                             "concurrent_wall_ms": wall * 1e3, "concurrent_claims_per_s": concurrent / wall,
                             "concurrent_call_p50_ms": statistics.median(calls) * 1e3})
        finally:
            kubelet.close()
            plugin.close()
            api.close()
    return {key: round(statistics.median(run[key] for run in runs), 2) for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = options("benchmarks.dra_prepare", __doc__)
    parser.add_argument("--n", type=int, default=200, help="1-GPU claims prepared one at a time per run (default 200)")
    parser.add_argument("--concurrent", type=int, default=100, help="claims prepared at once per run (default 100)")
    args = parser.parse_args(argv)
    result = measure(args.n, args.concurrent, args.repeat)
    table = "\n".join([
        f"DRA NodePrepareResources, median of {args.repeat} runs",
        f"  one 1-GPU claim at a time ({args.n}): p50 {result['one_p50_ms']:.2f} ms, p90 {result['one_p90_ms']:.2f} ms",
        f"  {args.concurrent} claims at once: {result['concurrent_wall_ms']:.1f} ms wall,"
        f" {result['concurrent_claims_per_s']:.0f} claims/s, call p50 {result['concurrent_call_p50_ms']:.1f} ms",
    ])
    emit("dra_prepare", table, args.json_only, n=args.n, concurrent=args.concurrent, repeat=args.repeat, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
