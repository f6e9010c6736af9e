"""Metrics: counters, gauges and timers an actor publishes, read as
libprocess' flat snapshot or as Prometheus text.

Rules (libprocess ``process/metrics/``):
- Each ``Runtime`` has one registry, ``runtime.metrics`` (``Metrics``).
  ``counter(name)``, ``gauge(name, read=None)`` and ``timer(name)`` register
  a metric, or return the one already registered under that name (so two
  actors of one kind share it); asking for a name under another kind is a
  ``ValueError``. ``remove(name)`` drops it. Names are libprocess paths
  (``allocator/gpus_free``): letters, digits and ``/_-.:``.
- ``Counter``: ``inc(n=1)``; only goes up.
- ``Gauge``: a value that goes up and down: pushed (``set``/``inc``/``dec``)
  or pulled: ``read`` is called when a snapshot is taken (on the event
  loop, so it may read its actor's state directly; libprocess' PullGauge).
  A ``read`` that raises leaves the gauge out of that snapshot, logged.
- ``MetricSet(metrics)``: the metrics one process publishes, registered in
  its ``initialize`` and given back by ``close()`` in its ``finalize``.
  Names are fixed per kind of process (``isolator/prepares``, as libprocess
  names them), so several processes of one kind in a runtime (tests run
  many isolators) share each metric: counters and timers are shared, and a
  pulled gauge or counter is the SUM of what each process's ``read``
  returns. A metric stays registered while any set holds it and is removed
  with the last one. When a set closes, its pulled counters' last values
  are kept in the shared count (a counter never goes down while the
  metric lives); its pulled gauges stop counting at once.
- ``MetricTimer`` (a timer): ``record(seconds)`` or ``with timer.time():``. Keeps the
  count, the sum, the last value and the last 1000 values (libprocess'
  time-series window); percentiles are computed from those when read.
- Recording is an attribute update (a deque append for a timer): cheap
  enough for the hot path. Nothing is computed until someone reads.
- ``snapshot()`` is libprocess' ``/metrics/snapshot``: a flat ``{name:
  number}``; a timer ``t`` gives ``t_ms`` (last value), ``t_ms/count``,
  ``/min``, ``/max``, ``/p50``, ``/p90``, ``/p95``, ``/p99``, ``/p999``,
  ``/p9999`` in milliseconds (count and percentiles only once it has a
  value).
- ``prometheus()`` is the text exposition format 0.0.4: every character
  a Prometheus name cannot hold becomes ``_``; counters are ``<name>_total``
  (type counter), gauges type gauge, timers summaries in seconds
  (``<name>_seconds{quantile="0.5"}``, ``_count``, ``_sum``).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import deque
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

__all__ = ["Metrics", "MetricSet", "Counter", "Gauge", "MetricTimer"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_/.:-]*$")
_PROM_INVALID = re.compile(r"[^A-Za-z0-9_:]")
WINDOW = 1000
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999), ("p9999", 0.9999))


class Counter:
    """A count that only goes up: pushed (``inc``), plus what the pulled
    ``sources`` of a ``MetricSet`` read."""

    __slots__ = ("name", "help", "value", "sources")
    kind = "counter"

    def __init__(self, name: str, help: str = "") -> None:
        self.name = name
        self.help = help
        self.value: int | float = 0
        self.sources: list[Callable[[], float]] = []

    def inc(self, n: int | float = 1) -> None:
        """Add ``n`` (>= 0) to the count."""
        self.value += n

    def current(self) -> float:
        """The count now: what was pushed plus what each source reads."""
        value = self.value
        for read in self.sources:
            value += read()
        return value


class Gauge:
    """A value that goes up and down: pushed with ``set``/``inc``/``dec``,
    or pulled from ``read()`` when a snapshot is taken."""

    __slots__ = ("name", "help", "value", "read", "sources")
    kind = "gauge"

    def __init__(self, name: str, help: str = "", read: Callable[[], float] | None = None) -> None:
        self.name = name
        self.help = help
        self.value: float = 0
        self.read = read
        self.sources: list[Callable[[], float]] = []
        """The ``read`` of each ``MetricSet`` sharing this gauge (summed)."""

    def set(self, value: float) -> None:
        self.value = value

    def inc(self, n: float = 1) -> None:
        self.value += n

    def dec(self, n: float = 1) -> None:
        self.value -= n

    def current(self) -> float:
        """The value now (calls ``read`` for a pulled gauge; the sum of the
        sources for one shared by ``MetricSet``s)."""
        if self.sources:
            value = self.value
            for read in self.sources:
                value += read()
            return value
        return self.read() if self.read is not None else self.value


class _Timing:
    __slots__ = ("_timer", "_start")

    def __init__(self, timer: "MetricTimer") -> None:
        self._timer = timer

    def __enter__(self) -> "_Timing":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.record(time.perf_counter() - self._start)


class MetricTimer:
    """Durations: count, sum, last value and percentiles of the last 1000."""

    __slots__ = ("name", "help", "count", "sum", "last", "values")
    kind = "timer"

    def __init__(self, name: str, help: str = "") -> None:
        self.name = name
        self.help = help
        self.count = 0
        self.sum = 0.0
        self.last: float | None = None
        self.values: deque[float] = deque(maxlen=WINDOW)

    def record(self, seconds: float) -> None:
        """Add one duration, in seconds."""
        self.count += 1
        self.sum += seconds
        self.last = seconds
        self.values.append(seconds)

    def time(self) -> _Timing:
        """``with timer.time():`` records how long the block took."""
        return _Timing(self)

    def statistics(self) -> dict[str, float]:
        """min, max and the percentiles (seconds) of the window; empty when
        nothing was recorded."""
        values = sorted(self.values)
        if not values:
            return {}
        stats = {"min": values[0], "max": values[-1]}
        for label, q in PERCENTILES:
            stats[label] = _percentile(values, q)
        return stats


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of sorted ``values``."""
    position = (len(values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


class Metrics:
    """A runtime's registry of metrics (see module rules)."""

    def __init__(self) -> None:
        self._metrics: dict[str, Counter | Gauge | MetricTimer] = {}
        self._holders: dict[str, int] = {}
        """Per name: how many ``MetricSet``s hold it."""

    def _get(self, cls: type, name: str, help: str, **kw: Any) -> Any:
        metric = self._metrics.get(name)
        if metric is not None:
            if type(metric) is not cls:
                raise ValueError(f"Metric {name!r} is already registered as a {metric.kind}, not a {cls.kind}")
            if kw.get("read") is not None:
                metric.read = kw["read"]
            return metric
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"Invalid metric name {name!r}: use letters, digits and '/_-.:' (e.g. 'allocator/gpus_free')")
        metric = self._metrics[name] = cls(name, help, **kw)
        return metric

    def counter(self, name: str, help: str = "") -> Counter:
        """The counter called ``name`` (registered on first use)."""
        return self._get(Counter, name, help)

    def gauge(self, name: str, read: Callable[[], float] | None = None, help: str = "") -> Gauge:
        """The gauge called ``name``; with ``read`` it is pulled at snapshot time."""
        return self._get(Gauge, name, help, read=read)

    def timer(self, name: str, help: str = "") -> MetricTimer:
        """The timer called ``name`` (registered on first use)."""
        return self._get(MetricTimer, name, help)

    def remove(self, name: str) -> None:
        """Forget the metric called ``name`` (no-op when unknown)."""
        self._metrics.pop(name, None)
        self._holders.pop(name, None)

    def _hold(self, metric: Any) -> None:
        self._holders[metric.name] = self._holders.get(metric.name, 0) + 1

    def _release(self, metric: Any) -> None:
        """One ``MetricSet`` gives ``metric`` back; removed with the last one."""
        if self._metrics.get(metric.name) is not metric:
            return  # removed (or replaced) meanwhile
        left = self._holders.get(metric.name, 0) - 1
        if left > 0:
            self._holders[metric.name] = left
        else:
            self.remove(metric.name)

    def names(self) -> list[str]:
        return sorted(self._metrics)

    def _pulled_values(self) -> Iterator[tuple[Counter | Gauge, float]]:
        for metric in list(self._metrics.values()):
            if type(metric) is Gauge or type(metric) is Counter:
                try:
                    value = metric.current()
                    yield metric, value if type(value) is int else float(value)
                except Exception:  # noqa: BLE001 - a broken read never breaks a snapshot
                    logger.exception("Metric %s: reading the %s failed; left out of this snapshot",
                                     metric.name, metric.kind)

    def snapshot(self) -> dict[str, float]:
        """libprocess' ``/metrics/snapshot``: a flat ``{name: number}``."""
        out: dict[str, float] = {}
        values = dict(self._pulled_values())
        for name in sorted(self._metrics):
            metric = self._metrics[name]
            if type(metric) is not MetricTimer:
                if metric in values:
                    out[name] = values[metric]
            else:
                key = f"{name}_ms"
                if metric.last is None:
                    continue
                out[key] = metric.last * 1e3
                out[f"{key}/count"] = metric.count
                for label, value in metric.statistics().items():
                    out[f"{key}/{label}"] = value * 1e3
        return out

    def prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        values = dict(self._pulled_values())
        for name in sorted(self._metrics):
            metric = self._metrics[name]
            base = prometheus_name(name)
            if type(metric) is Counter:
                if metric not in values:
                    continue
                _family(lines, f"{base}_total", "counter", metric.help or name)
                lines.append(f"{base}_total {_number(values[metric])}")
            elif type(metric) is Gauge:
                if metric not in values:
                    continue
                _family(lines, base, "gauge", metric.help or name)
                lines.append(f"{base} {_number(values[metric])}")
            else:
                family = f"{base}_seconds"
                _family(lines, family, "summary", metric.help or name)
                stats = metric.statistics()
                for label, q in PERCENTILES:
                    if label in stats:
                        lines.append(f'{family}{{quantile="{q}"}} {_number(stats[label])}')
                lines.append(f"{family}_count {metric.count}")
                lines.append(f"{family}_sum {_number(metric.sum)}")
        return "\n".join(lines) + "\n" if lines else ""


class MetricSet:
    """The metrics one process publishes (see module rules): register them
    in ``initialize``, ``close()`` in ``finalize``."""

    __slots__ = ("_registry", "_held", "_sources", "_closed")

    def __init__(self, metrics: Metrics) -> None:
        self._registry = metrics
        self._held: list[Counter | Gauge | MetricTimer] = []
        self._sources: list[tuple[Counter | Gauge, Callable[[], float]]] = []
        self._closed = False

    def _take(self, metric: Any) -> Any:
        if self._closed:
            raise ValueError(f"Metric {metric.name!r}: this MetricSet is closed")
        if metric not in self._held:
            self._held.append(metric)
            self._registry._hold(metric)
        return metric

    def counter(self, name: str, help: str = "", read: Callable[[], float] | None = None) -> Counter:
        """The shared counter ``name``; with ``read`` this process's part is
        pulled (an attribute it already keeps), else pushed with ``inc``."""
        counter = self._take(self._registry.counter(name, help))
        if read is not None:
            counter.sources.append(read)
            self._sources.append((counter, read))
        return counter

    def gauge(self, name: str, read: Callable[[], float], help: str = "") -> Gauge:
        """The shared pulled gauge ``name``: this process adds ``read()`` to it."""
        gauge = self._take(self._registry.gauge(name, help=help))
        gauge.sources.append(read)
        self._sources.append((gauge, read))
        return gauge

    def timer(self, name: str, help: str = "") -> MetricTimer:
        """The shared timer ``name``."""
        return self._take(self._registry.timer(name, help))

    def close(self) -> None:
        """Give every metric back (idempotent): a pulled counter keeps this
        process's last count, a pulled gauge stops counting it, and a metric
        no other set holds is removed."""
        if self._closed:
            return
        self._closed = True
        for metric, read in self._sources:
            if read in metric.sources:
                metric.sources.remove(read)
            if type(metric) is Counter:
                try:
                    metric.value += read()
                except Exception:  # noqa: BLE001 - closing never fails on a broken read
                    logger.exception("Metric %s: reading the counter at close failed; its last part is lost",
                                     metric.name)
        for metric in self._held:
            self._registry._release(metric)
        self._sources.clear()
        self._held.clear()


def prometheus_name(name: str) -> str:
    """``name`` with every character Prometheus does not allow turned to ``_``."""
    text = _PROM_INVALID.sub("_", name)
    return text if not text[:1].isdigit() else f"_{text}"


def _family(lines: list[str], name: str, kind: str, help: str) -> None:
    help_text = help.replace("\\", "\\\\").replace("\n", "\\n")
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
