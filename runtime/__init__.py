"""The actor runtime: libprocess's model (processes, dispatch, futures,
clock, links, named messages) on anyio. Knows nothing of GPUs.

Rules of each concept are at the top of its module: ``_pid``, ``_future``,
``_process``, ``_runtime``, ``_tasks``, ``_sequence``, ``_clock``, ``_executor``,
``testing``; on the network (``Runtime(listen=...)``): ``_network``,
``_server``, ``_peers``, ``_http``; metrics: ``_metrics``.

Names are imported when first used: a process that needs only
``runtime.Failure`` (a device worker process) does not import asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "._clock": ("Clock", "Timer"),
    "._errors": ("Discarded", "Failure", "ProcessTerminated"),
    "._executor": ("Executor",),
    "._future": ("Future", "Promise", "await_all", "collect"),
    "._http": ("Limits", "Request", "Response"),
    "._metrics": ("Counter", "Gauge", "Metrics", "MetricSet", "MetricTimer"),
    "._pid": ("PID", "generate_id"),
    "._process": ("Process",),
    "._sequence": ("Sequence",),
    "._runtime": ("Runtime", "current_runtime", "defer", "delay", "dispatch", "send", "snapshot", "spawn",
                  "terminate", "wait"),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:  # a submodule, as after an eager import of the package
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ._clock import Clock, Timer
    from ._errors import Discarded, Failure, ProcessTerminated
    from ._executor import Executor
    from ._future import Future, Promise, await_all, collect
    from ._http import Limits, Request, Response
    from ._metrics import Counter, Gauge, Metrics, MetricSet, MetricTimer
    from ._pid import PID, generate_id
    from ._process import Process
    from ._sequence import Sequence
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
