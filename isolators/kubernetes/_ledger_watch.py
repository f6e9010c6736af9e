"""offer_views: what a Kubernetes front door may offer, now and after every change (health and the node ledger).

Rules (SPEC R-NL-4, R-K8-2; section 21):
- ``OfferView`` is one view of the units a front door must not offer as
  free: ``unhealthy`` (unit -> reason, the allocator's health) and
  ``elsewhere`` (unit -> the ``LeaseConflict`` of the lease in the way:
  another front door of the node holds it, or holds its MIG devices or
  its parent GPU). ``withheld()`` is both in one mapping (unit -> why),
  health first.
- ``offer_views(allocator)`` yields a view at once, then one after every
  change of either: the allocator's health generation
  (``health_since``) or, once its allocator joined the node ledger, what
  other owners hold (``ledger_since``). Each change is one view (two at
  once may come as one). Without a ledger ``elsewhere`` stays empty. A
  consumer that stops (a cancelled stream) discards the allocator Futures
  it waited on.
- The ledger link learns what other owners hold only when it reads the
  ledger: a front door calls ``refresh_ledger_every(allocator,
  interval_s)`` (or ``refresh_ledger()`` once per pass of its own), so a
  unit another front door takes or returns shows within one pass. It
  returns at once when the ledger is off; a failed re-read is logged
  once while it fails the same way (the view stays as last read; the
  next re-read tries again).
- The device plugin's ``ListAndWatch`` (a withheld unit is ``Unhealthy``)
  and the DRA driver's ResourceSlice (a unit held elsewhere is left out,
  an unhealthy one tainted) read it.
- ``hold_the_rest(allocator, units, holder)``: after the ledger refused
  ``holder`` its ``units`` (another owner keeps one: two grants, a lease
  nobody can read), the holder holds those no other owner keeps, so a
  pod or claim in use never loses the units it does have to be handed
  out again (SPEC R-SH-3); what it holds now, or None (none, or the
  ledger changed meanwhile: the caller's next pass tries again).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, AsyncIterator

import anyio

from actors.ledger import LeaseConflict
from actors.mig import Unit

__all__ = ["OfferView", "hold_the_rest", "offer_views", "refresh_ledger_every"]

logger = logging.getLogger(__name__)


class OfferView:
    """Units a front door must not offer as free, and why (see module rules)."""

    __slots__ = ("unhealthy", "elsewhere")

    def __init__(self, unhealthy: Mapping[Unit, str], elsewhere: Mapping[Unit, LeaseConflict]) -> None:
        self.unhealthy = dict(unhealthy)
        self.elsewhere = dict(elsewhere)

    def withheld(self) -> dict[Unit, str]:
        """Unit -> why it is not offered as free (its health first, then who holds it)."""
        why = {unit: f"held by another front door: {conflict.describe()}" for unit, conflict in self.elsewhere.items()}
        why.update(self.unhealthy)
        return why

    def __repr__(self) -> str:
        return (f"OfferView(unhealthy {sorted(map(str, self.unhealthy))},"
                f" elsewhere {sorted(map(str, self.elsewhere))})")


async def offer_views(allocator: Any) -> AsyncIterator[OfferView]:
    """The view now, then after every change of health or of the node ledger (see module rules)."""
    wake = [anyio.Event()]

    def poke(_future: Any) -> None:
        wake[0].set()

    ledger = await allocator.ledger_state()
    health = allocator.health_since(None)
    health.on_any(poke)
    leases = allocator.ledger_since(None) if ledger is not None else None
    if leases is not None:
        leases.on_any(poke)
    unhealthy: Mapping[Unit, str] = {}
    elsewhere: Mapping[Unit, LeaseConflict] = {}
    seen_health = False
    seen_leases = leases is None
    try:
        while True:
            await wake[0].wait()
            wake[0] = anyio.Event()  # before looking: a Future done from now on sets the new one
            changed = False
            if not health.is_pending():
                snapshot = await health
                unhealthy, seen_health, changed = snapshot.unhealthy, True, True
                health = allocator.health_since(snapshot.generation)
                health.on_any(poke)
            if leases is not None and not leases.is_pending():
                state = await leases
                elsewhere, seen_leases, changed = state.elsewhere, True, True
                leases = allocator.ledger_since(state.generation)
                leases.on_any(poke)
            if changed and seen_health and seen_leases:  # the first view has both
                yield OfferView(unhealthy, elsewhere)
    finally:
        health.discard()
        if leases is not None:
            leases.discard()


async def refresh_ledger_every(allocator: Any, interval_s: float) -> None:
    """Read the node ledger again every ``interval_s`` seconds until cancelled (see module rules)."""
    if await allocator.ledger_state() is None:
        return
    failing: str | None = None
    while True:
        try:
            await allocator.refresh_ledger()
        except Exception as error:  # noqa: BLE001 - said once; the view stays as last read
            text = f"{type(error).__name__}: {error}"
            if text != failing:
                logger.error("Reading the node ledger again failed (%s); trying again every %gs", text, interval_s)
            failing = text
        else:
            if failing is not None:
                logger.info("The node ledger reads again")
            failing = None
        await anyio.sleep(interval_s)


async def hold_the_rest(allocator: Any, units: frozenset[Unit], holder: str) -> frozenset[Unit] | None:
    """``holder`` holds those of ``units`` no other owner keeps (see module rules)."""
    from actors.allocator import AllocatorError

    state = await allocator.ledger_state()
    rest = frozenset(units) - set(state.elsewhere) if state is not None else frozenset()
    if not rest:
        return None
    try:
        await allocator.hold(rest, holder)
    except AllocatorError:
        return None
    return rest
