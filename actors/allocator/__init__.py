"""The GPU allocator: which of the node's GPUs are free (R-FL-1, R-AL-1..3).

The handle, ``NvidiaGpuAllocator`` (``resources(flags)``, ``create``,
``allocate``/``deallocate``/``available``), is exported by ``actors``;
``GpuAllocatorProcess`` is the actor (its health calls in ``_health``, its
node-ledger calls in ``_ledger_calls``); ``HealthMonitorProcess`` feeds it NVML
health events;
``allocate_best``/``PairScores`` the topology scoring; ``LedgerState`` what
the allocator's node ledger link knows (``_ledger_state``; ``_ledger_link``: the one place a
front door takes and returns leases, SPEC 22). Rules of each piece
are at the top of its module.
"""

from ._errors import AllocatorError, format_gpus
from ._health import GpuHealth, HealthSnapshot
from ._ledger_link import LINGER
from ._ledger_state import LedgerState
from ._monitor import HealthMonitorProcess
from ._process import AllocatorState, GpuAllocatorProcess
from ._mig_resources import managed_units, mig_resource_names
from ._resources import enumerate_indices, gpu_resources
from ._topology import NVLINK_WEIGHT, PCIE_POINTS, PairScores, allocate_best, pair_score

__all__ = [
    "AllocatorError", "format_gpus", "LINGER", "LedgerState", "HealthMonitorProcess", "AllocatorState",
    "GpuAllocatorProcess", "GpuHealth", "HealthSnapshot", "enumerate_indices", "gpu_resources", "managed_units",
    "mig_resource_names",
    "NVLINK_WEIGHT", "PCIE_POINTS", "PairScores", "allocate_best", "pair_score",
]
