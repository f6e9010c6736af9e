"""compactor: PyPI's Python libprocess port (tornado, a context thread).

Rules:
- One ``Context`` on 127.0.0.1; its processes run on the context's thread.
  compactor has messages only: a call is an ``echo`` message from a
  ``caller`` process carrying a fresh key, answered by a ``reply``
  message with that key, whose handler completes the asyncio caller's
  future (``call_soon_threadsafe``) -- the libprocess request/response
  idiom. Tells are ``tell`` messages; ``received`` answers like ``echo``
  once every earlier message was handled (one context thread, in order).
- No fan-out: compactor mounts and unmounts HTTP routes for every process
  it spawns and terminates (about 100 processes a second here, so 1,000 of
  them take the whole run); the other three workloads fit it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from .contender import Contender, bursts, check_told, turn


def _classes() -> tuple[type, type]:
    from compactor.process import Process

    class Echo(Process):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.seen = 0

        @Process.install("echo")
        def echo(self, from_pid: Any, body: bytes) -> None:
            self.send(from_pid, "reply", body)

        @Process.install("tell")
        def tell(self, _from_pid: Any, _body: bytes) -> None:
            self.seen += 1

    class Caller(Process):
        """Completes the asyncio future waiting for each key's reply."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            super().__init__("caller")
            self.loop = loop
            self.pending: dict[bytes, asyncio.Future] = {}

        @Process.install("reply")
        def reply(self, _from_pid: Any, body: bytes) -> None:
            future = self.pending.pop(body)
            self.loop.call_soon_threadsafe(future.set_result, body)

    return Echo, Caller


class CompactorContender(Contender):
    key = "compactor"
    label = "compactor"
    distribution = "compactor"
    modules = ("compactor",)
    workloads = ("sequential", "callers", "tells")

    async def start(self) -> None:
        from compactor.context import Context

        # compactor 0.3.0 logs every closed connection twice: noise here
        logging.getLogger("compactor.context").setLevel(logging.CRITICAL)
        self._echo_class, caller_class = _classes()
        self._keys = itertools.count()
        self._names = itertools.count()
        self._context = Context(ip="127.0.0.1")
        self._context.start()
        self._caller = caller_class(asyncio.get_running_loop())
        self._context.spawn(self._caller)
        self._echo = self._spawn()

    def _spawn(self) -> Any:
        process = self._echo_class(f"echo{next(self._names)}")
        self._context.spawn(process)
        return process

    async def stop(self) -> None:
        self._context.stop()
        self._context.join(5)

    def _call(self, to: Any) -> asyncio.Future:
        key = b"%d" % next(self._keys)
        future = self._caller.loop.create_future()
        self._caller.pending[key] = future
        self._caller.send(to, "echo", key)
        return future

    async def sequential(self, n: int) -> None:
        call = self._call
        to = self._echo.pid
        for _ in range(n):
            await call(to)

    async def live(self, k: int) -> list[Any]:  # the memory figure only (see the module rules)
        processes = [self._spawn() for _ in range(k)]
        await asyncio.gather(*(self._call(process.pid) for process in processes))
        return processes

    async def release(self, processes: list[Any]) -> None:
        for process in processes:
            self._context.terminate(process.pid)

    async def tells(self, m: int, burst: int = 0) -> None:
        send = self._caller.send
        to = self._echo.pid
        parts = bursts(m, burst)
        for part in parts:
            for _ in part:
                send(to, "tell", b"")
            await turn(parts)
        await self._call(to)  # handled after every tell before it
        told, self._echo.seen = self._echo.seen, 0
        check_told(self, told, m)
