"""The actor runtime: libprocess's model (processes, dispatch, futures,
clock, links, named messages) on anyio. Knows nothing of GPUs.

Rules of each concept are at the top of its module: ``_pid``, ``_future``,
``_process``, ``_runtime``, ``_tasks``, ``_sequence``, ``_clock``, ``_executor``,
``testing``; on the network (``Runtime(listen=...)``): ``_network``,
``_server``, ``_peers``, ``_http``; metrics: ``_metrics``.

Names are imported when first used (``lazy_exports``, which every
package's ``__init__`` uses): a process that needs only ``runtime.Failure`` (a device
worker process) does not import asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

_EXPORTS = {
    "._clock": ("Clock", "Timer"),
    "._errors": ("Discarded", "Failure", "ProcessTerminated"),
    "._executor": ("Executor", "executor_jobs"),
    "._future": ("Future", "Promise", "await_all", "collect"),
    "._http": ("Limits", "Request", "Response"),
    "._lazy": ("lazy_exports",),
    "._metrics": ("Counter", "Gauge", "Metrics", "MetricSet", "MetricTimer"),
    "._network": ("parse_address",),
    "._pid": ("PID", "generate_id"),
    "._process": ("Process",),
    "._sequence": ("Sequence",),
    "._runtime": ("Runtime", "current_runtime", "defer", "delay", "dispatch", "send", "snapshot", "spawn",
                  "terminate", "wait"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._clock import Clock, Timer
    from ._errors import Discarded, Failure, ProcessTerminated
    from ._executor import Executor, executor_jobs
    from ._future import Future, Promise, await_all, collect
    from ._http import Limits, Request, Response
    from ._lazy import lazy_exports
    from ._metrics import Counter, Gauge, Metrics, MetricSet, MetricTimer
    from ._network import parse_address
    from ._pid import PID, generate_id
    from ._process import Process
    from ._sequence import Sequence
    from ._runtime import Runtime, current_runtime, defer, delay, dispatch, send, snapshot, spawn, terminate
    from ._runtime import wait
