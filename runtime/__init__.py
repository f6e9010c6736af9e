"""The actor runtime: libprocess's model (processes, dispatch, futures,
clock, links, named messages) on anyio. Knows nothing of GPUs.

Rules of each concept are at the top of its module: ``_pid``, ``_future``,
``_process``, ``_runtime``, ``_clock``, ``_executor``, ``testing``.
"""

from ._clock import Clock, Timer
from ._errors import Discarded, Failure, ProcessTerminated
from ._executor import Executor
from ._future import Future, Promise, await_all, collect
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
]
