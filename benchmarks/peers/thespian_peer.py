"""thespian: the ``simpleSystemBase`` actor system (every actor runs in the
caller's thread, inside ``ask``/``tell``).

Rules:
- Messages are ``(kind, value)`` tuples handled by ``receiveMessage``;
  calls are ``ActorSystem.ask(address, message, timeout)``, tells
  ``ActorSystem.tell(address, message)``. The system base is synchronous:
  concurrent callers (asyncio tasks) run their asks one after another.
- Fan-out: ``createActor`` each, ``ask`` each once, then ``tell`` each an
  ``ActorExitRequest``.
"""

from __future__ import annotations

from typing import Any

from .contender import Contender, ECHO, RECEIVED, TELL, bursts, check_told, turn

TIMEOUT = 30.0  # seconds an ask may take before it counts as lost


def _actor_class() -> type:
    from thespian.actors import Actor

    class Echo(Actor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seen = 0

        def receiveMessage(self, message: Any, sender: Any) -> None:
            if type(message) is not tuple:  # the system's own messages
                return
            kind, value = message
            if kind == ECHO:
                self.send(sender, value)
            elif kind == TELL:
                self.seen += 1
            else:
                self.send(sender, self.seen)
                self.seen = 0

    return Echo


class ThespianContender(Contender):
    key = "thespian"
    label = "thespian simpleSystemBase"
    distribution = "thespian"
    modules = ("thespian",)

    async def start(self) -> None:
        from thespian.actors import ActorExitRequest, ActorSystem

        self._exit = ActorExitRequest
        self._system = ActorSystem("simpleSystemBase")
        self._echo = _actor_class()
        self._address = self._system.createActor(self._echo)

    async def stop(self) -> None:
        self._system.shutdown()

    def _ask(self, address: Any, message: Any) -> Any:
        reply = self._system.ask(address, message, TIMEOUT)
        if reply is None:
            raise RuntimeError(f"thespian: no reply to {message!r} within {TIMEOUT} s")
        return reply

    async def sequential(self, n: int) -> None:
        ask = self._system.ask
        address = self._address
        for i in range(n):
            ask(address, (ECHO, i), TIMEOUT)
        self._ask(address, (ECHO, n))  # every reply came (thespian gives None for a lost one)

    async def live(self, k: int) -> list[Any]:
        addresses = [self._system.createActor(self._echo) for _ in range(k)]
        for address in addresses:
            self._ask(address, (ECHO, 1))
        return addresses

    async def release(self, addresses: list[Any]) -> None:
        for address in addresses:
            self._system.tell(address, self._exit())

    async def tells(self, m: int, burst: int = 0) -> None:
        tell = self._system.tell
        address = self._address
        parts = bursts(m, burst)
        for part in parts:
            for i in part:
                tell(address, (TELL, i))
            await turn(parts)
        check_told(self, self._ask(address, (RECEIVED, None)), m)
