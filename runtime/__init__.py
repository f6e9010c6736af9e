"""The actor runtime: libprocess's model (processes, dispatch, futures,
clock, links, named messages) on anyio. Knows nothing of GPUs.

Rules of each concept are at the top of its module: ``_pid``, ``_future``,
``_process``, ``_runtime``, ``_tasks``, ``_clock``, ``_executor``,
``testing``; on the network (``Runtime(listen=...)``): ``_network``,
``_server``, ``_peers``, ``_http``; metrics: ``_metrics``.
"""

from ._clock import Clock, Timer
from ._errors import Discarded, Failure, ProcessTerminated
from ._executor import Executor
from ._future import Future, Promise, await_all, collect
from ._http import Limits, Request, Response
from ._metrics import Counter, Gauge, Metrics, MetricTimer
from ._pid import PID, generate_id
from ._process import Process
from ._runtime import (
    Runtime,
    current_runtime,
    defer,
    delay,
    dispatch,
    send,
    snapshot,
    spawn,
    terminate,
    wait,
)

__all__ = [
    "Clock", "Timer", "Discarded", "Failure", "ProcessTerminated", "Executor",
    "Future", "Promise", "await_all", "collect", "PID", "generate_id", "Process",
    "Runtime", "current_runtime", "defer", "delay", "dispatch", "send",
    "snapshot", "spawn", "terminate", "wait",
    "Limits", "Request", "Response", "Metrics", "Counter", "Gauge", "MetricTimer",
]
