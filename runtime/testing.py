"""Test filters: what libprocess gives gtest (``FUTURE_DISPATCH``, ``DROP_DISPATCH``).

Rules:
- A filter sees every dispatch / named message of the current runtime as it
  is queued. The newest matching filter wins; each filter matches once and is
  then removed.
- ``expect_dispatch(pid, method)`` returns a Future that becomes READY with a
  ``Dispatched`` record (pid, method name, args, kwargs) when a matching
  dispatch is queued; the dispatch itself goes on.
- ``drop_dispatch(pid, method)`` does the same but drops the dispatch: the
  dispatch's own Future fails with a ``Failure`` saying it was dropped.
- ``expect_message`` / ``drop_message`` do the same for named messages
  (a ``Messaged`` record: to, name, body, from).
- ``pid=None`` matches any process; ``method`` is a function or its name.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._errors import Failure
from ._future import FAILED, READY, Future
from ._pid import PID
from ._runtime import current_runtime

__all__ = ["Dispatched", "Messaged", "expect_dispatch", "drop_dispatch", "expect_message", "drop_message"]


class Dispatched(msgspec.Struct, frozen=True):
    """A dispatch seen by a filter."""

    pid: PID
    method: str
    args: tuple
    kwargs: dict


class Messaged(msgspec.Struct, frozen=True):
    """A named message seen by a filter."""

    to: PID
    name: str
    body: Any
    from_: PID | None


class _Filter:
    __slots__ = ("kind", "pid", "what", "drop", "future")

    def __init__(self, kind: str, pid: PID | None, what: str, drop: bool) -> None:
        self.kind = kind
        self.pid = pid
        self.what = what
        self.drop = drop
        self.future: Future = Future()


def _method_name(method: Any) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def _add(kind: str, pid: PID | None, what: Any, drop: bool) -> Future:
    f = _Filter(kind, pid, _method_name(what), drop)
    current_runtime()._filters.append(f)
    return f.future


def expect_dispatch(pid: PID | None, method: Any) -> Future[Dispatched]:
    """READY with the arguments when a matching dispatch is queued."""
    return _add("dispatch", pid, method, False)


def drop_dispatch(pid: PID | None, method: Any) -> Future[Dispatched]:
    """Drop the next matching dispatch; its Future fails as dropped."""
    return _add("dispatch", pid, method, True)


def expect_message(pid: PID | None, name: str) -> Future[Messaged]:
    """READY with the message when a matching named message is sent."""
    return _add("message", pid, name, False)


def drop_message(pid: PID | None, name: str) -> Future[Messaged]:
    """Drop the next matching named message."""
    return _add("message", pid, name, True)


def _find(rt: Any, kind: str, pid: PID, what: str) -> _Filter | None:
    filters = rt._filters
    for i in range(len(filters) - 1, -1, -1):
        f = filters[i]
        if f.kind == kind and (f.pid is None or f.pid == pid) and f.what == what:
            del filters[i]
            return f
    return None


def _match_dispatch(rt: Any, pid: PID, method: Any, args: tuple, kwargs: dict, future: Future) -> bool:
    name = _method_name(method)
    f = _find(rt, "dispatch", pid, name)
    if f is None:
        return False
    f.future._complete(READY, Dispatched(pid, name, tuple(args), dict(kwargs or {})))
    if f.drop:
        future._complete(FAILED, Failure(f"Dispatch of {name} to {pid} was dropped by a test filter"))
        return True
    return False


def _match_message(rt: Any, to: PID, name: str, body: Any, from_: PID | None) -> bool:
    f = _find(rt, "message", to, name)
    if f is None:
        return False
    f.future._complete(READY, Messaged(to, name, body, from_))
    return f.drop
