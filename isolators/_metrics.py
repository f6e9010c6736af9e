"""The isolator's metrics: what an operator watches on ``/metrics``.

Rules:
- Each isolator actor publishes them in its ``initialize`` and gives them
  back in its ``finalize``, through a ``runtime.MetricSet``: fixed names
  (``isolator/prepares``), shared by every isolator of the runtime (counts
  and timers shared, pulled gauges summed; see ``runtime._metrics``).
- Gauges are pulled: read from the actor's state only when a snapshot is
  taken, nothing on the hot path. ``isolator/containers``: top-level
  containers with a record; ``isolator/containers_lingering``: cgroups a
  cleanup or a failed prepare had to leave (processes inside);
  ``isolator/gpus_quarantined``: GPUs held back while a cgroup may reach
  any GPU (its device state unknown at recovery, a failed prepare's cgroup,
  drift that could not be repaired).
- Each measured verb (``measured``: prepare, update, cleanup, and reconcile
  of one container) counts every run that reached its body
  (``isolator/<verb>s``) and the runs that failed
  (``isolator/<verb>_failures``), and times the runs that succeeded
  (``isolator/<verb>``, from the start of the body: time waiting behind the
  container's earlier calls is not counted). An ``update`` answered at once
  (it asks for what the container holds, with no call on it in flight) is
  counted, not timed. A nested container's prepare or cleanup is not
  counted: it holds no GPUs.
- ``isolator/repairs``: the repairs ``reconcile`` made (device rules and
  CDI specs: one per ``Repair`` it returns), and the device rules
  ``recover`` repaired (a recovered container whose kernel state lagged its
  record).
- Before ``initialize`` and after ``finalize`` the counts go to private
  metrics that nothing publishes.
"""

from __future__ import annotations

import functools
from time import perf_counter
from typing import Any, Awaitable, Callable, TypeVar

from runtime import Counter, MetricSet, MetricTimer, current_runtime

__all__ = ["IsolatorMetrics", "VerbMetrics", "measured"]

VERBS = ("prepare", "update", "cleanup", "reconcile")

_HELP = {  # runs, failures, timer
    "prepare": ("prepares of top-level containers", "prepares that failed (and were undone)",
                "prepare latency (successful prepares)"),
    "update": ("updates of a container's GPUs", "updates that failed (and changed nothing)",
               "update latency (successful updates that ran)"),
    "cleanup": ("cleanups of top-level containers (unknown ids too)", "cleanups that failed",
                "cleanup latency (successful cleanups)"),
    "reconcile": ("containers whose kernel device state reconcile checked",
                  "containers whose kernel device state reconcile could not check or repair",
                  "reconcile latency per container"),
}

T = TypeVar("T")


class VerbMetrics:
    """One verb's runs, failures and latency."""

    __slots__ = ("runs", "failures", "timer")

    def __init__(self, runs: Counter, failures: Counter, timer: MetricTimer) -> None:
        self.runs = runs
        self.failures = failures
        self.timer = timer


def _verb(verb: str, metrics: MetricSet | None) -> VerbMetrics:
    runs, failures, timer = f"isolator/{verb}s", f"isolator/{verb}_failures", f"isolator/{verb}"
    if metrics is None:
        return VerbMetrics(Counter(runs), Counter(failures), MetricTimer(timer))
    helps = _HELP[verb]
    return VerbMetrics(metrics.counter(runs, helps[0]), metrics.counter(failures, helps[1]),
                       metrics.timer(timer, helps[2]))


class IsolatorMetrics:
    """An isolator actor's metrics (see the module rules)."""

    __slots__ = ("prepare", "update", "cleanup", "reconcile", "repairs", "_published")

    def __init__(self) -> None:
        self._published: MetricSet | None = None
        self._bind(None)

    def _bind(self, metrics: MetricSet | None) -> None:
        for verb in VERBS:
            setattr(self, verb, _verb(verb, metrics))
        help = "repairs made: drift reconcile repaired (device rules, CDI specs), device rules recover repaired"
        self.repairs = metrics.counter("isolator/repairs", help) if metrics is not None else Counter("")

    def publish(self, containers: Callable[[], int], lingering: Callable[[], int],
                held_back: Callable[[], int]) -> None:
        """Register in the current runtime; the gauges call ``containers``,
        ``lingering`` and ``held_back`` when a snapshot is taken."""
        self.close()
        published = self._published = MetricSet(current_runtime().metrics)
        published.gauge("isolator/containers", containers, "top-level containers with a record")
        published.gauge("isolator/containers_lingering", lingering,
                        "cgroups left behind with processes inside (cleaned up, or a failed prepare)")
        published.gauge("isolator/gpus_quarantined", held_back,
                        "GPUs held back while a cgroup may reach any GPU (unknown device state at recovery,"
                        " a failed prepare's cgroup, drift that could not be repaired)")
        self._bind(published)

    def close(self) -> None:
        """Give the metrics back; counting goes on privately."""
        if self._published is not None:
            self._published.close()
            self._published = None
            self._bind(None)


def measured(verb: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """Count and time an isolator verb's body (an async method of the actor or
    of a part of it, which keeps the actor's ``IsolatorMetrics`` as ``_metrics``)."""

    def decorate(body: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(body)
        async def run(process: Any, *args: Any) -> T:
            counts: VerbMetrics = getattr(process._metrics, verb)
            counts.runs.inc()
            start = perf_counter()
            try:
                result = await body(process, *args)
            except BaseException:
                counts.failures.inc()
                raise
            counts.timer.record(perf_counter() - start)
            return result

        return run

    return decorate
