"""systemd's record of a container scope: ``DeviceAllow=`` through D-Bus, so the next reload keeps the GPUs (R-PR-4).

Rules:
- With the systemd cgroup driver a container's cgroup is a scope systemd
  owns; each ``daemon-reload`` re-applies its device rules from systemd's
  record, so a repair written only to the kernel lasts until the next one.
  The durable repair adds the devices to that record:
  ``org.freedesktop.systemd1.Manager.SetUnitProperties(unit, runtime=true,
  [("DeviceAllow", [(path, access), ...])])`` (runtime: gone at reboot,
  as the scope is), which systemd applies at once.
- ``SystemdScopes.unit_of(cgroup)`` is the scope's unit name when systemd
  manages it: the cgroup's last path component is a ``.scope`` unit name
  (letters, digits and ``:_.\\-@`` only), systemd runs
  (``/run/systemd/system`` is a directory) and ``busctl`` is found; None
  otherwise (the cgroupfs driver, no systemd: the kernel is written
  directly, as it is after this call too).
- ``allow(unit, rules, dev_dir)`` makes that call with ``busctl --system``
  (bounded by ``timeout_s``), each rule as its ``/dev/char/<major>:<minor>``
  path (the link ``ensure_char_links`` keeps; ``block/`` for block
  devices) and its access; a failure is a ``SystemdRefused`` naming the
  unit and systemd's answer. Blocking: on the executor.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from actors.devices import DeviceRule
from runtime import Failure

from ._cgroups import ContainerCgroup

__all__ = ["SystemdRefused", "SystemdScopes"]

_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\.scope")


class SystemdRefused(Failure):
    """systemd did not take the scope's new ``DeviceAllow=``."""


class SystemdScopes:
    """``DeviceAllow=`` on systemd's scopes (see module rules)."""

    def __init__(self, *, present: bool | None = None, busctl: str | None = None,
                 run: Callable[..., Any] = subprocess.run, timeout_s: float = 10.0) -> None:
        self.present = os.path.isdir("/run/systemd/system") if present is None else present
        self.busctl = busctl or shutil.which("busctl")
        self.run = run
        self.timeout_s = timeout_s

    def unit_of(self, cgroup: ContainerCgroup) -> str | None:
        name = cgroup.path.rsplit("/", 1)[-1]
        if not (self.present and self.busctl and _UNIT.fullmatch(name)):
            return None
        return name

    def command(self, unit: str, rules: Sequence[DeviceRule], dev_dir: str) -> list[str]:
        entries: list[str] = []
        for rule in rules:
            kind = "block" if rule.type == "b" else "char"
            entries += [os.path.join(dev_dir, kind, f"{rule.major}:{rule.minor}"), rule.access]
        return [str(self.busctl), "--system", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                "org.freedesktop.systemd1.Manager", "SetUnitProperties", "sba(sv)", unit, "true", "1",
                "DeviceAllow", "a(ss)", str(len(rules)), *entries]

    def allow(self, unit: str, rules: Sequence[DeviceRule], dev_dir: str) -> str:
        """Add ``rules`` to the scope's ``DeviceAllow=`` (runtime); what was done, as one line."""
        argv = self.command(unit, rules, dev_dir)
        try:
            done = self.run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SystemdRefused(f"systemd did not answer SetUnitProperties on {unit}: {error}") from error
        if done.returncode != 0:
            raise SystemdRefused(f"systemd refused DeviceAllow= on {unit}: {(done.stderr or '').strip()}")
        return (f"systemd {unit}: DeviceAllow= " + ", ".join(f"{argv[i]} {argv[i + 1]}"
                                                            for i in range(len(argv) - 2 * len(rules), len(argv), 2))
                + " (runtime)")
