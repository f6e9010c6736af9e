"""Registering a node's GPUs for NVML health events (R-HE-2).

Rules:
- ``register_health_events(nvml, event_set, indices)`` asks each GPU
  ``nvmlDeviceGetSupportedEventTypes`` and registers each wanted type it
  supports (``HEALTH_EVENT_TYPES``: Xid critical errors, double-bit ECC)
  with its own ``nvmlDeviceRegisterEvents`` call. So a GPU without ECC
  events still reports Xids (NVML refuses a registration that names any
  unsupported type, registering nothing).
- A GPU that supports none of them, or whose registration fails, is logged
  once, here, and listed as ``unknown`` (handed out, its health not
  watched). Blocking: run it through the executor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec

from ._errors import NvmlError, NvmlNotSupported
from ._port import HEALTH_EVENT_TYPES, EventSet, Nvml

__all__ = ["HealthRegistration", "register_health_events"]

logger = logging.getLogger(__name__)


class HealthRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """What an event set watches: per NVML index, the event kinds registered."""

    registered: dict[int, list[str]] = {}
    """NVML index -> kinds (``"xid"``, ``"ecc"``) registered for it."""
    unknown: list[int] = []
    """NVML indices whose health NVML cannot report (supports none, or refused)."""


def register_health_events(nvml: Nvml, event_set: EventSet, indices: Iterable[int]) -> HealthRegistration:
    """Register every wanted, supported event type of each GPU (see module rules)."""
    registered: dict[int, list[str]] = {}
    unknown: list[int] = []
    for index in indices:
        try:
            handle = nvml.handle(index)
            try:
                supported = nvml.supported_event_types(handle)
            except NvmlNotSupported:
                supported = 0
            kinds = []
            for kind, bit in HEALTH_EVENT_TYPES.items():
                if not supported & bit:
                    continue
                try:
                    nvml.register_events(handle, bit, event_set)
                except NvmlError as exc:
                    logger.warning("GPU index %d: registering its %s events failed: %s", index, kind, exc)
                    continue
                kinds.append(kind)
        except NvmlError as exc:
            logger.warning("GPU index %d: cannot register health events (%s); its health is unknown", index, exc)
            unknown.append(index)
            continue
        if kinds:
            registered[index] = kinds
        else:
            logger.warning(
                "GPU index %d reports neither Xid nor double-bit ECC events (supported event types 0x%x);"
                " its health is unknown: it is handed out unwatched", index, supported,
            )
            unknown.append(index)
    return HealthRegistration(registered=registered, unknown=unknown)
