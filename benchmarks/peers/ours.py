"""The runtime under test: one ``Process`` per actor, in one ``Runtime``.

Rules:
- Calls are ``dispatch(pid, Counter.echo, i)`` awaited (the dispatch
  benchmark's loop, ``benchmarks.dispatch.runtime_calls``). Tells are named
  messages, ``send(pid, "tell", i)``, handled by ``Counter.told``.
- Fan-out: ``spawn`` each actor, one ``dispatch`` to each (all in flight,
  ``collect``), then ``terminate`` each and ``wait`` for all.
- ``DispatchTells`` (reported, not a bar): tells as ``dispatch(pid,
  Counter.tell, i)`` whose Future nobody keeps, in the same runtime.
"""

from __future__ import annotations

from typing import Any

from runtime import PID, Runtime, collect, dispatch, send, spawn, terminate, wait

from ..dispatch import Echo, runtime_calls
from .contender import Contender, bursts, check_told, turn


class Counter(Echo):
    """``echo`` (from the dispatch benchmark), plus the tells' count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def initialize(self) -> None:
        self.install("tell", Counter.told)

    def told(self, _from: PID | None, _body: Any) -> None:
        self.seen += 1

    def tell(self, _value: Any) -> None:
        self.seen += 1

    def received(self) -> int:
        seen, self.seen = self.seen, 0
        return seen


class RuntimeContender(Contender):
    key = "runtime"
    label = "gpu-isolator runtime"
    distribution = "gpu-isolator"

    async def start(self) -> None:
        self._scope = Runtime()
        await self._scope.__aenter__()
        self._pid = spawn(Counter())

    async def stop(self) -> None:
        await self._scope.__aexit__(None, None, None)

    async def sequential(self, n: int) -> None:
        await runtime_calls(self._pid, n)

    async def live(self, k: int) -> list[PID]:
        pids = [spawn(Counter()) for _ in range(k)]
        echo = Counter.echo
        await collect([dispatch(pid, echo, 1) for pid in pids])
        return pids

    async def release(self, pids: list[PID]) -> None:
        for pid in pids:
            terminate(pid)
        await collect([wait(pid) for pid in pids])

    async def tells(self, m: int, burst: int = 0) -> None:
        pid = self._pid
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                send(pid, "tell", i)
            await turn(parts)
        check_told(self, await dispatch(pid, Counter.received), m)


class DispatchTells(Contender):
    """Tells as dispatches whose Futures are dropped (reported, not a bar)."""

    key = "runtime_dispatch"
    label = "runtime, dispatch as tell"
    workloads = ("tells",)
    bar = False

    async def start(self) -> None:  # in the runtime ``RuntimeContender`` started
        self._pid = spawn(Counter())

    async def tells(self, m: int, burst: int = 0) -> None:
        pid = self._pid
        tell = Counter.tell
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                dispatch(pid, tell, i)
            await turn(parts)
        check_told(self, await dispatch(pid, Counter.received), m)
