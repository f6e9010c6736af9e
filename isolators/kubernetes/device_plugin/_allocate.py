"""Allocate answers: what the container runtime is told for the kubelet's IDs (R-K8-4, R-K8-7).

Rules:
- ``allocate_answer(offer, ids, unhealthy, ...)`` answers one container
  request. IDs this resource does not offer, or an empty request, are
  refused with ``INVALID_ARGUMENT``; IDs whose unit is unhealthy with
  ``FAILED_PRECONDITION``, naming each ID and its reason and saying how an
  operator brings it back. A refusal hands nothing out.
- Replica IDs (``<UUID>::<i>``) map back to their unit; each unit counts
  once, whatever number of its time-slicing replicas the request holds.
- MPS shares (``--mps_replicas``, SPEC R-MP-4): a container gets one share
  of a unit. A request naming two or more shares of one unit is refused
  (``INVALID_ARGUMENT``) naming those IDs and the unit's UUID; nothing is
  handed out. The answer's ``shares`` are the shares handed out (one per
  unit, with their limits), for the unit's MPS daemon.
- The answer for units U (in unit order): CDI device names
  ``nvidia.com/gpu=<UUID>`` (the node spec's names; MIG devices by their
  ``MIG-…`` UUID), ``envs`` ``NVIDIA_VISIBLE_DEVICES`` = the UUIDs
  comma-separated, and, with ``pass_device_specs``, one ``DeviceSpec`` per
  node of the grant on U (``container_grant``): ``/dev/nvidia<minor>``
  and the control devices ``rw``, a MIG device's capability nodes ``r``
  (they are read-only), host paths under ``--dev_dir``.
- Pure: no I/O; the same inputs give an equal answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from actors.devices import DeviceRule
from actors.mig import MigCapabilities, Unit

from ...cdi import NODE_KIND, VISIBLE_DEVICES, container_grant
from ._catalog import MpsShare, ResourceOffer
from .._errors import FAILED_PRECONDITION, INVALID_ARGUMENT, PluginRequestError

__all__ = ["ContainerAnswer", "DeviceSpecAnswer", "allocate_answer"]


class DeviceSpecAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A device node the runtime adds (``DeviceSpec``)."""

    container_path: str
    host_path: str
    permissions: str


class ContainerAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to one container request (``ContainerAllocateResponse``)."""

    units: list[str]
    """The units handed out (``195:3``, ``195:0/gi1/ci0``), for logs and tests."""
    envs: dict[str, str]
    cdi_devices: list[str]
    devices: list[DeviceSpecAnswer] = []
    shares: list[MpsShare] = []
    """The MPS shares handed out (``--mps_replicas``), one per unit, in unit order."""


def allocate_answer(
    offer: ResourceOffer,
    ids: Iterable[str],
    unhealthy: Mapping[Unit, str],
    *,
    uuids: Mapping[Unit, str],
    control_devices: Mapping[str, DeviceRule],
    dev_dir: str,
    caps: MigCapabilities | None = None,
    pass_device_specs: bool = False,
) -> ContainerAnswer:
    """The answer for one container request (see module rules)."""
    ids = list(ids)
    if not ids:
        raise PluginRequestError(INVALID_ARGUMENT, f"An Allocate request for {offer.resource} names no device ID")
    devices = offer.resolve(ids)
    shared: dict[Unit, list[str]] = {}
    for device in devices:
        if device.share is not None:
            shared.setdefault(device.unit, []).append(device.id)
    doubled = [(uuids[unit], named) for unit, named in shared.items() if len(named) > 1]
    if doubled:
        named = "; ".join(f"{', '.join(repr(i) for i in ids)} (all of {uuid})" for uuid, ids in doubled)
        raise PluginRequestError(
            INVALID_ARGUMENT,
            f"Device IDs for {offer.resource} name more than one MPS share of one GPU: {named}; a container gets one"
            " share of a GPU (--mps_replicas), nothing was allocated. Ask for fewer, or for shares of different GPUs",
        )
    sick = [(device.id, unhealthy[device.unit]) for device in devices if device.unit in unhealthy]
    if sick:
        named = "; ".join(f"{device_id!r} ({reason})" for device_id, reason in sick)
        raise PluginRequestError(
            FAILED_PRECONDITION,
            f"Unhealthy device IDs for {offer.resource}: {named}; nothing was allocated. Once the GPU is"
            " fixed an operator marks it healthy again (POST /kubelet-plugin/mark_healthy)",
        )
    units = sorted({device.unit for device in devices})
    grant = container_grant(units, uuids, control_devices, dev_dir, caps=caps)
    specs = []
    if pass_device_specs:
        specs = [DeviceSpecAnswer(container_path=node.path, host_path=node.host_path,
                                  permissions=node.permissions.replace("m", ""))
                 for node in grant.devices]
    return ContainerAnswer(
        units=[str(unit) for unit in units],
        envs={VISIBLE_DEVICES: grant.environment[VISIBLE_DEVICES]},
        cdi_devices=[f"{NODE_KIND}={uuids[unit]}" for unit in units],
        devices=specs,
        shares=[device.share for device in sorted(devices, key=lambda d: d.unit) if device.share is not None],
    )
