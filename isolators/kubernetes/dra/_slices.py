"""ResourceSlices: the node's pool as resource.k8s.io/v1 objects, published and kept current.

Rules (SPEC section 21):
- One pool per node, named by the node, in one ResourceSlice named
  ``<node>-<driver>`` (``resourceSliceCount`` 1) with ``nodeName`` the node
  and one device per ``DraCatalog`` device: its attributes and capacity
  ``memory``. ``render_slice`` is pure: the same inputs give an equal object.
- An unhealthy device keeps its place and carries one taint
  ``<driver>/unhealthy`` (effect ``NoSchedule``: no new claim gets it; the
  value is the reason as a label value), the v1 API's way (the
  ``DRADeviceTaints`` gate) rather than withdrawing it; a device that
  recovers (health or the operator's ``mark_healthy``) is published again
  without the taint.
- ``SlicePublisher.publish(unhealthy)``: at start it lists the slices of
  this node and driver (field selectors ``spec.nodeName``, ``spec.driver``),
  takes the next pool generation (one above any it finds: the scheduler
  trusts the highest), creates or replaces its own slice and deletes every
  other slice of this node and driver (stale ones, e.g. an older naming);
  later calls replace the slice with the generation bumped, only when the
  devices changed. A failed request raises ``SlicePublishError`` naming
  the API server's answer; the caller retries (the content is recomputed
  each time, so a retry publishes the newest state).
- ``keep_published`` publishes at start and after every change of the
  allocator's health; a failure is retried with a backoff, never fatal.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from actors.mig import Unit
from runtime import Failure

from ._devices import DraCatalog
from ._kube import api_failure

__all__ = ["SlicePublisher", "SlicePublishError", "keep_published", "render_slice", "slice_name", "taint_key",
           "TAINT_EFFECT"]

logger = logging.getLogger(__name__)

TAINT_EFFECT = "NoSchedule"


class SlicePublishError(Failure):
    """A ResourceSlice request failed; the message names the API server's answer."""


def slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}"


def taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


def _label_value(reason: str) -> str:
    """A reason as a label value (63 characters of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", reason)[:63].strip("-._")
    return value or "unhealthy"


def render_slice(catalog: DraCatalog, *, driver: str, node: str, generation: int,
                 unhealthy: Mapping[Unit, str]) -> Any:
    """The node's ResourceSlice (a lightkube model; see module rules)."""
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.models.resource_v1 import (Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool,
                                              ResourceSliceSpec)
    from lightkube.resources.resource_v1 import ResourceSlice

    devices = []
    for device in catalog.devices:
        reason = unhealthy.get(device.unit)
        devices.append(Device(
            name=device.name,
            attributes={name: DeviceAttribute(**{kind: value}) for name, (kind, value) in device.attributes.items()},
            capacity={"memory": DeviceCapacity(value=f"{device.memory_mib}Mi")},
            taints=[DeviceTaint(key=taint_key(driver), value=_label_value(reason), effect=TAINT_EFFECT)]
            if reason is not None else None,
        ))
    return ResourceSlice(
        apiVersion="resource.k8s.io/v1", kind="ResourceSlice",
        metadata=ObjectMeta(name=slice_name(node, driver)),
        spec=ResourceSliceSpec(driver=driver, nodeName=node, devices=devices,
                               pool=ResourcePool(name=node, generation=generation, resourceSliceCount=1)),
    )


def _devices_of(resource_slice: Any) -> list[dict]:
    return [device.to_dict() for device in resource_slice.spec.devices or []]


class SlicePublisher:
    """Publishes the node's slice through a lightkube client (see module rules)."""

    def __init__(self, client: Any, catalog: DraCatalog, *, driver: str, node: str) -> None:
        self.client = client
        self.catalog = catalog
        self.driver = driver
        self.node = node
        self.name = slice_name(node, driver)
        self.generation = 0
        self.published: Any = None
        """The slice as the API server last stored it (None: not yet published)."""

    async def publish(self, unhealthy: Mapping[Unit, str]) -> bool:
        """Make the API server hold the current slice; True when it wrote one."""
        try:
            if self.published is None:
                return await self._first(unhealthy)
            wanted = render_slice(self.catalog, driver=self.driver, node=self.node, generation=self.generation + 1,
                                  unhealthy=unhealthy)
            if _devices_of(wanted) == _devices_of(self.published):
                return False
            wanted.metadata.resourceVersion = self.published.metadata.resourceVersion
            try:
                self.published = await self.client.replace(wanted)
            except Exception as error:
                if getattr(getattr(error, "status", None), "code", None) in (404, 409):
                    self.published = None  # deleted or changed by someone else: start again from the list
                raise
            self.generation += 1
            self._log("updated", unhealthy)
            return True
        except SlicePublishError:
            raise
        except Exception as error:  # noqa: BLE001 - the API server's answer or the transport's, in one line
            raise SlicePublishError(f"Cannot publish ResourceSlice {self.name}: {api_failure(error)}") from error

    async def _first(self, unhealthy: Mapping[Unit, str]) -> bool:
        from lightkube.resources.resource_v1 import ResourceSlice

        found = [s async for s in self.client.list(ResourceSlice, fields={"spec.nodeName": self.node,
                                                                           "spec.driver": self.driver})]
        ours = next((s for s in found if s.metadata.name == self.name), None)
        self.generation = max([s.spec.pool.generation for s in found if s.spec.pool.name == self.node] + [0]) + 1
        wanted = render_slice(self.catalog, driver=self.driver, node=self.node, generation=self.generation,
                              unhealthy=unhealthy)
        if ours is None:
            self.published = await self.client.create(wanted)
        else:
            wanted.metadata.resourceVersion = ours.metadata.resourceVersion
            self.published = await self.client.replace(wanted)
        for stale in found:
            if stale.metadata.name != self.name:
                await self.client.delete(ResourceSlice, stale.metadata.name)
                logger.info("Deleted the stale ResourceSlice %s of node %s, driver %s", stale.metadata.name,
                            self.node, self.driver)
        self._log("created" if ours is None else "replaced", unhealthy)
        return True

    def _log(self, what: str, unhealthy: Mapping[Unit, str]) -> None:
        tainted = [d.name for d in self.catalog.devices if d.unit in unhealthy]
        logger.info("ResourceSlice %s %s: pool %s generation %d, %d devices, tainted: %s", self.name, what,
                    self.node, self.generation, len(self.catalog.devices), ", ".join(tainted) or "none")


async def keep_published(publisher: SlicePublisher, allocator: Any, *, retry_max_s: float = 8.0,
                         published: Any = None) -> None:
    """Publish now, then after every health change, until cancelled (``published``: called after each
    write). A failed publish is logged and tried again (1 s doubling to ``retry_max_s``); the loop itself
    never ends on the API server's account, and the next change it sees is the newest."""
    import anyio

    from .._health_watch import health_snapshots

    async for snapshot in health_snapshots(allocator):
        backoff = 1.0
        while True:
            try:
                if await publisher.publish(snapshot.unhealthy) and published is not None:
                    published()
                break
            except SlicePublishError as error:
                logger.warning("%s; trying again in %gs", error, backoff)
                await anyio.sleep(backoff)
                backoff = min(retry_max_s, backoff * 2)
