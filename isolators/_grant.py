"""What a container is granted: its GPU count and its device policy.

Rules (Mesos ``NvidiaGpuIsolatorProcess::_update``, R-IS-3/4):
- ``requested_count(resources, name)``: the whole number of ``name`` units
  asked for (``gpus``, ``mig-1g.18gb``, R-MG-3; 0 when absent); a fractional
  value, a range or a set is refused with Mesos' "The 'gpus' resource must
  be an unsigned integer".
- ``gpu_rule(gpu)``: the rule that grants one GPU, ``c 195:<minor> rwm``.
- ``Policies(control_devices).of(gpus)``: a container's whole device policy
  for the GPUs it holds -- deny all; the standard container devices, the
  control devices and those GPUs allowed (``Policy.container``). With
  ``rules`` (a ``UnitCatalog``'s) the units may be MIG devices, granted by
  their parent's rule and their capability nodes. Pure; the same ``Policy``
  comes back for the same GPU set (churn repeats a few), at most 256 sets
  are kept.
- ``ContainerRecord``: the isolator's record of one top-level container
  (its units, and why they are not free, are in the ``GpuLedger``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from actors.devices import DeviceRule, Policy
from actors import Gpu
from actors.resources import Resources
from runtime import Future, Promise

from ._errors import IsolatorError
from ._types import ContainerID


def requested_count(resources: Resources, name: str) -> int:
    """The whole number of ``name`` units ``resources`` asks for (0 when absent)."""
    if name in resources.others:  # a range or set: never read as "no GPUs"
        raise IsolatorError(f"The '{name}' resource must be an unsigned integer")
    value = resources.scalars.get(name, 0.0)
    whole = int(value)
    if whole == value:  # the common case: a whole number already
        return whole
    if int(round(value * 1000)) % 1000 != 0:
        raise IsolatorError(f"The '{name}' resource must be an unsigned integer")
    return int(round(value))


def gpu_rule(gpu: Gpu) -> DeviceRule:
    """The device rule that grants one GPU (read, write, mknod as in Mesos)."""
    return DeviceRule("c", gpu.major, gpu.minor, "rwm")


def gpu_rules(gpus: Iterable[Gpu]) -> list[DeviceRule]:
    """``gpu_rule`` of each GPU, lowest minor first."""
    return [gpu_rule(g) for g in sorted(gpus)]


class Policies:
    """Container policies by the set of GPUs held (see the module rules)."""

    def __init__(self, control_devices: Iterable[DeviceRule],
                 rules: Callable[[Iterable[Any]], list[DeviceRule]] | None = None) -> None:
        self.control_devices = list(control_devices)
        self._rules = rules if rules is not None else gpu_rules
        self._by_gpus: dict[frozenset[Gpu], Policy] = {}

    def of(self, gpus: Iterable[Gpu]) -> Policy:
        """The device policy of a container holding ``gpus``."""
        key = frozenset(gpus)
        policy = self._by_gpus.get(key)
        if policy is None:
            policy = Policy.container(self.control_devices, self._rules(key))
            if len(self._by_gpus) >= 256:
                self._by_gpus.clear()
            self._by_gpus[key] = policy
        return policy

    def __len__(self) -> int:
        return len(self._by_gpus)


class ContainerRecord:
    """What the isolator knows of one top-level container besides its units
    (those are in the ``GpuLedger``): its cgroup, who watches it."""

    __slots__ = ("container_id", "cgroup", "watchers", "health")

    def __init__(self, container_id: ContainerID, cgroup: str) -> None:
        self.container_id = container_id
        self.cgroup = cgroup
        self.watchers: list[Promise] = []
        """Promises of ContainerLimitation handed out by ``watch``."""
        self.health: Future | None = None
        """The allocator's watch of its units while there are watchers."""
