"""PodLeases: the device plugin's units in the node ledger, taken at Allocate and returned when no pod holds them.

Rules (SPEC R-NL-2..4):
- The plugin is one owner, ``kubelet-plugin:nvidia.com/gpu``
  (``PLUGIN_OWNER``), whatever the MIG strategy: one process, one
  allocator, one owner lock. Under ``mixed`` its ``nvidia.com/mig-<profile>``
  resources are the same owner's (the holders name the resource). A name
  that followed the strategy or the node's MIG layout would change with a
  reconfiguration, and the leases of the run before it would wait for an
  owner that never comes back.
- Holders: at ``Allocate`` the plugin does not know the pod; the units of
  each container request are held by ``allocate <resource> <IDs>``
  (``allocation_holder``: the request's device IDs, sorted; a digest of
  them past ``MAX_KEY`` characters), taken with ``allocator.hold`` before
  the answer, all requests of the call or none; a unit another front door
  holds refuses the call (``FAILED_PRECONDITION``, naming unit, owner and
  holder: the allocator's text), and the holds it had taken are let go.
- ``reconcile(assigned, started)``, once per pass with that pass's one
  PodResources ``List`` (its start time ``started``): every container the
  kubelet assigns this plugin's IDs holds their units as
  ``<namespace>/<pod>/<container>`` (taken first, so no unit is ever
  free between two holders); a pod holder no longer listed lets go; an
  Allocate holder lets go once the List shows all its IDs (a pod holds
  them now) or once a List that began ``grace_s`` (``ALLOCATE_GRACE_S``)
  after its answer does not (the kubelet records an allocation as
  ``Allocate`` answers; one it never recorded -- a pod admission that
  failed -- goes back). A unit no holder keeps goes back to the ledger
  (the allocator's ``let_go``). The check and the ``let_go`` of each
  holder happen with no ``await`` between (a concurrent ``Allocate`` of
  the same IDs is never let go).
- PodResources naming a unit another front door holds (two grants: the
  ledger was off, an operator released this plugin's units, a lease file
  nobody can read) is logged at ERROR once while it lasts and counted by
  the allocator (``ledger/conflicts``); nothing is taken from the other
  owner, and that container's other units stay held (``hold_the_rest``):
  the pod uses them, so they never go back to be handed out again (SPEC
  R-SH-3).
- At start (the first ``reconcile``: R-NL-3) the holds of every listed
  container come first, then ``release_unclaimed``: units this owner
  leased in its last run that no pod holds go back. Until a ``List``
  answers, those units stay out of the pool.
- Called only from ``KubeletPluginProcess`` (one actor: the state here is
  its own).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from actors.allocator import AllocatorError
from actors.ledger import LedgerError, check_holder, kubelet_plugin_owner
from actors.mig import Unit

from .._errors import FAILED_PRECONDITION, PluginRequestError
from .._ledger_watch import hold_the_rest
from ..pod_repair import AssignedDevices
from ._catalog import DeviceCatalog
from ._names import ALLOCATE_GRACE_S

__all__ = ["MAX_KEY", "PLUGIN_OWNER", "PodLeases", "allocation_holder"]

logger = logging.getLogger(__name__)

PLUGIN_OWNER = kubelet_plugin_owner("nvidia.com/gpu")
"""The device plugin's owner in the node ledger, for every resource it serves (see module rules)."""
MAX_KEY = 256


def allocation_holder(resource: str, ids: Iterable[str]) -> str:
    """``allocate <resource> <ID,ID…>`` (sorted; a digest past ``MAX_KEY`` characters)."""
    ordered = sorted(ids)
    key = f"allocate {resource} {','.join(ordered)}"
    if len(key) <= MAX_KEY:
        return key
    digest = hashlib.sha256(",".join(ordered).encode()).hexdigest()[:16]
    return f"allocate {resource} {ordered[0]}+{len(ordered) - 1} more ({digest})"


class _Allocation:
    __slots__ = ("resource", "ids", "answered")

    def __init__(self, resource: str, ids: tuple[str, ...], answered: float) -> None:
        self.resource = resource
        self.ids = ids
        self.answered = answered


class PodLeases:
    """The device plugin's holders in the node ledger (see module rules)."""

    def __init__(self, catalog: DeviceCatalog, allocator: Any, *, grace_s: float = ALLOCATE_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.allocator = allocator
        self.grace_s = grace_s
        self.clock = clock
        self.allocations: dict[str, _Allocation] = {}
        """Allocate holder -> what it was answered for."""
        self.pods: dict[str, frozenset[Unit]] = {}
        """Pod holder (``namespace/pod/container``) -> the units it holds."""
        self.reconciled = False
        """A List was reconciled (the start's ``release_unclaimed`` ran)."""
        self._said: set[tuple[str, str]] = set()

    # -- Allocate --------------------------------------------------------------------------
    async def take(self, resource: str, requests: Sequence[tuple[Sequence[str], Sequence[Unit]]]) -> None:
        """Hold each container request's units for its Allocate holder, all or none (see module rules)."""
        now = self.clock()
        taken: list[tuple[str, _Allocation]] = []
        futures = []
        for ids, units in requests:
            key = allocation_holder(resource, ids)
            record = _Allocation(resource, tuple(ids), now)
            self.allocations[key] = record
            taken.append((key, record))
            futures.append(self.allocator.hold(units, key))
        refusal: Exception | None = None
        held = []
        for (key, record), future in zip(taken, futures):
            try:
                await future
                held.append((key, record))
            except AllocatorError as error:
                refusal = refusal or error
                if self.allocations.get(key) is record:
                    del self.allocations[key]
        if refusal is None:
            return
        undo = []
        for key, record in held:
            if self.allocations.get(key) is record:
                del self.allocations[key]
                undo.append(self.allocator.let_go(key))
        for future in undo:
            await future
        raise PluginRequestError(FAILED_PRECONDITION, f"{refusal}; nothing was allocated")

    # -- each pass ---------------------------------------------------------------------------
    async def reconcile(self, assigned: Sequence[AssignedDevices], started: float) -> list[str]:
        """Hold what PodResources assigns, let go of the rest (see module rules); the units returned, as text."""
        wanted: dict[str, frozenset[Unit]] = {}
        listed: set[tuple[str, str]] = set()
        for entry in assigned:
            offer = self.catalog.by_resource.get(entry.resource)
            if offer is None:
                continue
            known = [device_id for device_id in dict.fromkeys(entry.ids) if device_id in offer.by_id]
            listed.update((entry.resource, device_id) for device_id in known)
            if not known:
                continue
            holder = f"{entry.namespace}/{entry.pod}/{entry.container}"
            try:
                check_holder(holder)
            except LedgerError as error:
                self._say_once(("holder", holder), f"PodResources names a container this plugin cannot hold its"
                                                   f" units for: {error}")
                continue
            wanted[holder] = wanted.get(holder, frozenset()) | {offer.by_id[i].unit for i in known}
        changes = [(holder, units, self.pods.get(holder, frozenset())) for holder, units in wanted.items()
                   if self.pods.get(holder) != units]
        holds = [(holder, units, before, self.allocator.hold(units, holder)) for holder, units, before in changes]
        narrowed = []
        for holder, units, before, future in holds:
            try:
                await future
            except AllocatorError as error:
                self._say_once(("conflict", holder), f"PodResources says pod container {holder} holds"
                                                     f" {self._named(units)}, but the node ledger refuses them to"
                                                     f" this plugin: {error}. Two front doors granted one GPU; find"
                                                     " which one must give it back")
                units = await hold_the_rest(self.allocator, units, holder)
                if units is None:
                    continue
            else:
                self._said = {key for key in self._said if key != ("conflict", holder)}
            self.pods[holder] = units
            if before - units:
                narrowed.append(self.allocator.let_go(holder, before - units))
        # decided and let go with no await in between: an Allocate meanwhile renews its record first
        going = []
        for key, record in list(self.allocations.items()):
            shown = all((record.resource, device_id) in listed for device_id in record.ids)
            if shown or record.answered <= started - self.grace_s:
                del self.allocations[key]
                going.append(self.allocator.let_go(key))
                if not shown:
                    logger.warning("Allocate of %s for %s was never recorded by the kubelet (PodResources does not"
                                   " name them %gs later): their units go back", ", ".join(record.ids),
                                   record.resource, self.grace_s)
        for holder in [holder for holder in self.pods if holder not in wanted]:
            del self.pods[holder]
            going.append(self.allocator.let_go(holder))
        returned: set[Unit] = set()
        for future in [*narrowed, *going]:
            returned |= await future
        if returned:
            logger.info("No pod holds %s any more: returned to the node ledger", self._named(returned))
        texts = [self.catalog.uuids.get(unit, str(unit)) for unit in sorted(returned)]
        if not self.reconciled:
            self.reconciled = True
            unclaimed = await self.allocator.release_unclaimed()
            if unclaimed:
                logger.info("Reconciled with PodResources: units leased by the last run that no pod holds went back"
                            " to the node ledger: %s", ", ".join(unclaimed))
            texts += unclaimed
        return texts

    def _named(self, units: Iterable[Unit]) -> str:
        return ", ".join(f"{self.catalog.uuids.get(unit, unit)} ({unit})" for unit in sorted(units))

    def _say_once(self, key: tuple[str, str], message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.error("%s", message)
