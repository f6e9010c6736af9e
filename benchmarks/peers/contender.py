"""Contender: one actor framework under test, and the four workloads it runs.

Rules:
- A contender is started once (``start``) and stopped once (``stop``) in
  the benchmark's asyncio loop; between the two it runs the workloads
  named in ``workloads`` as often as asked. Each workload is the
  framework's own fastest public way of doing the job, written the way
  its documentation shows, with the same work per message: ``echo``
  returns its argument, ``tell`` counts, ``received`` returns the count
  since the last ``received`` (and starts it again).
- ``sequential(n)``: one caller, ``n`` round trips one after another.
  ``callers(n, width)``: ``width`` concurrent callers sharing ``n`` round
  trips (each doing ``n // width``). ``fan_out(k)``: ``k`` fresh actors
  are spawned and each called once (``live``), then all are stopped and
  awaited (``release``). ``tells(m, burst)``: ``m`` fire-and-forget
  messages to one actor, in bursts of ``burst`` with a loop turn after
  each (``bursts``; 0: all at once), then one call to ``received`` to
  sync; a count other than ``m`` is an error (``check_told``), never a
  figure.
- A contender that has ``live`` gets a peak-RSS-per-live-actor figure
  (``memory``), whether or not it runs the fan-out.
- ``missing()`` says why a contender cannot run here (a module not
  installed) or None; ``version()`` is its distribution's version.
- ``bar``: whether its ratios are held to the issue's bars (a reported-only
  contender, such as xoscar's ``LocalActorRef`` direct call, is not).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
from typing import Any

WORKLOADS = ("sequential", "callers", "fan_out", "tells")
ECHO, TELL, RECEIVED = "echo", "tell", "received"  # what a message-only framework's messages say
INSTALL_HINT = "pip install -e '.[bench]'"


class Contender:
    """One framework under test (see the module rules)."""

    key = ""
    label = ""
    distribution: str | None = None  # the PyPI distribution whose version is reported
    modules: tuple[str, ...] = ()  # what must import for it to run
    workloads: tuple[str, ...] = WORKLOADS
    bar = True

    def missing(self) -> str | None:
        for module in self.modules:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed ({INSTALL_HINT})"
        return None

    def version(self) -> str | None:
        if self.distribution is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def title(self) -> str:
        version = self.version()
        return f"{self.label} {version}" if version else self.label

    async def start(self) -> None:
        """Bring the framework up and spawn the actor the workloads call."""

    async def stop(self) -> None:
        """Stop every actor and the framework."""

    async def sequential(self, n: int) -> None:
        raise NotImplementedError

    async def callers(self, n: int, width: int) -> None:
        """``width`` concurrent ``sequential`` callers (frameworks whose
        sequential loop blocks override this with their own concurrency)."""
        await asyncio.gather(*(self.sequential(n // width) for _ in range(width)))

    async def live(self, k: int) -> Any:
        """Spawn ``k`` actors and call each once; what ``release`` stops."""
        raise NotImplementedError

    async def release(self, actors: Any) -> None:
        """Stop the actors ``live`` gave and wait until they are gone."""
        raise NotImplementedError

    def spawns_actors(self) -> bool:
        """Whether it has ``live`` (and so a memory figure per live actor)."""
        return type(self).live is not Contender.live

    async def fan_out(self, k: int) -> None:
        await self.release(await self.live(k))

    async def tells(self, m: int, burst: int = 0) -> None:
        raise NotImplementedError


def bursts(m: int, burst: int) -> list[range]:
    """The indices of ``m`` tells in bursts of ``burst`` (0, or ``m`` or
    more: one burst); a contender's ``tells`` sends each burst, then
    ``await turn(parts)``."""
    step = burst if 0 < burst < m else max(m, 1)
    return [range(i, min(m, i + step)) for i in range(0, m, step)]


async def turn(parts: list[range]) -> None:
    """Between bursts, one loop turn (the actor drains what came); none
    when all the tells are one burst."""
    if len(parts) > 1:
        await asyncio.sleep(0)


def check_told(contender: Contender, told: Any, m: int) -> None:
    """A tells run counts only when the actor received every message."""
    if told != m:
        raise RuntimeError(f"{contender.key}: the actor received {told!r} of {m} tells")
