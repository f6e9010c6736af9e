"""KernelPodHost: the repair's view of this node, from the kernel and the container runtime (R-PR-3, R-PR-4).

Rules:
- ``KernelPodHost(hierarchies, roots, config_templates, dev_dir)``:
  ``hierarchies`` the (mount, version) pairs that hold pods' cgroups (the
  v1 devices hierarchy and/or the cgroup2 mount: on a hybrid node both
  judge every access), ``roots`` the kubepods roots relative to each mount
  (R-PR-1), ``config_templates`` where the runtime keeps a container's OCI
  config (``{id}`` its 64-hex id, validated before any path is built).
- ``survey()`` scans every root of every hierarchy (``scan_kubepods``) and
  groups the cgroups by container id; each container's identity is read
  from the first config template that has a file (``read_identity``) and
  kept while the container's cgroups are seen (a config does not change);
  one not found yet is looked for again on the next survey.
- ``check_all(items)`` reads, per container, a process of its cgroups
  (``first_process``), the GPU nodes in ``/proc/<pid>/root/dev``
  (``gpu_nodes_in``), and the rules the kernel refuses in any of its
  cgroups (``missing_access``); errors (a cgroup gone, a program it cannot
  judge) are that container's ``error``, never the batch's.
- ``repair(container, rules, through_systemd)`` gives back, in each of its
  cgroups, whatever the kernel still refuses. ``through_systemd`` (the
  caller has just added the rules to the scope's ``DeviceAllow=``):
  systemd applies them with a program of its own, so the job waits for
  the kernel to agree (reading it again every 20 ms, at most
  ``settle_s``); then, on v1, what is still refused is written to
  ``devices.allow`` (an addition, nothing to detach later); on v2 nothing
  is written (a program replaced in place is one systemd can no longer
  detach: every reload would leave one more) and what is still refused is
  an ``AccessError`` naming it. Without systemd the kernel is written
  directly (``give_access``, which reads the kernel again after), with the
  ids of the replacements it attached to that cgroup kept while the
  cgroup is seen, so one superseded by a reload is detached (no pile-up
  where systemd manages the scope but cannot be reached).
- ``link_nodes(nodes)`` is ``ensure_char_links`` under ``dev_dir``;
  ``records_looked_in()`` names the config templates, for a failure's
  reason.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from actors.devices import DeviceRule, DeviceControlError

from ..._types import ContainerDevice
from ._dev_char import CharLinks, ensure_char_links
from ._access import AccessError, give_access, missing_access
from ._cgroups import (DEFAULT_CONFIG_TEMPLATES, DEFAULT_KUBEPODS_ROOTS, ContainerCgroup, PodIdentity,
                           first_process, gpu_nodes_in, read_identity, scan_kubepods)
from ._repair import ContainerCheck, ObservedContainer

__all__ = ["KernelPodHost"]


class KernelPodHost:
    """The node's pods as the kernel holds them (see module rules)."""

    def __init__(self, hierarchies: Sequence[tuple[str, int]], roots: Sequence[str] = DEFAULT_KUBEPODS_ROOTS,
                 config_templates: Sequence[str] = DEFAULT_CONFIG_TEMPLATES, *, dev_dir: str = "/dev",
                 proc_dir: str = "/proc", settle_s: float = 2.0) -> None:
        self.hierarchies = tuple(hierarchies)
        self.roots = tuple(roots)
        self.config_templates = tuple(config_templates)
        self.dev_dir = dev_dir
        self.proc_dir = proc_dir
        self.settle_s = settle_s
        self._installed: dict[str, set[int]] = {}
        """cgroup directory -> ids of the programs ``give_access`` attached there (replacements of ours)."""
        self._identities: dict[str, PodIdentity | None] = {}

    def survey(self) -> list[ObservedContainer]:
        cgroups: dict[str, list[ContainerCgroup]] = {}
        for mount, version in self.hierarchies:
            for cgroup in scan_kubepods(mount, version, self.roots):
                cgroups.setdefault(cgroup.container_id, []).append(cgroup)
        known = self._identities
        present = {cgroup.directory for found in cgroups.values() for cgroup in found}
        self._installed = {directory: ids for directory, ids in self._installed.items() if directory in present}
        self._identities = {cid: known.get(cid) or self._identity(cid) for cid in cgroups}
        return [ObservedContainer(container_id=cid, pod_uid=found[0].pod_uid, cgroups=tuple(found),
                                  identity=self._identities[cid])
                for cid, found in cgroups.items()]

    def _identity(self, container_id: str) -> PodIdentity | None:
        for template in self.config_templates:
            path = template.replace("{id}", container_id)
            if os.path.exists(path):
                return read_identity(path)
        return None

    def check_all(self, items: Sequence[tuple[ObservedContainer, Sequence[DeviceRule]]]) -> list[ContainerCheck]:
        return [self._check(container, rules) for container, rules in items]

    def _check(self, container: ObservedContainer, rules: Sequence[DeviceRule]) -> ContainerCheck:
        pid = next((pid for pid in map(first_process, (c.directory for c in container.cgroups)) if pid), None)
        if pid is None:
            return ContainerCheck()
        nodes = gpu_nodes_in(os.path.join(self.proc_dir, str(pid), "root", "dev"))
        missing: dict[DeviceRule, None] = {}
        try:
            for cgroup in container.cgroups:
                missing.update(dict.fromkeys(missing_access(cgroup, rules)))
        except (AccessError, DeviceControlError) as error:
            return ContainerCheck(dev_nodes=nodes, error=str(error))
        return ContainerCheck(dev_nodes=nodes, missing=tuple(missing))

    def repair(self, container: ObservedContainer, rules: Sequence[DeviceRule], *,
               through_systemd: bool = False) -> list[str]:
        done = []
        try:
            if through_systemd:
                deadline = time.monotonic() + self.settle_s
                while any(missing_access(cgroup, rules) for cgroup in container.cgroups):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
            for cgroup in container.cgroups:
                refused = missing_access(cgroup, rules)
                if not refused:
                    continue
                if through_systemd and cgroup.version == 2:
                    raise AccessError(
                        f"after systemd took DeviceAllow= the kernel still refuses {', '.join(map(str, refused))} on"
                        f" {cgroup.directory} within {self.settle_s:g} s; its programs were left as they are (systemd"
                        " manages the scope: a program replaced in place is one it cannot detach)")
                installed = self._installed.setdefault(cgroup.directory, set())
                done += [f"{cgroup.path}: {line}" for line in give_access(cgroup, refused, installed)]
        except DeviceControlError as error:
            raise AccessError(f"{error}; what was written before it stays (each write only adds the container's"
                              " own devices)") from error
        return done

    def link_nodes(self, nodes: Sequence[ContainerDevice]) -> CharLinks:
        return ensure_char_links(self.dev_dir, nodes)

    def records_looked_in(self) -> str:
        return ", ".join(self.config_templates)
