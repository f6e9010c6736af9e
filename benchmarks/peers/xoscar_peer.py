"""xoscar: actors in an actor pool of this process.

Rules:
- One pool (``create_actor_pool("127.0.0.1", n_process=0)``: the main pool
  only, in this process). Calls go through the ``ActorRef`` that
  ``create_actor`` returns (``await ref.echo(i)``); tells are
  ``await ref.tell.tell(i)`` (xoscar sends them without waiting for the
  result, but the send itself is awaited).
- Fan-out: ``create_actor`` each (all at once, ``gather``), one call to
  each, then ``destroy_actor`` each.
- ``XoscarLocalContender`` (reported, not a bar): the ``LocalActorRef``
  that ``actor_ref`` gives for an actor of this process -- a direct call of
  the method in the caller's coroutine under the actor's lock, no message
  hop. Sequential, concurrent callers and tells.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from .contender import Contender, bursts, check_told, turn

_ids = itertools.count()


def _actor_class() -> type:
    import xoscar

    class Echo(xoscar.Actor):
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def echo(self, value: Any) -> Any:
            return value

        def tell(self, _value: Any) -> None:
            self.seen += 1

        def received(self) -> int:
            seen, self.seen = self.seen, 0
            return seen

    return Echo


class _RefWorkloads:
    """Sequential calls and tells through ``self._ref``: the same for an
    ``ActorRef`` and a ``LocalActorRef``."""

    _ref: Any

    async def sequential(self, n: int) -> None:
        echo = self._ref.echo
        for i in range(n):
            await echo(i)

    async def tells(self, m: int, burst: int = 0) -> None:
        tell = self._ref.tell.tell
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                await tell(i)
            await turn(parts)
        check_told(self, await self._ref.received(), m)


class XoscarContender(_RefWorkloads, Contender):
    key = "xoscar"
    label = "xoscar"
    distribution = "xoscar"
    modules = ("xoscar",)

    async def start(self) -> None:
        import xoscar

        self._xo = xoscar
        self._echo = _actor_class()
        self._pool = await xoscar.create_actor_pool("127.0.0.1", n_process=0)
        self._ref = await self._create()

    async def _create(self) -> Any:
        return await self._xo.create_actor(self._echo, address=self._pool.external_address, uid=f"echo-{next(_ids)}")

    async def stop(self) -> None:
        await self._pool.stop()

    async def live(self, k: int) -> list[Any]:
        refs = await asyncio.gather(*(self._create() for _ in range(k)))
        await asyncio.gather(*(ref.echo(1) for ref in refs))
        return refs

    async def release(self, refs: list[Any]) -> None:
        await asyncio.gather(*(self._xo.destroy_actor(ref) for ref in refs))


class XoscarLocalContender(_RefWorkloads, Contender):
    """xoscar's ``LocalActorRef``: reported, not a bar (see the module rules)."""

    key = "xoscar_local"
    label = "xoscar LocalActorRef"
    distribution = "xoscar"
    modules = ("xoscar",)
    workloads = ("sequential", "callers", "tells")
    bar = False

    def __init__(self, pool: XoscarContender) -> None:
        self._pool_owner = pool

    async def start(self) -> None:  # an actor in the pool ``XoscarContender`` started
        owner = self._pool_owner
        self._ref = await owner._xo.actor_ref(await owner._create())
        if type(self._ref).__name__ != "LocalActorRef":
            raise RuntimeError(f"xoscar gave {type(self._ref).__name__}, not a LocalActorRef, for an actor of this process")
