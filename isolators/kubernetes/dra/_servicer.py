"""The DRA driver's gRPC services: DRAPlugin (v1 and v1beta1), DRAResourceHealth.

Rules (issue 37 items 2, 3 and 5):
- Translators only: messages in, ``DraPluginProcess``'s answers out.
- Registration with the plugin watcher is the shared
  ``PluginWatcherRegistration`` (type ``DRAPlugin``, the driver name, the
  DRA socket's path, versions ``v1.DRAPlugin`` / ``v1beta1.DRAPlugin``;
  its status logged and counted by ``DraPluginProcess.registered``).
- ``dra_servicer(version)``: the ``DRAPlugin`` servicer of one wire
  package. ``NodePrepareResources`` answers every claim asked by uid
  (devices with request names, pool, device name, ``cdi_device_ids``, and
  in v1 the ``share_id``; or the claim's ``error``);
  ``NodeUnprepareResources`` likewise. A failure outside the per-claim
  answers (a bug) aborts the call with ``INTERNAL`` naming it.
- ``health_servicer(version)``: ``DRAResourceHealth`` of ``v1`` or
  ``v1alpha1`` (kubelets 1.34-1.36). ``NodeWatchResources``: the whole
  list (every published device, ``HEALTHY`` or ``UNHEALTHY`` with the reason as message, the time
  it was determined) at once and after every change of the allocator's
  health, recovery included; a cancelled stream discards its wait.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

import grpc

from actors import NvidiaGpuAllocator
from runtime import PID, dispatch

from .._health_watch import health_snapshots
from .._api import DRA_VERSIONS, HEALTH_VERSIONS, health
from ._claims import ClaimRef
from ._devices import DraCatalog
from ._plugin import DraPluginProcess

__all__ = ["dra_servicer", "health_servicer", "health_list"]

logger = logging.getLogger(__name__)


def dra_servicer(version: str, plugin: PID) -> Any:
    """The ``DRAPlugin`` servicer of ``version`` (``v1.DRAPlugin`` / ``v1beta1.DRAPlugin``)."""
    pb, rpc = DRA_VERSIONS[version]
    with_share_id = "share_id" in pb.Device.DESCRIPTOR.fields_by_name

    class Servicer(rpc.DRAPluginServicer):
        async def NodePrepareResources(self, request: Any, context: Any) -> Any:
            refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
            answers = await _ask(context, DraPluginProcess.prepare, plugin, refs)
            response = pb.NodePrepareResourcesResponse()
            for uid, answer in answers.items():
                devices = []
                for d in answer.devices:
                    device = pb.Device(request_names=[d.request], pool_name=d.pool, device_name=d.device,
                                       cdi_device_ids=d.cdi_device_ids)
                    if with_share_id and d.share_id is not None:
                        device.share_id = d.share_id
                    devices.append(device)
                response.claims[uid].CopyFrom(pb.NodePrepareResourceResponse(devices=devices, error=answer.error))
            return response

        async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
            refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
            answers = await _ask(context, DraPluginProcess.unprepare, plugin, refs)
            response = pb.NodeUnprepareResourcesResponse()
            for uid, error in answers.items():
                response.claims[uid].CopyFrom(pb.NodeUnprepareResourceResponse(error=error))
            return response

    Servicer.__name__ = Servicer.__qualname__ = f"DRAPluginServicer[{version}]"
    return Servicer()


async def _ask(context: Any, method: Any, plugin: PID, refs: list[ClaimRef]) -> Any:
    try:
        return await dispatch(plugin, method, refs)
    except Exception as error:  # noqa: BLE001 - per-claim refusals are answers; this is a bug
        logger.exception("%s failed", method.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


def health_list(catalog: DraCatalog, node: str, unhealthy: dict, now: int, pb: Any = health) -> Any:
    """A ``NodeWatchResourcesResponse`` (of the health package ``pb``) of every device."""
    devices = []
    for device in catalog.devices:
        reason = unhealthy.get(device.unit)
        devices.append(pb.DeviceHealth(
            device=pb.DeviceIdentifier(pool_name=node, device_name=device.name),
            health=pb.UNHEALTHY if reason is not None else pb.HEALTHY,
            last_updated_time=now, message=(reason or "")[:1024]))
    return pb.NodeWatchResourcesResponse(devices=devices)


def health_servicer(version: str, catalog: DraCatalog, node: str, allocator: NvidiaGpuAllocator) -> Any:
    """The ``DRAResourceHealth`` servicer of ``version`` (``v1`` / ``v1alpha1``; see module rules)."""
    pb, rpc = HEALTH_VERSIONS[version]

    class Servicer(rpc.DRAResourceHealthServicer):
        async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
            sent = None
            async for snapshot in health_snapshots(allocator):
                unhealthy = {unit: why for unit, why in snapshot.unhealthy.items() if unit in catalog.by_unit}
                if unhealthy != sent:
                    sent = unhealthy
                    logger.info("NodeWatchResources (%s): %d devices, unhealthy: %s", version, len(catalog.devices),
                                ", ".join(catalog.by_unit[u].name for u in unhealthy) or "none")
                    yield health_list(catalog, node, unhealthy, int(time.time()), pb)

    Servicer.__name__ = Servicer.__qualname__ = f"DRAResourceHealthServicer[{version}]"
    return Servicer()
