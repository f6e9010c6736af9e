"""Claims: what the kubelet asks for, checked against what the API server allocated.

Rules (issue 37 item 3; SPEC section 21):
- ``ClaimRef`` is the kubelet's ``Claim`` (namespace, name, uid). A uid
  that is not a plain identifier (letters, digits, ``-``, ``_``, ``.``,
  alphanumeric at both ends, at most 64 characters) is refused before
  anything is built from it (it names the claim's CDI spec file).
- ``plan_claim(ref, claim, ...)`` checks the ResourceClaim the API server
  holds and returns the devices to prepare, or raises ``ClaimRefused``
  whose message names the claim and why, and ends "nothing was prepared":
  the stored claim's uid differs from the kubelet's (deleted and created
  again); it has no ``status.allocation``; none of its results is this
  driver's; a result of this driver names another node's pool (the pool is
  the node's name) or a device this node does not publish.
- Opaque device configuration addressed to this driver
  (``status.allocation.devices.config[].opaque.driver``, from the claim or
  its DeviceClass) is refused, naming its source, requests and
  parameters: this driver takes none, and a setting the user asked for
  is never dropped silently. Configuration for other drivers is theirs.
- Results of other drivers are ignored (their drivers prepare them). A
  result is shared when it has ``adminAccess`` or a ``shareID``
  (``PlannedDevice.admin_access`` / ``share_id``); see ``PreparedClaims``
  for what that allows.
- A result on a device published for MPS shares (``DeviceFacts.shared``,
  SPEC R-MP-5) is a share: its ``PlannedDevice.share`` holds the limits of
  its ``consumedCapacity`` (``share_limits``); one it cannot be (no
  ``shareID`` or consumed memory: the cluster allocated it whole) refuses
  the claim naming why. A share with ``adminAccess`` watches: no limits.
- Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from runtime import Failure

from ._devices import DraCatalog
from ._sharing import ShareLimits, ShareRefused, share_limits

__all__ = ["ClaimRef", "ClaimRefused", "PlannedDevice", "ClaimPlan", "plan_claim", "check_uid"]

_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,62}[A-Za-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NOTHING = "nothing was prepared"


class ClaimRefused(Failure):
    """One claim the driver will not prepare; the message names the claim and why."""


class ClaimRef(msgspec.Struct, frozen=True):
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name} (uid {self.uid})"


class PlannedDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One allocated device of this driver: which request, pool, device, and whether it is shared."""

    request: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    share: ShareLimits | None = None
    """An MPS share's limits (``--sharing=mps``): exactly the allocation's consumed capacity."""

    @property
    def shared(self) -> bool:
        return self.admin_access or self.share_id is not None


class ClaimPlan(msgspec.Struct, frozen=True, kw_only=True):
    ref: ClaimRef
    devices: list[PlannedDevice]


def check_uid(ref: ClaimRef) -> None:
    """The kubelet's reference checked before anything is built from it: the
    uid names files, the namespace and name a path on the API server."""
    if not isinstance(ref.uid, str) or not _UID.fullmatch(ref.uid):
        raise ClaimRefused(f"claim {ref.namespace}/{ref.name}: uid {ref.uid!r} is not a Kubernetes UID; {NOTHING}")
    if not isinstance(ref.namespace, str) or len(ref.namespace) > 63 or not _NAMESPACE.fullmatch(ref.namespace):
        raise ClaimRefused(f"claim uid {ref.uid}: namespace {ref.namespace!r} is not a Kubernetes namespace (a DNS"
                           f" label); {NOTHING}")
    if not isinstance(ref.name, str) or len(ref.name) > 253 or not _NAME.fullmatch(ref.name):
        raise ClaimRefused(f"claim uid {ref.uid}: name {ref.name!r} is not a Kubernetes object name (a DNS"
                           f" subdomain); {NOTHING}")


def plan_claim(ref: ClaimRef, claim: Any, *, driver: str, node: str, catalog: DraCatalog) -> ClaimPlan:
    """The devices of ``claim`` (a lightkube ResourceClaim) to prepare (see module rules)."""
    check_uid(ref)
    stored = claim.metadata.uid if claim.metadata is not None else None
    if stored != ref.uid:
        raise ClaimRefused(f"{ref}: the API server holds uid {stored} for {ref.namespace}/{ref.name}, not the"
                           f" kubelet's {ref.uid} (the claim was deleted and created again); {NOTHING}")
    allocation = claim.status.allocation if claim.status is not None else None
    results = (allocation.devices.results or []) if allocation is not None and allocation.devices else None
    if allocation is None or results is None:
        raise ClaimRefused(f"{ref}: it is not allocated (no status.allocation): the scheduler has not given it"
                           f" devices; {NOTHING}")
    refused = [_describe(config) for config in allocation.devices.config or []
               if config.opaque is not None and config.opaque.driver == driver]
    if refused:
        raise ClaimRefused(f"{ref}: it holds opaque device configuration for driver {driver}, which takes none and"
                           f" does not understand it: {'; '.join(refused)}. Remove it from the claim or its"
                           f" DeviceClass; {NOTHING}")
    ours = [result for result in results if result.driver == driver]
    if not ours:
        drivers = sorted({result.driver for result in results})
        raise ClaimRefused(f"{ref}: none of its devices is driver {driver}'s (allocated from:"
                           f" {', '.join(drivers) or 'nothing'}); {NOTHING}")
    elsewhere = [f"{r.device} of pool {r.pool}" for r in ours if r.pool != node]
    if elsewhere:
        raise ClaimRefused(f"{ref}: it is allocated {', '.join(elsewhere)}, another node's pool (this is node"
                           f" {node}, pool {node}); {NOTHING}")
    unknown = [r.device for r in ours if r.device not in catalog.by_name]
    if unknown:
        raise ClaimRefused(f"{ref}: device {', '.join(unknown)} is not one driver {driver} publishes on node {node}"
                           f" ({', '.join(d.name for d in catalog.devices[:3])}, ...); {NOTHING}")
    devices = [PlannedDevice(request=r.request, pool=r.pool, device=r.device, admin_access=bool(r.adminAccess),
                             share_id=r.shareID or None, share=_share(ref, r, catalog, driver)) for r in ours]
    return ClaimPlan(ref=ref, devices=devices)


def _share(ref: ClaimRef, result: Any, catalog: DraCatalog, driver: str) -> ShareLimits | None:
    """The limits of a result on a device published for shares (see module rules)."""
    device = catalog.by_name[result.device]
    if not device.shared or result.adminAccess:
        return None
    try:
        return share_limits(result.device, device.memory_mib, result.shareID or None,
                            dict(result.consumedCapacity or {}), driver)
    except ShareRefused as refused:
        raise ClaimRefused(f"{ref}: {refused}; {NOTHING}") from None


def _describe(config: Any) -> str:
    """One opaque configuration entry in words: source, requests, parameters (cut at 120 characters)."""
    parameters = json.dumps(config.opaque.parameters, sort_keys=True, separators=(",", ":"))
    if len(parameters) > 120:
        parameters = parameters[:117] + "..."
    requests = ", ".join(config.requests) if config.requests else "all requests"
    return f"{config.source} for {requests}: {parameters}"
