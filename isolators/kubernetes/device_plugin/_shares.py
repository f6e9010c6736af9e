"""PodShares: the device plugin's MPS shares, granted at Allocate and returned when no pod holds them.

Rules (SPEC R-MP-1..4, with ``--mps_replicas``):
- ``grant(devices)`` (at ``Allocate``, before the answer): each offered
  device with a share (``OfferedDevice.share``) is granted by its unit's
  MPS daemon (``actors.mps.MpsDaemons.share``: started, or joined) with
  its limits (1/N of the unit's memory, 100/N % of its threads), share id
  the device ID; all or none (what was granted goes back when one is
  refused, and the refusal -- a daemon that cannot start, named with its
  exit and log -- refuses the call: ``FAILED_PRECONDITION``). A device ID
  granted again (the kubelet hands an ID to the next pod) joins as before.
- ``reconcile(assigned, started)``, once per pass with that pass's
  PodResources ``List``: a share the List names is kept (and, when this
  process has not granted it -- a restart -- granted again: a daemon left
  running is taken over); a share the List does not name is returned once
  a List named it before (its pod is gone) or once a List that began
  ``grace_s`` after its Allocate does not (an admission that failed). A
  unit's last share returned stops its daemon. The first reconcile (a
  start's) then stops every daemon left running with no share -- its
  pod went while the plugin was down -- through
  ``stop_left_daemons`` (the unit held first in the node ledger when
  ``allocator`` is given), before the node ledger gets back what no pod
  holds.
- The CDI spec ``gpu-isolator-mps.json`` (``mps_spec``: kind
  ``nvidia.com/gpu-mps``, one device per shared unit named by its UUID,
  the daemon's pipe directory at ``/tmp/nvidia-mps`` with
  ``CUDA_MPS_PIPE_DIRECTORY`` and the unit's ``/dev/shm``) is what a
  container of a share gets beside the unit's own device
  (``mps_device_name``).
- Called only from ``KubeletPluginProcess`` (one actor).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ...cdi import CdiDevice, CdiSpec, encode_spec, mps_edits, required_version, validate_spec
from .._errors import FAILED_PRECONDITION, PluginRequestError
from ..pod_repair import AssignedDevices
from ._catalog import DeviceCatalog, OfferedDevice
from ._names import ALLOCATE_GRACE_S

__all__ = ["PodShares", "MPS_KIND", "MPS_SPEC_FILE", "mps_device_name", "mps_spec"]

logger = logging.getLogger(__name__)

MPS_KIND = "nvidia.com/gpu-mps"
MPS_SPEC_FILE = "gpu-isolator-mps.json"


def mps_device_name(uuid: str) -> str:
    """The CDI name of a shared unit's MPS edits."""
    return f"{MPS_KIND}={uuid}"


def mps_spec(catalog: DeviceCatalog, mps: Any) -> bytes:
    """The node's MPS spec: one device per shared unit (see module rules)."""
    devices = []
    for uuid in sorted({device.uuid for offer in catalog.offers for device in offer.devices
                        if device.share is not None}):
        paths = mps.paths(uuid)
        devices.append(CdiDevice(name=uuid, container_edits=mps_edits(paths.pipe, paths.shm)))
    spec = CdiSpec(cdi_version="0.3.0", kind=MPS_KIND, devices=devices)
    import msgspec

    spec = validate_spec(msgspec.structs.replace(spec, cdi_version=required_version(spec)))
    return encode_spec(spec, "json")


class PodShares:
    """The plugin's live MPS shares by device ID (see module rules)."""

    def __init__(self, catalog: DeviceCatalog, mps: Any, *, grace_s: float = ALLOCATE_GRACE_S,
                 allocator: Any = None) -> None:
        self.catalog = catalog
        self.mps = mps
        self.grace_s = grace_s
        self.allocator = allocator
        """The allocator of the node ledger (None: no ledger), to hold a unit whose left daemon it stops."""
        self.swept = False
        """The daemons left running by an earlier life were stopped (the first reconcile)."""
        self.granted: dict[str, tuple[OfferedDevice, float, bool]] = {}
        """Device ID -> (device, when its Allocate answered, whether a List named it since)."""

    async def _share(self, device: OfferedDevice) -> None:
        from actors.mps import ShareLimits

        share = device.share
        assert share is not None
        await self.mps.share(device.uuid, device.id, ShareLimits(memory_bytes=share.memory_bytes,
                                                                 thread_percentage=share.thread_percent))

    async def grant(self, devices: Iterable[OfferedDevice]) -> None:
        """Grant every share of ``devices``, all or none (see module rules)."""
        done: list[str] = []
        now = time.monotonic()
        try:
            for device in devices:
                if device.share is None:
                    continue
                await self._share(device)
                done.append(device.id)
                seen = self.granted.get(device.id, (device, now, False))[2]
                self.granted[device.id] = (device, now, seen)
        except Exception as error:  # noqa: BLE001 - the daemons' refusal: the whole call is refused
            for device_id in done:
                await self._return(device_id)
            raise PluginRequestError(FAILED_PRECONDITION, f"MPS share not granted: {error}; nothing was"
                                                          " allocated") from error

    async def _return(self, device_id: str) -> None:
        self.granted.pop(device_id, None)
        try:
            await self.mps.release(device_id)
        except Exception as error:  # noqa: BLE001 - said loudly; the next share of the unit tries the daemon again
            logger.error("MPS share %s was not returned cleanly: %s", device_id, error)

    async def reconcile(self, assigned: Sequence[AssignedDevices], started: float) -> list[str]:
        """Keep what PodResources names, return what it no longer does (see module rules); the IDs returned."""
        named: set[str] = set()
        for entry in assigned:
            offer = self.catalog.by_resource.get(entry.resource)
            if offer is None:
                continue
            for device_id in entry.ids:
                device = offer.by_id.get(device_id)
                if device is None or device.share is None:
                    continue
                named.add(device_id)
                if device_id not in self.granted:  # a restart: the pod still runs, its share is granted again
                    try:
                        await self._share(device)
                    except Exception as error:  # noqa: BLE001 - said loudly; the next pass tries again
                        logger.error("MPS share %s of pod %s/%s cannot be granted again: %s", device_id,
                                     entry.namespace, entry.pod, error)
                        continue
                    self.granted[device_id] = (device, started, True)
                    logger.info("MPS share %s of pod %s/%s granted again", device_id, entry.namespace, entry.pod)
        returned = []
        for device_id, (device, answered, seen) in list(self.granted.items()):
            if device_id in named:
                self.granted[device_id] = (device, answered, True)
            elif seen or started - answered >= self.grace_s:
                await self._return(device_id)
                returned.append(device_id)
        if returned:
            logger.info("MPS shares no pod holds returned: %s", ", ".join(returned))
        if not self.swept:
            from .._run import stop_left_daemons

            units = {device.uuid: device.unit for offer in self.catalog.offers for device in offer.devices
                     if device.share is not None}
            await stop_left_daemons(self.mps, self.allocator, units)
            self.swept = True
        return returned
