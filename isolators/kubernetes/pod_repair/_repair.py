"""PodRepair: pods keep the GPUs the kubelet gave them (R-PR-2..5), whatever reloaded their device rules.

Rules:
- One pass (``run_pass``; passes never overlap): the ``/dev/char`` links
  of every node offered made again where missing (``ensure_char_links``,
  each refusal logged once; so at start and whenever nodes change); one
  PodResources ``List`` (``AssignedDevices``; a failure is logged once
  while it lasts, the pass answers ``waiting`` and checks nothing, the
  plugin keeps serving) -- or the answer of the List its front door
  made for the whole pass (``run_pass(assigned)``: the device plugin
  shares its one List a pass with the node ledger); the node's pod
  containers surveyed (``PodHost.survey``: their cgroups under the kubepods
  roots and the identity their runtime recorded); then, for each container
  that the kubelet says holds device IDs of a resource this plugin offers:
  - IDs it never offered (or a resource's IDs named twice) → failed,
    nothing granted;
  - its identity joined to its cgroups through the runtime's record (the
    OCI config's pod uid must be the cgroup's: another one, or none, is a
    failure, nothing granted); none of the node's pod containers joined
    to it while some have no record (or no pod container found at all)
    → failed, the reason naming where records were looked for
    (``PodHost.records_looked_in``: R-PR-6); more than one live container
    of one name → failed;
  - checked (one ``PodHost.check_all`` job for every candidate): the
    GPU and capability nodes its own ``/dev`` holds (of the numbers this
    plugin offers) must be exactly those of its units, else failed
    ("the sources disagree"), nothing granted; a container with no process
    left is skipped;
  - prevention (R-PR-7), with ``systemd`` connected: the first time the
    plugin sees a container whose scope systemd manages
    (``SystemdScopes.unit_of``, asked once a container), the rules of its
    grant are added to the scope's ``DeviceAllow=`` (runtime), so a reload
    keeps them (logged at INFO; a refusal is logged once and tried again
    next pass);
  - the rules of its grant (``container_grant``: its GPUs' nodes, MIG
    capability nodes, the control devices, as the CDI spec gives them)
    that the kernel refuses are given back, one executor job per
    container (``PodHost.repair``): where systemd manages the scope,
    through systemd (``DeviceAllow=`` again: systemd applies its record
    with a program of its own and detaches its previous one; the job then
    waits, bounded, for the kernel to agree, R-PR-8), else in the kernel
    directly; logged at WARNING naming pod, namespace, container, GPUs
    (UUIDs), cgroup and what was written. systemd refusing is a failure,
    nothing written.
- Nothing else is ever touched: not a container without this plugin's
  devices, not a device the container was not given.
- The result (``RepairPass``) is what ``POST /kubelet-plugin/repair``
  answers: ``checked`` (containers checked), ``repaired`` and ``failed``
  (pod, namespace, container, GPUs, and for failures the reason).
  Counters: ``passes``, ``repaired`` (containers given access back),
  ``failures`` (a failure is counted and logged when it first appears,
  not again each pass while it lasts).
- ``start()`` (once, before the first pass; ``run`` calls it) connects
  ``systemd`` and logs what repair can do on this node (R-PR-6); a
  ``Reloading(false)`` from systemd wakes ``run`` for a pass at once.
- ``run(interval_s, one_pass=None)`` passes until cancelled, the first
  at once, then every ``interval_s`` seconds or at once after a systemd
  reload (``one_pass``: the front door's own pass, which calls
  ``run_pass(assigned)``; default ``run_pass()``);
  ``close()`` shuts its executor, closes the lister and disconnects
  systemd.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import anyio
import msgspec

from actors.devices import DeviceRule
from actors.mig import MigCapabilities, Unit
from runtime import Executor

from ..._types import ContainerDevice
from ...cdi import container_grant
from .._catalog import UnitCatalog
from .._errors import PluginRequestError
from ._access import AccessError
from ._dev_char import CharLinks
from ._cgroups import ContainerCgroup, PodIdentity
from ._pod_resources import AssignedDevices, PodResourcesUnavailable
from ._systemd import SystemdRefused, SystemdScopes

__all__ = ["ContainerCheck", "FailedContainer", "ObservedContainer", "PodHost", "PodRepair", "RepairPass",
           "RepairedContainer"]

logger = logging.getLogger(__name__)


class ObservedContainer(msgspec.Struct, frozen=True, kw_only=True):
    """A pod's container as the node records it: its cgroups (one per hierarchy) and its runtime's identity."""

    container_id: str
    pod_uid: str
    cgroups: tuple[ContainerCgroup, ...]
    identity: PodIdentity | None = None


class ContainerCheck(msgspec.Struct, frozen=True, kw_only=True):
    """What the kernel says of one container."""

    dev_nodes: dict[tuple[int, int], str] | None = None
    """GPU and capability nodes in its /dev by (major, minor); None: no process left."""
    missing: tuple[DeviceRule, ...] = ()
    error: str | None = None


class PodHost(Protocol):
    """The node's side of the repair (the kernel; ``testing.MemoryPodHost`` in memory). Blocking."""

    def survey(self) -> list[ObservedContainer]: ...

    def check_all(self, items: Sequence[tuple[ObservedContainer, Sequence[DeviceRule]]]) -> list[ContainerCheck]: ...

    def repair(self, container: ObservedContainer, rules: Sequence[DeviceRule], *,
               through_systemd: bool = False) -> list[str]: ...

    def link_nodes(self, nodes: Sequence[ContainerDevice]) -> CharLinks: ...

    def records_looked_in(self) -> str: ...


class PodResourcesLister(Protocol):
    def list(self) -> list[AssignedDevices]: ...


class RepairedContainer(msgspec.Struct, frozen=True, kw_only=True):
    pod: str
    namespace: str
    container: str
    gpus: list[str]


class FailedContainer(msgspec.Struct, frozen=True, kw_only=True):
    pod: str
    namespace: str
    container: str
    gpus: list[str]
    reason: str


class RepairPass(msgspec.Struct, kw_only=True):
    checked: int = 0
    repaired: list[RepairedContainer] = msgspec.field(default_factory=list)
    failed: list[FailedContainer] = msgspec.field(default_factory=list)
    waiting: str | None = None
    """Why nothing was checked (PodResources did not answer)."""

    def answer(self) -> dict[str, Any]:
        """What ``POST /kubelet-plugin/repair`` answers: checked, repaired, failed (and waiting when it waits)."""
        answer: dict[str, Any] = {"checked": self.checked, "repaired": self.repaired, "failed": self.failed}
        if self.waiting is not None:
            answer["waiting"] = self.waiting
        return answer


class _Wanted(msgspec.Struct, kw_only=True):
    namespace: str
    pod: str
    container: str
    units: list[Unit] = []
    gpus: list[str] = []
    problem: str | None = None


class PodRepair:
    """Pod device access repair over a catalog's devices (see module rules)."""

    def __init__(self, catalog: UnitCatalog, lister: PodResourcesLister, host: PodHost, *,
                 control_devices: dict[str, DeviceRule], dev_dir: str, caps: MigCapabilities | None = None,
                 executor: Executor | None = None, systemd: SystemdScopes | None = None) -> None:
        self.catalog = catalog
        self.lister = lister
        self.host = host
        self.systemd = systemd
        self._started = False
        self._wake: anyio.Event | None = None
        self._units: dict[str, str | None] = {}
        """Container id -> the scope systemd manages for it (None: not systemd's), asked once a container."""
        self._prevented: set[str] = set()
        """Container ids whose scope's DeviceAllow= holds their grant (R-PR-7)."""
        self.control_devices = control_devices
        self.dev_dir = dev_dir
        self.caps = caps
        self.executor = executor or Executor(1, name="pod-repair")
        self.passes = 0
        self.repaired = 0
        self.failures = 0
        self._lock = asyncio.Lock()
        """An asyncio lock: the route's pass runs in the plugin process, the periodic one in a task."""
        self._waiting: str | None = None
        self._reported: set[tuple[str, ...]] = set()
        units = sorted(catalog.units)
        self.all_nodes = tuple(self.nodes_of(units))
        control = {(rule.major, rule.minor) for rule in control_devices.values()}
        self._gpu_numbers = {(node.major, node.minor) for node in self.all_nodes
                             if (node.major, node.minor) not in control}
        """(major, minor) of every GPU and capability node offered: what a container's /dev is read for."""

    def nodes_of(self, units: Iterable[Unit]) -> tuple[ContainerDevice, ...]:
        """The device nodes a container holding ``units`` is given (its grant: GPUs, MIG capabilities, control)."""
        return container_grant(list(units), self.catalog.uuids, self.control_devices, self.dev_dir,
                               caps=self.caps).devices

    def close(self) -> None:
        """Shut its executor down and close the lister (its channel to the kubelet) when it can be closed."""
        self.executor.shutdown(wait=False)
        close = getattr(self.lister, "close", None)
        if close is not None:
            close()
        if self.systemd is not None:
            self.systemd.close()

    async def start(self) -> None:
        """Connect systemd and say what repair can do on this node (see module rules); once."""
        if self._started:
            return
        self._started = True
        self._wake = anyio.Event()
        if self.systemd is None:
            return
        reason = await self.systemd.connect()
        level, line = self.systemd.status_line(reason, self.systemd.address)
        logger.log(level, line)
        if reason is None:
            self.systemd.on_reload(self._reloaded)

    def _reloaded(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- one pass --------------------------------------------------------------------------
    async def run(self, interval_s: float, one_pass: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Passes every ``interval_s`` seconds until cancelled; a pass that
        raises is logged (once while it fails the same way) and counted in
        ``repair_failures``, and the next one runs as usual. A systemd
        reload that finished starts the next pass at once."""
        await self.start()
        while True:
            try:
                await (one_pass or self.run_pass)()
            except Exception as error:  # a repair problem never takes the device plugin down
                self.failures += 1
                self._report_once(("pass", type(error).__name__, str(error)), logging.ERROR,
                                  "Pod repair pass failed: %s: %s; the plugin keeps serving its GPUs and tries"
                                  " again every %s s", type(error).__name__, error, interval_s)
            with anyio.move_on_after(interval_s):
                assert self._wake is not None
                await self._wake.wait()
            self._wake = anyio.Event()

    async def run_pass(self, assigned: Sequence[AssignedDevices] | PodResourcesUnavailable | None = None
                       ) -> RepairPass:
        """One pass (see module rules); ``assigned``: the answer (or failure) of the front door's List for this
        pass, None to List here."""
        async with self._lock:
            result = await self._pass(assigned)
            self.passes += 1
            return result

    async def _pass(self, listed: Sequence[AssignedDevices] | PodResourcesUnavailable | None) -> RepairPass:
        links = await self.executor.run(self.host.link_nodes, self.all_nodes)
        for link in links.made:
            logger.info("Made %s, so that systemd keeps this device in the pods' device rules", link)
        for link, why in links.refused:
            self._report_once(("link", link, why), logging.WARNING,
                              "Left %s alone: %s; systemd cannot resolve the node through it, so a daemon-reload"
                              " may drop it from pods (pod repair gives it back)", link, why)
        try:
            if isinstance(listed, PodResourcesUnavailable):
                raise listed
            assigned = listed if listed is not None else await self.executor.run(self.lister.list)
        except PodResourcesUnavailable as error:
            if self._waiting is None:
                logger.warning("Pod repair waits for the kubelet's PodResources API: %s; the plugin keeps serving"
                               " and tries again every pass", error)
            self._waiting = str(error)
            return RepairPass(waiting=str(error))
        if self._waiting is not None:
            logger.info("The kubelet's PodResources API answers again: pod repair resumes")
            self._waiting = None
        wanted = self._wanted(assigned)
        result = RepairPass()
        if not wanted:
            return result
        observed = await self.executor.run(self.host.survey)
        present = {container.container_id for container in observed}
        self._units = {cid: unit for cid, unit in self._units.items() if cid in present}
        self._prevented &= present
        by_name: dict[tuple[str, str, str], list[ObservedContainer]] = {}
        for container in observed:
            if container.identity is not None:
                key = (container.identity.namespace, container.identity.pod, container.identity.container)
                by_name.setdefault(key, []).append(container)
        unrecorded = [container for container in observed if container.identity is None]
        candidates: list[tuple[_Wanted, ObservedContainer, tuple[DeviceRule, ...], set[tuple[int, int]]]] = []
        for key, want in wanted.items():
            if want.problem is not None:
                self._fail(result, want, want.problem)
                continue
            found = by_name.get(key, [])
            if not found and (unrecorded or not observed):
                self._fail(result, want, self._unjoined(bool(unrecorded)))
                continue
            joined = [c for c in found if c.identity is not None and c.identity.pod_uid == c.pod_uid]
            for container in found:
                if container not in joined:
                    named = f"pod uid {container.identity.pod_uid}" if container.identity.pod_uid else "no pod uid"
                    self._fail(result, want, f"the sources disagree: the runtime's record of container"
                                             f" {container.container_id[:12]} names {named}, its cgroup pod uid"
                                             f" {container.pod_uid}; nothing granted")
            nodes = self.nodes_of(want.units)
            rules = tuple(dict.fromkeys(DeviceRule(node.type, node.major, node.minor, node.permissions)
                                        for node in nodes))
            expected = {(n.major, n.minor) for n in nodes if (n.major, n.minor) in self._gpu_numbers}
            candidates += [(want, container, rules, expected) for container in joined]
        if not candidates:
            return result
        checks = await self.executor.run(self.host.check_all, [(container, rules) for _, container, rules, _ in
                                                               candidates])
        live: dict[tuple[str, str, str], list[int]] = {}
        for index, ((want, container, _rules, _expected), check) in enumerate(zip(candidates, checks)):
            if check.error is None and check.dev_nodes is not None:
                live.setdefault((want.namespace, want.pod, want.container), []).append(index)
        for index, ((want, container, rules, expected), check) in enumerate(zip(candidates, checks)):
            where = f"container {container.container_id[:12]}"
            if check.error is not None:
                self._fail(result, want, f"{where}: {check.error}")
                continue
            if check.dev_nodes is None:
                continue  # no process left: the container ended
            if len(live[(want.namespace, want.pod, want.container)]) > 1:
                self._fail(result, want, f"more than one running container of that name ({where} is one);"
                                         " nothing granted")
                continue
            result.checked += 1
            seen = {numbers for numbers in check.dev_nodes if numbers in self._gpu_numbers}
            if seen != expected:
                self._fail(result, want, f"the sources disagree: PodResources gives {', '.join(want.gpus)}"
                                         f" (nodes {_numbers(expected)}), {where}'s /dev holds"
                                         f" {_numbers(seen) or 'none of them'}; nothing granted")
                continue
            unit = await self._unit_of(container)
            done_now = None
            if unit is not None and container.container_id not in self._prevented:
                done_now = await self._prevent(want, container, unit, rules)
            if not check.missing:
                continue
            try:
                actions = []
                if unit is not None:
                    actions.append(done_now or await self._systemd().allow(unit, check.missing, self.dev_dir))
                actions += await self.executor.run(functools.partial(
                    self.host.repair, container, check.missing, through_systemd=unit is not None))
            except SystemdRefused as error:
                self._fail(result, want, f"{where}: {error}; nothing written (systemd manages its scope, so its device"
                                         " program is replaced by systemd alone)")
                continue
            except AccessError as error:
                self._fail(result, want, f"{where}: {error}")
                continue
            self.repaired += 1
            result.repaired.append(RepairedContainer(pod=want.pod, namespace=want.namespace,
                                                     container=want.container, gpus=list(want.gpus)))
            logger.warning("Repaired pod %s/%s container %s (%s, GPUs %s): the kernel refused %s; %s",
                           want.namespace, want.pod, want.container, container.container_id[:12],
                           ", ".join(want.gpus), ", ".join(str(rule) for rule in check.missing),
                           "; ".join(actions) or "nothing to write")
        return result

    def _systemd(self) -> SystemdScopes:
        assert self.systemd is not None
        return self.systemd

    async def _unit_of(self, container: ObservedContainer) -> str | None:
        """The scope systemd manages for the container (asked once a container), or None."""
        if self.systemd is None or not self.systemd.connected:
            return None
        if container.container_id not in self._units:
            units = [await self.systemd.unit_of(cgroup) for cgroup in container.cgroups]
            self._units[container.container_id] = next((unit for unit in units if unit), None)
        return self._units[container.container_id]

    async def _prevent(self, want: _Wanted, container: ObservedContainer, unit: str,
                       rules: Sequence[DeviceRule]) -> str | None:
        """The grant added to the scope's DeviceAllow= (R-PR-7); what was done, or None when systemd refused."""
        try:
            done = await self._systemd().allow(unit, rules, self.dev_dir)
        except SystemdRefused as error:
            self._report_once(("prevent", container.container_id, str(error)), logging.WARNING,
                              "Could not add pod %s/%s container %s's GPUs (%s) to its scope's DeviceAllow=: %s; a"
                              " daemon-reload may take them (pod repair gives them back); tried again next pass",
                              want.namespace, want.pod, want.container, ", ".join(want.gpus), error)
            return None
        self._prevented.add(container.container_id)
        logger.info("Pod %s/%s container %s (%s, GPUs %s): %s, so that a daemon-reload keeps them", want.namespace,
                    want.pod, want.container, container.container_id[:12], ", ".join(want.gpus), done)
        return done

    def _unjoined(self, unrecorded: bool) -> str:
        if unrecorded:
            return (f"no runtime record names it: some of this node's pod containers have no record in"
                    f" {self.host.records_looked_in()}, so which one it is cannot be told; nothing checked (name the"
                    " runtime's place with --container_config)")
        return ("no pod container found: no cgroup of a pod's container under the kubepods roots the plugin reads"
                " (its start-up log names them; --kubepods_root); nothing checked")

    def _wanted(self, assigned: Sequence[AssignedDevices]) -> dict[tuple[str, str, str], _Wanted]:
        wanted: dict[tuple[str, str, str], _Wanted] = {}
        for entry in assigned:
            if not entry.ids:
                continue
            try:
                named = self.catalog.units_of(entry.resource, entry.ids)
            except PluginRequestError as error:
                named, problem = [], (f"PodResources names device IDs this plugin never offered: {error}; nothing"
                                      " granted")
            else:
                if named is None:
                    continue
                problem = None
            key = (entry.namespace, entry.pod, entry.container)
            want = wanted.setdefault(key, _Wanted(namespace=entry.namespace, pod=entry.pod,
                                                  container=entry.container))
            if problem is not None:
                want.problem = problem
                continue
            units = [unit for unit in named if unit not in want.units]
            want.units += units
            want.gpus += [self.catalog.uuids[unit] for unit in dict.fromkeys(units)]
        return wanted

    def _fail(self, result: RepairPass, want: _Wanted, reason: str) -> None:
        result.failed.append(FailedContainer(pod=want.pod, namespace=want.namespace, container=want.container,
                                             gpus=list(want.gpus), reason=reason))
        if self._report_once(("failed", want.namespace, want.pod, want.container, reason), logging.WARNING,
                             "Pod repair left pod %s/%s container %s (GPUs %s) alone: %s", want.namespace, want.pod,
                             want.container, ", ".join(want.gpus) or "-", reason):
            self.failures += 1

    def _report_once(self, key: tuple[str, ...], level: int, message: str, *args: Any) -> bool:
        if key in self._reported:
            return False
        if len(self._reported) > 10_000:
            self._reported.clear()
        self._reported.add(key)
        logger.log(level, message, *args)
        return True


def _numbers(numbers: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"{major}:{minor}" for major, minor in sorted(numbers))
