"""The hand-written baseline: an ``asyncio.Queue`` and one serving task per actor.

Rules:
- A message is ``(method, argument, future)``: the serving task calls
  ``method(argument)`` and, when ``future`` is not None (a call, not a
  tell), sets its result or its exception. ``(None, None, None)`` ends the
  task.
- The actor's API is the leanest one it can have, the same shape as the
  runtime's: ``call(method, argument)`` puts the message with a fresh loop
  future and returns that future (as ``dispatch`` returns a Future), the
  caller awaits it; ``tell(method, argument)`` puts it without one (as
  ``send`` does). Each side pays one plain call per message for its API,
  nothing more. Stopping an actor: the end message, then awaiting its task.
- The inline variant (``QueueInlineContender``, tells only) is the leanest
  queue actor: its serving task counts a tell itself (no method call per
  tell) and takes what is already queued with ``get_nowait`` (no
  coroutine per message); the sender puts ``(None, argument, None)``
  with ``put_nowait`` straight from its loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .contender import Contender, bursts, check_told, turn

_END = (None, None, None)


class Handler:
    """What a queue actor does per message (the same as the other contenders' actors)."""

    def __init__(self) -> None:
        self.seen = 0

    def echo(self, value: Any) -> Any:
        return value

    def tell(self, _value: Any) -> None:
        self.seen += 1

    def received(self, _value: Any = None) -> int:
        seen, self.seen = self.seen, 0
        return seen


async def serve(queue: asyncio.Queue) -> None:
    get = queue.get
    while True:
        method, argument, future = await get()
        if method is None:
            return
        try:
            result = method(argument)
        except Exception as e:  # an actor outlives a failing message
            if future is not None:
                future.set_exception(e)
            continue
        if future is not None:
            future.set_result(result)


async def serve_inline(queue: asyncio.Queue, handler: Handler) -> None:
    """The leanest queue actor's loop (see the module rules)."""
    get, get_nowait, qsize = queue.get, queue.get_nowait, queue.qsize
    while True:
        method, argument, future = await get()
        while True:
            if future is None:
                if method is None and argument is None:
                    return
                handler.seen += 1  # a tell, handled here
            else:
                future.set_result(method(argument))
            if not qsize():
                break
            method, argument, future = get_nowait()


class QueueActor:
    """One actor: its queue, its task and its handler."""

    __slots__ = ("queue", "task", "handler", "_put", "_create_future")

    def __init__(self, loop_of: Any = None) -> None:
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handler = Handler()
        if loop_of is None:
            self.task = loop.create_task(serve(self.queue))
        else:
            self.task = loop.create_task(loop_of(self.queue, self.handler))
        self._put = self.queue.put_nowait
        self._create_future = loop.create_future

    def call(self, method: Any, argument: Any = None) -> asyncio.Future:
        future = self._create_future()
        self._put((method, argument, future))
        return future

    def tell(self, method: Any, argument: Any = None) -> None:
        self._put((method, argument, None))

    async def stop(self) -> None:
        self._put(_END)
        await self.task


class QueueContender(Contender):
    key = "queue"
    label = "asyncio.Queue actor"

    async def start(self) -> None:
        self._actor = QueueActor()

    async def stop(self) -> None:
        await self._actor.stop()

    async def sequential(self, n: int) -> None:
        call = self._actor.call
        echo = self._actor.handler.echo
        for i in range(n):
            await call(echo, i)

    async def live(self, k: int) -> list[QueueActor]:
        actors = [QueueActor() for _ in range(k)]
        await asyncio.gather(*(actor.call(actor.handler.echo, 1) for actor in actors))
        return actors

    async def release(self, actors: list[QueueActor]) -> None:
        for actor in actors:
            actor.queue.put_nowait(_END)
        await asyncio.gather(*(actor.task for actor in actors))

    async def tells(self, m: int, burst: int = 0) -> None:
        actor = self._actor
        tell = actor.tell
        method = actor.handler.tell
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                tell(method, i)
            await turn(parts)
        check_told(self, await actor.call(actor.handler.received), m)


class QueueInlineContender(QueueContender):
    """The leanest queue actor, for the tells (see the module rules)."""

    key = "queue_inline"
    label = "asyncio.Queue actor, tells inline"
    workloads = ("tells",)

    async def start(self) -> None:
        self._actor = QueueActor(serve_inline)

    async def tells(self, m: int, burst: int = 0) -> None:
        actor = self._actor
        put = actor.queue.put_nowait
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                put((None, i, None))
            await turn(parts)
        check_told(self, await actor.call(actor.handler.received), m)
