"""ResourceSlices: the node's pool as resource.k8s.io/v1 objects, published and kept current.

Rules (SPEC section 21):
- One pool per node, named by the node, in one ResourceSlice named
  ``<node>-<driver>`` (``slice_name``; ``resourceSliceCount`` 1) with ``nodeName`` the node
  and one device per ``DraCatalog`` device: its attributes and capacity
  ``memory``; a ``shared`` device (``--sharing=mps``) with
  ``allowMultipleAllocations: true`` and the consumable capacity
  ``memory`` and ``compute`` with their request policies (``capacity_of``),
  narrowed to the limits of its live shares (``shares``, the publisher's
  ``LiveShares``: a change publishes again). ``render_slice`` is pure: the same inputs give an equal object.
- A slice name is a DNS subdomain of at most 253 characters, for any node
  name (itself a DNS subdomain of up to 253): when ``<node>-<driver>`` is
  longer, the name is its first characters, ``-`` and 16 hex digits of
  the SHA-256 of node and driver (stable across restarts, different for
  two nodes that share the kept prefix).
- A device whose unit another front door of the node holds in the node
  ledger (``elsewhere``: SPEC R-NL-4) is left out of the slice: the
  scheduler must not allocate it to a claim; it is published again once
  the ledger shows it free.
- An unhealthy device keeps its place and carries one taint
  ``<driver>/unhealthy`` (effect ``NoSchedule``: no new claim gets it; the
  value is the reason as a label value), the v1 API's way (the
  ``DRADeviceTaints`` gate) rather than withdrawing it; a device that
  recovers (health or the operator's ``mark_healthy``) is published again
  without the taint.
- ``SlicePublisher.publish(unhealthy, elsewhere)`` makes the API server hold exactly
  this driver's slice of the node: it lists the slices of this node and
  driver (field selectors ``spec.nodeName``, ``spec.driver``); when its
  own is missing, differs from what it would write (compared on what the
  driver says, never on what the server adds: a taint's ``timeAdded``), or
  was never written by this process (a start), it creates or replaces it
  with the next pool generation (one above any it finds and any it wrote:
  the scheduler trusts the highest); it deletes every other slice of this
  node and driver (stale ones, e.g. an older naming). A slice that is as
  wanted is left alone: no write. A failed request raises
  ``SlicePublishError`` naming the API server's answer; the caller retries
  (the content is recomputed each time, so a retry publishes the newest
  state).
- R-DR-1, the slice follows the API server: ``keep_published`` publishes
  at start, after every change of the allocator's health or of what other
  front doors hold in the node ledger (``offer_views``; the driver
  re-reads the ledger each ``--poll_interval``), and after every
  change to this node's and driver's slices that this driver did not make
  -- a deletion (a kubelet restart deletes every slice of its node; an
  admin), an edit, another slice appearing -- seen by a watch from the
  last list on (``is_foreign``: its own writes' echoes are recognised by
  resourceVersion). Each watch lasts ``resync_s`` (60 s) and is followed
  by a list, so a watch that died quietly costs at most that; a failed
  watch or publish is retried with a backoff (1 s doubling to
  ``retry_max_s``), never fatal, and the driver never needs a restart for
  the scheduler to see its GPUs again.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import deque
from collections.abc import Collection, Mapping
from typing import Any

from actors.mig import Unit
from runtime import Failure

from ._devices import DraCatalog
from ._kube import api_failure
from ._sharing import capacity_of, parse_quantity

__all__ = ["SlicePublisher", "SlicePublishError", "keep_published", "render_slice", "slice_name", "taint_key",
           "TAINT_EFFECT"]

logger = logging.getLogger(__name__)

TAINT_EFFECT = "NoSchedule"
MAX_NAME = 253
"""The longest object name the API server takes (a DNS subdomain)."""


class SlicePublishError(Failure):
    """A ResourceSlice request failed; the message names the API server's answer."""


def slice_name(node: str, driver: str) -> str:
    """``<node>-<driver>``, shortened with a digest when longer than ``MAX_NAME`` (see module rules)."""
    name = f"{node}-{driver}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node}\0{driver}".encode()).hexdigest()[:16]
    return f"{name[:MAX_NAME - len(digest) - 1].rstrip('.-')}-{digest}"


def taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


def _label_value(reason: str) -> str:
    """A reason as a label value (63 characters of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", reason)[:63].strip("-._")
    return value or "unhealthy"


def render_slice(catalog: DraCatalog, *, driver: str, node: str, generation: int,
                 unhealthy: Mapping[Unit, str], elsewhere: Collection[Unit] = (),
                 shares: Mapping[str, Any] | None = None) -> Any:
    """The node's ResourceSlice (a lightkube model; see module rules)."""
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.models.resource_v1 import (Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool,
                                              ResourceSliceSpec)
    from lightkube.resources.resource_v1 import ResourceSlice

    devices = []
    for device in catalog.devices:
        if device.unit in elsewhere:
            continue
        reason = unhealthy.get(device.unit)
        devices.append(Device(
            name=device.name,
            attributes={name: DeviceAttribute(**{kind: value}) for name, (kind, value) in device.attributes.items()},
            capacity={name: DeviceCapacity.from_dict(value)
                      for name, value in capacity_of(device.memory_mib, "mps" if device.shared else "none",
                                                     (shares or {}).get(device.name),
                                                     catalog.mps_replicas).items()},
            allowMultipleAllocations=True if device.shared else None,
            taints=[DeviceTaint(key=taint_key(driver), value=_label_value(reason), effect=TAINT_EFFECT)]
            if reason is not None else None,
        ))
    return ResourceSlice(
        apiVersion="resource.k8s.io/v1", kind="ResourceSlice",
        metadata=ObjectMeta(name=slice_name(node, driver)),
        spec=ResourceSliceSpec(driver=driver, nodeName=node, devices=devices,
                               pool=ResourcePool(name=node, generation=generation, resourceSliceCount=1)),
    )


def _essence(resource_slice: Any) -> dict:
    """What this driver says in a slice, and nothing the API server adds (a taint's ``timeAdded``, defaults):
    the one comparison that decides whether the stored slice is the driver's, so a server that fills in
    fields never makes the driver rewrite its slice in a loop."""
    spec = resource_slice.to_dict()["spec"]
    devices = [(device["name"], device.get("attributes") or {}, _quantities(device.get("capacity") or {}),
                [(t["key"], t.get("value", ""), t["effect"]) for t in device.get("taints") or []],
                bool(device.get("allowMultipleAllocations")))
               for device in spec.get("devices") or []]
    pool = spec.get("pool") or {}
    return {"driver": spec.get("driver"), "nodeName": spec.get("nodeName"), "devices": devices,
            "pool": (pool.get("name"), pool.get("generation"), pool.get("resourceSliceCount"))}


def _quantities(value: Any) -> Any:
    """Capacity with every quantity as its number: the API server stores a quantity in its canonical form
    (``81920Mi`` comes back ``80Gi``), which is no change of the driver's."""
    if isinstance(value, dict):
        return {key: _quantities(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_quantities(item) for item in value]
    try:
        return parse_quantity(value)
    except ValueError:
        return value


class SlicePublisher:
    """Publishes the node's slice through a lightkube client (see module rules)."""

    def __init__(self, client: Any, catalog: DraCatalog, *, driver: str, node: str, shares: Any = None) -> None:
        self.client = client
        self.shares = shares
        """``LiveShares`` (``--sharing=mps``): the slice follows the limits of the prepared shares."""
        self.catalog = catalog
        self.driver = driver
        self.node = node
        self.name = slice_name(node, driver)
        self.generation = 0
        """The pool generation this driver last wrote (0: none yet)."""
        self.listed: str | None = None
        """The resourceVersion of the last list: where a watch of this node's slices starts."""
        self._written: deque[str] = deque(maxlen=8)

    @property
    def selector(self) -> dict[str, str]:
        """The field selector of this node's and driver's slices."""
        return {"spec.nodeName": self.node, "spec.driver": self.driver}

    async def publish(self, unhealthy: Mapping[Unit, str], elsewhere: Collection[Unit] = ()) -> bool:
        """Make the API server hold exactly this driver's current slice of the node; True when it wrote."""
        try:
            return await self._reconcile(unhealthy, elsewhere)
        except Exception as error:  # noqa: BLE001 - the API server's answer or the transport's, in one line
            raise SlicePublishError(f"Cannot publish ResourceSlice {self.name}: {_failure(error)}") from error

    async def _reconcile(self, unhealthy: Mapping[Unit, str], elsewhere: Collection[Unit]) -> bool:
        from lightkube.resources.resource_v1 import ResourceSlice

        listing = self.client.list(ResourceSlice, fields=self.selector)
        found = [s async for s in listing]
        self.listed = _version_of(listing)
        ours = next((s for s in found if s.metadata.name == self.name), None)
        wanted = render_slice(self.catalog, driver=self.driver, node=self.node, generation=self.generation,
                              unhealthy=unhealthy, elsewhere=elsewhere, shares=self._live())
        wrote, first = False, not self._written
        if ours is None or not self.generation or _essence(ours) != _essence(wanted):
            highest = [s.spec.pool.generation for s in found if s.spec.pool is not None and s.spec.pool.name == self.node]
            self.generation = max(highest + [self.generation]) + 1
            wanted = render_slice(self.catalog, driver=self.driver, node=self.node, generation=self.generation,
                                  unhealthy=unhealthy, elsewhere=elsewhere, shares=self._live())
            if ours is None:
                stored = await self.client.create(wanted)
            else:
                wanted.metadata.resourceVersion = ours.metadata.resourceVersion
                stored = await self.client.replace(wanted)
            self._written.append(stored.metadata.resourceVersion)
            wrote = True
            self._log(("created" if ours is None else "replaced") if first else
                      "published again: it was gone from the API server (a kubelet restart deletes its node's"
                      " slices)" if ours is None else "replaced", unhealthy, elsewhere)
        for stale in found:
            if stale.metadata.name != self.name:
                await self.client.delete(ResourceSlice, stale.metadata.name)
                wrote = True
                logger.info("Deleted the stale ResourceSlice %s of node %s, driver %s", stale.metadata.name,
                            self.node, self.driver)
        return wrote

    def _live(self) -> dict[str, Any]:
        return dict(self.shares.limits) if self.shares is not None else {}

    def is_foreign(self, kind: str, resource_slice: Any) -> bool:
        """Whether a watch event shows a change this driver did not make (see module rules)."""
        if resource_slice.metadata.name != self.name:
            return kind != "DELETED"  # another slice of this node and driver appeared: stale, to delete
        return kind == "DELETED" or resource_slice.metadata.resourceVersion not in self._written

    def _log(self, what: str, unhealthy: Mapping[Unit, str], elsewhere: Collection[Unit]) -> None:
        tainted = [d.name for d in self.catalog.devices if d.unit in unhealthy and d.unit not in elsewhere]
        left_out = [d.name for d in self.catalog.devices if d.unit in elsewhere]
        logger.info("ResourceSlice %s %s: pool %s generation %d, %d devices, tainted: %s%s", self.name, what,
                    self.node, self.generation, len(self.catalog.devices) - len(left_out),
                    ", ".join(tainted) or "none",
                    f"; left out (held by another front door of this node): {', '.join(left_out)}" if left_out
                    else "")


def _failure(error: BaseException) -> str:
    """``api_failure`` for what the API server or the transport raised; anything else by its type."""
    import httpx2
    from lightkube import ApiError

    if isinstance(error, (ApiError, httpx2.HTTPError, OSError)):
        return api_failure(error)
    return f"{type(error).__name__}: {error}"


def _version_of(listing: Any) -> str | None:
    """The resourceVersion a list was read at (None if the server gave none)."""
    from lightkube.core.exceptions import NotReadyError

    try:
        return listing.resourceVersion
    except NotReadyError:
        return None


class _Wanted:
    """What the publishing loop is asked to do: the newest view (health, the node ledger), and a wake-up
    (coalesced)."""

    def __init__(self) -> None:
        import anyio

        self.view: Any = None
        self.wake = anyio.Event()
        self.first = anyio.Event()

    def changed(self) -> None:
        self.wake.set()


async def keep_published(publisher: SlicePublisher, allocator: Any, *, retry_max_s: float = 8.0,
                         published: Any = None, resync_s: float = 60.0) -> None:
    """Publish now, then after every change of health or of the node ledger and every change someone else
    makes to this node's slices, until cancelled (``published``: called after each write; see module rules)."""
    import anyio

    wanted = _Wanted()
    if publisher.shares is not None:  # the slice follows the prepared shares' limits
        publisher.shares.watch(wanted.changed)
    async with anyio.create_task_group() as group:
        group.start_soon(_follow_view, allocator, wanted)
        group.start_soon(_follow_api_server, publisher, wanted, resync_s, retry_max_s)
        while True:
            await wanted.wake.wait()
            wanted.wake = anyio.Event()
            if wanted.view is None:
                continue
            backoff = 1.0
            while True:
                view = wanted.view
                try:
                    if await publisher.publish(view.unhealthy, view.elsewhere) and published is not None:
                        published()
                    wanted.first.set()
                    break
                except SlicePublishError as error:
                    logger.warning("%s; trying again in %gs", error, backoff)
                    await anyio.sleep(backoff)
                    backoff = min(retry_max_s, backoff * 2)


async def _follow_view(allocator: Any, wanted: _Wanted) -> None:
    """Wake the publishing loop when what the slice shows changes: the health, or which units other front doors
    hold (not who holds them for whom: that changes with their churn, the slice does not)."""
    from .._ledger_watch import offer_views

    shown = None
    async for view in offer_views(allocator):
        now = (view.unhealthy, frozenset(view.elsewhere))
        if now != shown:
            shown = now
            wanted.view = view
            wanted.changed()


async def _follow_api_server(publisher: SlicePublisher, wanted: _Wanted, resync_s: float, retry_max_s: float) -> None:
    """Watch this node's and driver's slices from the last list on; a change this driver did not make (a
    deletion by a restarted kubelet, an edit) wakes the publishing loop. Each watch lasts ``resync_s`` and is
    followed by a list (a watch that died quietly costs at most that); a failed watch is retried with a
    backoff, each time after a list."""
    import anyio
    from lightkube.resources.resource_v1 import ResourceSlice

    await wanted.first.wait()
    backoff = 1.0
    while True:
        try:
            with anyio.move_on_after(resync_s + 5):
                async for kind, resource_slice in publisher.client.watch(
                        ResourceSlice, fields=publisher.selector, resource_version=publisher.listed,
                        server_timeout=max(1, int(resync_s))):
                    backoff = 1.0
                    if publisher.is_foreign(kind, resource_slice):
                        logger.info("ResourceSlice %s of node %s %s by someone else: checking it", 
                                    resource_slice.metadata.name, publisher.node,
                                    "deleted" if kind == "DELETED" else "added" if kind == "ADDED" else "changed")
                        wanted.changed()
            wanted.changed()  # a list after every watch period
        except Exception as error:  # noqa: BLE001 - the API server's answer or the transport's
            logger.warning("Watching the ResourceSlices of node %s failed (%s); listing them again and watching"
                           " in %gs", publisher.node, api_failure(error), backoff)
            wanted.changed()
            await anyio.sleep(backoff)
            backoff = min(retry_max_s, backoff * 2)
