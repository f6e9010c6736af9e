"""pykka: one ``ThreadingActor`` (a thread and a queue) per actor.

Rules:
- Messages are ``(kind, value)`` tuples handled by ``on_receive`` (pykka's
  plain ask/tell API; its proxies cost more per call). Sequential calls are
  ``ref.ask(message)`` (blocking); concurrent callers are asyncio tasks
  awaiting ``ref.ask(message, block=False)`` (pykka's awaitable Future);
  tells are ``ref.tell(message)``.
- Fan-out: ``start`` each actor, ``ask`` each without blocking and
  ``get_all``, then ``stop`` each without blocking and ``get_all``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .contender import Contender, ECHO, RECEIVED, TELL, bursts, check_told, turn


def _actor_class() -> type:
    import pykka

    class Echo(pykka.ThreadingActor):
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def on_receive(self, message: Any) -> Any:
            kind, value = message
            if kind == ECHO:
                return value
            if kind == TELL:
                self.seen += 1
                return None
            seen, self.seen = self.seen, 0
            return seen

    return Echo


class PykkaContender(Contender):
    key = "pykka"
    label = "pykka"
    distribution = "pykka"
    modules = ("pykka",)

    async def start(self) -> None:
        import pykka

        self._pykka = pykka
        self._echo = _actor_class()
        self._ref = self._echo.start()

    async def stop(self) -> None:
        self._pykka.ActorRegistry.stop_all()

    async def sequential(self, n: int) -> None:
        ask = self._ref.ask
        for i in range(n):
            ask((ECHO, i))

    async def callers(self, n: int, width: int) -> None:
        ask = self._ref.ask

        async def caller(count: int) -> None:
            for i in range(count):
                await ask((ECHO, i), block=False)

        await asyncio.gather(*(caller(n // width) for _ in range(width)))

    async def live(self, k: int) -> list[Any]:
        refs = [self._echo.start() for _ in range(k)]
        self._pykka.get_all([ref.ask((ECHO, 1), block=False) for ref in refs])
        return refs

    async def release(self, refs: list[Any]) -> None:
        self._pykka.get_all([ref.stop(block=False) for ref in refs])

    async def tells(self, m: int, burst: int = 0) -> None:
        tell = self._ref.tell
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                tell((TELL, i))
            await turn(parts)
        check_told(self, self._ref.ask((RECEIVED, None)), m)
