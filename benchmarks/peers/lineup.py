"""The contenders, in the order the table lists them.

Rules:
- ``lineup()`` builds one of each: the runtime first (the others' ratios
  are to it), the Queue actors (calling a method per message, and the
  leanest one, handling a tell inline), the peer frameworks, then the reported-only
  variants (the runtime's dispatch as a tell, xoscar's ``LocalActorRef``),
  which live in the runtime and the pool their owners started.
- ``pick(contenders, keys)`` keeps the ones named (the runtime always:
  every ratio is to it; an owner with its variant).
"""

from __future__ import annotations

from .compactor_peer import CompactorContender
from .contender import Contender
from .ours import DispatchTells, RuntimeContender
from .pykka_peer import PykkaContender
from .queue_actor import QueueContender, QueueInlineContender
from .thespian_peer import ThespianContender
from .xoscar_peer import XoscarContender, XoscarLocalContender


def lineup() -> list[Contender]:
    xoscar = XoscarContender()
    return [RuntimeContender(), QueueContender(), QueueInlineContender(), PykkaContender(), xoscar, ThespianContender(),
            CompactorContender(), DispatchTells(), XoscarLocalContender(xoscar)]


OWNERS = {"runtime_dispatch": "runtime", "xoscar_local": "xoscar"}


def pick(contenders: list[Contender], keys: set[str] | None) -> list[Contender]:
    if keys is None:
        return contenders
    wanted = set(keys) | {"runtime"} | {OWNERS[k] for k in keys if k in OWNERS}
    return [c for c in contenders if c.key in wanted]
