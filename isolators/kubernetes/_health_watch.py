"""health_snapshots: the allocator's health, now and after every change, as an async iterator.

Rules (R-K8-2; SPEC section 21):
- ``health_snapshots(allocator)`` yields the allocator's ``HealthSnapshot``
  at once, then one after every change of its health generation (a unit
  turning unhealthy, the node's health unknown, a unit marked healthy
  again). A consumer that stops (a cancelled stream: the kubelet's side
  gone) discards the allocator Future it waited on.
- The DRA driver's ``NodeWatchResources`` reads it; what a front door may
  offer (health and the node ledger together: the device plugin's
  ``ListAndWatch``, the DRA driver's ResourceSlice) is ``_ledger_watch``'s
  ``offer_views``.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

__all__ = ["health_snapshots"]


async def health_snapshots(allocator: Any) -> AsyncIterator[Any]:
    """The allocator's health now, then after every change (see module rules)."""
    generation = None
    while True:
        future = allocator.health_since(generation)
        try:
            snapshot = await future
        except BaseException:
            future.discard()
            raise
        generation = snapshot.generation
        yield snapshot
