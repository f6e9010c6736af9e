"""Sharing a device through MPS: consumable capacity on the slice, and a share's limits from its allocation.

Rules (SPEC R-MP-5, R-MP-8; facts from resource.k8s.io/v1, KEP-5075, and
the scheduler's allocator in k8s.io/dynamic-resource-allocation/structured):
- ``--sharing`` is ``none`` (default: every device is exclusive, as
  before) or ``mps``: every unit (a GPU or a MIG device) is published
  once, with ``allowMultipleAllocations: true`` and two consumable
  capacities, each with a request policy the API server accepts (a
  default inside a ``validRange`` whose default and max are whole steps
  from its min):
  ``memory`` (bytes): value the unit's memory; ``min`` = ``step`` =
  ``MEMORY_STEP_MIB`` (256Mi); ``max`` = ``default`` = the unit's memory
  rounded down to a whole step. A claim that asks nothing takes all of it:
  one share that is the whole unit, so no other share fits beside it (a
  unit with shares is never also offered whole).
  ``compute`` (percent of the unit's threads, MPS's active thread
  percentage): value 100, range 0..100 step 1, ``default`` 0. A share that
  asked for compute holds that percentage of the unit and its clients are
  limited to it; 0 (not asked) reserves none and limits none. Compute
  reserved by the shares of one unit never sums past 100.
  A unit of less than two steps of memory (``shareable``) cannot hold two
  shares and is published exclusive, as with ``none``.
- ``--mps_replicas N`` (N >= 2; default 1: any size, as above) makes every
  shareable unit N equal shares: ``memory`` ``validValues`` of the one
  size, the unit's memory over N rounded down to a whole step, and that
  size the default; ``compute`` ``validValues`` of ``100 // N``, and that
  the default. The scheduler rounds every request up to that size (a
  larger one does not fit there), so claims allocated at once can never
  ask a unit for different limits (see below), at the price of a claim
  asking less getting, and holding, the whole share. A unit whose share
  would be under one step (``shareable(memory, N)``) is published
  exclusive.
- The scheduler, not the driver, allocates: for each capacity of the
  device it consumes the request rounded up to the next step (below
  ``min``: ``min``), or the default when not asked; a request past ``max``
  or a sum past the capacity leaves the device out. The allocation
  result carries a ``shareID`` and ``consumedCapacity``.
- ``share_limits(device, result, driver)`` is what prepare enforces: the
  share's memory limit is exactly its consumed ``memory`` in bytes, its
  thread percentage its consumed ``compute`` (None: not limited).
  ``ShareRefused`` (a ``ValueError``) names what is wrong: a result of a
  sharing driver without a ``shareID`` or consumed ``memory`` (the
  cluster's ``DRAConsumableCapacity`` feature gate is off: the API server
  drops the fields and the scheduler allocates devices whole), a memory
  that is not a whole number of bytes, is 0, or is past the unit's, a
  compute share outside 0..100. Capacity names are accepted unqualified
  or qualified with the driver (``<driver>/memory``), as the scheduler
  writes either.
- A unit with live shares holds one set of limits (MPS holds limits per
  server, one server per unit: the shares of one unit are equal). So the
  slice follows the shares (``capacity_of(..., live=limits)``): while a
  unit has live shares its policies narrow to those limits -- ``memory``
  and ``compute`` each ``validValues`` of the one live value, and that
  value the default -- so the scheduler rounds any smaller request up to
  them, never allocates a larger one there, and the next share is equal.
  ``LiveShares`` is what the driver has prepared (device -> limits), and
  tells the slice's publisher when it changes. A claim allocated and not
  yet prepared is not in it: two claims of different limits allocated on a
  free unit before either is prepared still meet, and the second is
  refused at prepare naming both (``--mps_replicas`` rules that out).
- ``over_capacity`` is the driver's own check of what the scheduler
  promises: the shares of one device never sum past its memory, nor
  their thread percentages past 100; a share that would is named with
  the sums.
- Pure: no I/O.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

import msgspec

__all__ = ["SHARING_MODES", "MEMORY", "COMPUTE", "MEMORY_STEP_MIB", "ShareLimits", "ShareRefused", "capacity_of",
           "shareable", "share_size_mib", "share_limits", "over_capacity", "parse_quantity", "LiveShares"]

SHARING_MODES = ("none", "mps")
MEMORY = "memory"
COMPUTE = "compute"
MEMORY_STEP_MIB = 256
MIB = 1 << 20


class ShareRefused(ValueError):
    """An allocation result this driver cannot prepare as a share; the message says why."""


class ShareLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one share of a unit may use: memory in bytes, and the thread percentage (None: not limited)."""

    memory_bytes: int
    thread_percent: int | None = None


def capacity_of(memory_mib: int, sharing: str, live: "ShareLimits | None" = None,
                replicas: int = 1) -> dict[str, dict[str, Any]]:
    """A device's ``capacity`` as resource.k8s.io/v1 JSON (``live``: the limits of its live shares;
    ``replicas``: ``--mps_replicas``; see module rules)."""
    memory = {"value": f"{memory_mib}Mi"}
    if sharing == "none" or not shareable(memory_mib, replicas):
        return {MEMORY: memory}
    if replicas > 1:
        live = ShareLimits(memory_bytes=share_size_mib(memory_mib, replicas) * MIB, thread_percent=100 // replicas)
    if live is not None:
        size = f"{live.memory_bytes // MIB}Mi" if live.memory_bytes % MIB == 0 else str(live.memory_bytes)
        percent = str(live.thread_percent or 0)
        memory["requestPolicy"] = {"default": size, "validValues": [size]}
        return {MEMORY: memory, COMPUTE: {"value": "100", "requestPolicy": {"default": percent,
                                                                            "validValues": [percent]}}}
    whole = memory_mib // MEMORY_STEP_MIB * MEMORY_STEP_MIB
    step = f"{MEMORY_STEP_MIB}Mi"
    memory["requestPolicy"] = {"default": f"{whole}Mi", "validRange": {"min": step, "max": f"{whole}Mi", "step": step}}
    return {
        MEMORY: memory,
        COMPUTE: {"value": "100", "requestPolicy": {"default": "0",
                                                    "validRange": {"min": "0", "max": "100", "step": "1"}}},
    }


def shareable(memory_mib: int, replicas: int = 1) -> bool:
    """Whether a unit can hold two shares of one step (the API server refuses a range of less than one step),
    or ``replicas`` > 1 shares of at least one step each."""
    if replicas > 1:
        return share_size_mib(memory_mib, replicas) >= MEMORY_STEP_MIB
    return memory_mib >= 2 * MEMORY_STEP_MIB


def share_size_mib(memory_mib: int, replicas: int) -> int:
    """One of ``replicas`` equal shares of a unit's memory, rounded down to a whole step (``--mps_replicas``)."""
    return memory_mib // replicas // MEMORY_STEP_MIB * MEMORY_STEP_MIB


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity (``10Gi``, ``1.5G``, ``500m``, ``1e3``) as a number; ValueError if it is none."""
    from lightkube.utils.quantity import parse_quantity as parse

    try:
        value = parse(str(text))
    except (ValueError, InvalidOperation, TypeError) as error:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from error
    if value is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    return Decimal(value)


def _consumed(consumed: dict[str, Any], name: str, driver: str) -> str | None:
    for key in (name, f"{driver}/{name}"):
        if key in consumed:
            return str(consumed[key])
    return None


def share_limits(device: str, memory_mib: int, share_id: str | None, consumed: dict[str, Any] | None,
                 driver: str) -> ShareLimits:
    """The limits of the share a result allocates (see module rules)."""
    consumed = consumed or {}
    memory = _consumed(consumed, MEMORY, driver)
    if share_id is None or memory is None:
        missing = " and ".join(what for what, absent in (("shareID", share_id is None),
                                                         ("consumedCapacity memory", memory is None)) if absent)
        raise ShareRefused(
            f"device {device} is shared through MPS (--sharing=mps) but its allocation has no {missing}: the"
            " cluster allocated it whole. Enable the DRAConsumableCapacity feature gate on the API server and the"
            " scheduler, or run the driver with --sharing=none")
    try:
        memory_bytes = parse_quantity(memory)
    except ValueError as error:
        raise ShareRefused(f"device {device}: consumedCapacity memory {error}") from None
    if memory_bytes != memory_bytes.to_integral_value() or memory_bytes <= 0 or memory_bytes > memory_mib * MIB:
        raise ShareRefused(f"device {device}: consumedCapacity memory {memory} is not a whole number of bytes between"
                           f" 1 and the device's {memory_mib}Mi")
    threads = None
    compute = _consumed(consumed, COMPUTE, driver)
    if compute is not None:
        try:
            percent = parse_quantity(compute)
        except ValueError as error:
            raise ShareRefused(f"device {device}: consumedCapacity compute {error}") from None
        if percent != percent.to_integral_value() or not 0 <= percent <= 100:
            raise ShareRefused(f"device {device}: consumedCapacity compute {compute} is not a whole percentage"
                               " from 0 to 100")
        threads = int(percent) or None
    return ShareLimits(memory_bytes=int(memory_bytes), thread_percent=threads)


def over_capacity(device: str, memory_mib: int, asked: ShareLimits, held: list[ShareLimits]) -> str | None:
    """Why ``asked`` does not fit on ``device`` beside the shares ``held`` there (None: it fits)."""
    memory = asked.memory_bytes + sum(share.memory_bytes for share in held)
    threads = (asked.thread_percent or 0) + sum(share.thread_percent or 0 for share in held)
    if memory > memory_mib * MIB:
        return (f"device {device}: this share's {asked.memory_bytes} bytes of memory and the {len(held)} shares"
                f" prepared there sum to {memory} bytes, past the device's {memory_mib}Mi")
    if threads > 100:
        return (f"device {device}: this share's {asked.thread_percent} % of the threads and the {len(held)} shares"
                f" prepared there sum to {threads} %, past 100 %")
    return None


class LiveShares:
    """The limits of the shares the driver has prepared, by device; ``watch`` callbacks hear of a change."""

    def __init__(self) -> None:
        self.limits: dict[str, ShareLimits] = {}
        self._watchers: list[Any] = []

    def watch(self, callback: Any) -> None:
        self._watchers.append(callback)

    def update(self, devices: Any) -> None:
        """Set from every prepared device (objects with ``device`` and ``share``): the first share of each."""
        limits: dict[str, ShareLimits] = {}
        for device in devices:
            if device.share is not None:
                limits.setdefault(device.device, device.share)
        if limits != self.limits:
            self.limits = limits
            for callback in self._watchers:
                callback()
