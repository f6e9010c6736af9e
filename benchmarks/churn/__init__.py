"""Container churn: the isolator against the kernel's own floor.

Rules of the measurement:
- A simulated 8-GPU node (``isolators.simulated_node.SimulatedNode``) and
  ``--workers`` concurrent workers (64). Workers 0-7 run GPU containers
  (``gpus:1``), the rest CPU-only ones (``gpus:0``). Each lifecycle is
  prepare -> usage -> update(gpus:0) -> cleanup of a fresh container id,
  through the isolator's public handle. Workers start lifecycles for
  ``--seconds`` (5) after a short warm-up that is not counted;
  lifecycles/s = lifecycles completed / time until the last one ended
  (``workload``).
- Backends (``--backends``): ``memory``, ``cgroups_v1``, ``cgroups_v2``. The
  kernel ones need root and their hierarchy (else they are skipped, and
  said so); they use a cgroups root ``gpu-isolator-bench-<hex>`` of their own
  (``--cgroups-root``; an existing one is refused), removed at the end, also
  on Ctrl-C or an error.
- The floor (``floor``), measured in the same run right before each
  isolator run, is the same kernel work done directly in one synchronous
  loop, with the same mix of GPU and CPU-only containers. v1: mkdir, ``a``
  to devices.deny, each allow rule of the container's policy (standard set,
  control devices, its GPU) to devices.allow, the GPU's deny (what
  update(gpus:0) writes), rmdir; one open fd per file, one ``write(2)`` per
  rule. v2: mkdir, load the policy's program (verifier included), attach it,
  for a GPU container load and attach (replace) the gpus:0 program, rmdir.
  v2 also measures ``floor_cached``: programs loaded once up front, each
  lifecycle only attaching, as the device layer does by caching programs by
  policy.
- ``ratio`` = isolator lifecycles/s / floor lifecycles/s, per repetition
  (each pair measured back to back), median of ``--repeat`` (3). Latency
  percentiles (µs, per call) are those of the median repetition. Peak RSS is
  the process's high-water mark (``getrusage``) after that backend's runs
  (``peak_rss_mb_before``: before the first). ``device_ops_per_batch`` is
  how many operations device control applied per executor job (group
  commit).
- CPU per lifecycle (``cpu``): the event loop's thread, this process's
  other threads and the device worker process, in µs of CPU time per
  lifecycle, and the floor's the same way. Wall-clock rates swing with
  whatever else the machine runs; CPU per lifecycle is what the work costs.
- ``--device-worker`` (the isolator's ``device_worker`` flag): ``process``
  (default) runs the kernel work in a device worker process, ``thread`` in
  a thread of this process. ``worker_peak_rss_mb`` is the worker process's
  own peak (the table's peak RSS is this process's).
- Output (``report``): a table, then one JSON line (``--json-only``: only
  the JSON line). A progress line on stderr while it runs
  (``--no-progress``).
- Only public names of the project are used.

- ``--ledger both`` measures each backend with the node ledger off and on
  in the same run (``ledger``: its directory, its jobs, one lease's cost).

Run: ``python -m benchmarks.churn [--workers 64] [--seconds 5] [--repeat 3]
[--backends memory,cgroups_v1,cgroups_v2] [--ledger off|on|both]`` (``run.main``).
"""

from .cpu import CpuClock, CpuUse, process_cpu_seconds
from .floor import floor_v1, floor_v2
from .hops import HopCounter, Hops, census
from .ledger import lease_cost_us, ledger_jobs, node_ledger_dir, removed
from .report import Progress, format_table, peak_rss_mb, worker_peak_rss_mb
from .run import ROOT_PREFIX, main, measure_backend, summary_row
from .workload import CALLS, GPUS, ChurnRun, churn

__all__ = [
    "CpuClock", "CpuUse", "process_cpu_seconds", "floor_v1", "floor_v2", "HopCounter", "Hops", "census",
    "lease_cost_us", "ledger_jobs", "node_ledger_dir", "removed",
    "Progress", "format_table", "peak_rss_mb", "worker_peak_rss_mb",
    "ROOT_PREFIX", "main", "measure_backend", "summary_row", "CALLS", "GPUS", "ChurnRun", "churn",
]
