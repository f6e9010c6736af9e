"""Deny by default: the ``--confine`` cgroups reach no GPU (SPEC R-SC-8).

Rules:
- Every cgroup given with ``--confine`` gets every GPU and MIG node the
  isolator hands out denied (``isolator.unit_rules()`` as ``rwm`` rules,
  ``DeviceControl.confine``), for it and every cgroup below it.
- ``deny(isolator.unit_rules)`` runs before the service serves: a cgroup that
  cannot be confined stops the start (its error is raised).
- ``again()`` runs on every tick: a failure is logged once per distinct
  error (the cgroup's processes may reach GPUs meanwhile) and tried again
  on the next tick. A repair is logged: the first success after a
  failure, and on cgroups v2 our program found missing or changed (v1
  writes its deny rules again on every call, which is not news).
- Its log lines name the cgroup (no container is involved).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from actors.devices import DeviceRule

__all__ = ["Confinement"]

logger = logging.getLogger(__name__)


class Confinement:
    """The ``--confine`` cgroups and what is denied to them (see module rules)."""

    def __init__(self, devices: Any, paths: tuple[str, ...]) -> None:
        self.devices = devices
        self.paths = paths
        self.rules: list[DeviceRule] = []
        self._errors: dict[str, str] = {}

    async def deny(self, unit_rules: Callable[[], Iterable[DeviceRule]]) -> None:
        """Confine every cgroup once, before anyone is served (a failure raises);
        ``unit_rules``: the isolator's, asked only when there is a cgroup to confine."""
        if not self.paths:
            return
        self.rules = [DeviceRule(r.type, r.major, r.minor, "rwm") for r in unit_rules()]
        for path in self.paths:
            await self.devices.confine(path, self.rules)
            logger.info("Confined %s: every GPU and MIG node denied to it and below (%d rule(s))", path,
                        len(self.rules))

    async def again(self) -> None:
        """Deny every GPU to the ``--confine`` cgroups again (a repair is logged)."""
        for path in self.paths:
            try:
                repairs = await self.devices.confine(path, self.rules)
            except Exception as error:
                if self._errors.get(path) != str(error):
                    self._errors[path] = str(error)
                    logger.error("Cannot confine %s: %s; its processes may reach GPUs", path, error)
                continue
            if self._errors.pop(path, None) is not None or (repairs and self.devices.backend_name == "cgroups_v2"):
                logger.warning("Confined %s again: %s", path, "; ".join(repairs) or "every GPU denied")
