"""DevicePluginServicer: one resource's ``DevicePlugin`` service, in gRPC terms.

Rules (R-K8-1..4):
- A translator only: messages in, the plugin actor's answers out
  (``KubeletPluginProcess``), so every decision has one place.
- ``GetDevicePluginOptions``: ``get_preferred_allocation_available`` true,
  ``pre_start_required`` false. ``PreStartContainer`` answers empty.
- ``ListAndWatch``: the whole list at once, then the whole list again after
  every change that changes this resource's list (``offer_views``): a
  unit turning unhealthy, NVML's health becoming unknown (every unit), a
  unit marked healthy again, and (SPEC R-NL-4) a unit another front door
  of the node takes in the node ledger (``Unhealthy``: the kubelet must
  not schedule a pod on it) or gives back (``Healthy`` again). A
  cancelled stream (the kubelet's side gone) stops waiting (its allocator
  Futures discarded); a new stream starts from the current view.
- ``GetPreferredAllocation`` / ``Allocate``: each container request of the
  call (the kubelet sends one; all are handled); a ``PluginRequestError``
  aborts the call with its status code and message; any other failure
  with ``INTERNAL`` naming it.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import grpc

from actors import NvidiaGpuAllocator
from runtime import PID, dispatch

from .._api import pb, rpc
from ._names import HEALTHY, UNHEALTHY
from ._catalog import ResourceOffer
from .._errors import PluginRequestError
from .._ledger_watch import offer_views
from ._plugin import KubeletPluginProcess

__all__ = ["DevicePluginServicer", "list_response"]

logger = logging.getLogger(__name__)


def list_response(listing: list[tuple[str, bool, int | None]]) -> Any:
    """A ``ListAndWatchResponse`` for ``ResourceOffer.listing``."""
    devices = []
    for device_id, healthy, numa in listing:
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)]) if numa is not None else None
        devices.append(pb.Device(ID=device_id, health=HEALTHY if healthy else UNHEALTHY, topology=topology))
    return pb.ListAndWatchResponse(devices=devices)


class DevicePluginServicer(rpc.DevicePluginServicer):
    """``DevicePlugin`` for one resource (see module rules)."""

    def __init__(self, offer: ResourceOffer, plugin: PID, allocator: NvidiaGpuAllocator) -> None:
        self.offer = offer
        self.plugin = plugin
        self.allocator = allocator

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        sent = None
        logger.info("ListAndWatch for %s: a stream opened", self.offer.resource)
        try:
            async for view in offer_views(self.allocator):
                listing = self.offer.listing(view.withheld())
                if listing != sent:
                    sent = listing
                    unhealthy = [device_id for device_id, healthy, _ in listing if not healthy]
                    elsewhere = [device.id for device in self.offer.devices if device.unit in view.elsewhere
                                 and device.unit not in view.unhealthy]
                    logger.info("ListAndWatch for %s: %d devices, unhealthy: %s%s", self.offer.resource,
                                len(listing), ", ".join(unhealthy) or "none",
                                f" (held by another front door of this node: {', '.join(elsewhere)})"
                                if elsewhere else "")
                    yield list_response(listing)
        finally:
            logger.info("ListAndWatch for %s: the stream ended", self.offer.resource)

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        requests = [(list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size)
                    for r in request.container_requests]
        answers = await self._ask(context, KubeletPluginProcess.preferred, requests)
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in answers])

    async def Allocate(self, request: Any, context: Any) -> Any:
        requests = [list(r.devices_ids) for r in request.container_requests]
        answers = await self._ask(context, KubeletPluginProcess.allocate, requests)
        responses = []
        for answer in answers:
            responses.append(pb.ContainerAllocateResponse(
                envs=answer.envs,
                cdi_devices=[pb.CDIDevice(name=name) for name in answer.cdi_devices],
                devices=[pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path,
                                       permissions=d.permissions) for d in answer.devices],
            ))
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()

    async def _ask(self, context: Any, method: Any, requests: Any) -> Any:
        try:
            return await dispatch(self.plugin, method, self.offer.resource, requests)
        except PluginRequestError as error:
            await context.abort(grpc.StatusCode[error.code], str(error))
        except Exception as error:  # noqa: BLE001 - the kubelet gets the reason, the log the rest
            logger.exception("%s for %s failed", getattr(method, "__name__", method), self.offer.resource)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
