"""KubeletPluginProcess: the plugin's decisions, in one actor.

Rules (R-K8-3, R-K8-4, R-K8-8, R-K8-9):
- One process, id ``kubelet-plugin``, over the components' allocator (its
  health and topology; nothing is allocated from it: under Kubernetes the
  kubelet decides which pod holds a device, and the container runtime
  applies the device rules from the CDI spec), the ``DeviceCatalog`` and
  the node's facts (``NodeFacts``). The gRPC servicers translate messages
  and ask it.
- ``allocate(resource, requests)``: every container request is answered
  (``allocate_answer``) or the whole call is refused; the CDI node spec is
  made current (rewritten when missing or changed, one executor job)
  before any name is handed out, so the names resolve when the runtime
  creates the container; with the node ledger (``leases``, SPEC R-NL-4)
  the units of every request are then taken (``PodLeases.take``: all or
  none, a unit another front door holds refuses the call naming unit,
  owner and holder). Counted: ``allocations`` (container requests
  answered), ``allocation_failures`` (calls refused).
- MPS shares (``--mps_replicas``, ``shares``: a ``PodShares``): once the
  units are taken, every share the requests name is granted by its unit's
  daemon (``PodShares.grant``: a refusal refuses the call naming why), and
  each answer names, beside the unit, the unit's MPS edits
  (``nvidia.com/gpu-mps=<UUID>``, from the spec ``gpu-isolator-mps.json``
  that ``write_spec`` keeps with the node spec); each pass gives the List
  to ``PodShares.reconcile`` first, which returns the shares no pod holds
  (a unit's last share stops its daemon), then to ``PodLeases``, so a unit
  goes back to the ledger only once its daemon stopped.
- ``run_pass()`` is the plugin's pass (``PodLeases`` and pod repair's,
  never two at once): ONE PodResources ``List`` (``lister``, on an
  executor of its own), its answer given to the node ledger's
  ``PodLeases.reconcile`` (when the ledger is on and the List answered),
  then to pod repair (``PodRepair.run_pass``: its ``RepairPass`` is the
  pass's answer; None without repair), then one re-read of the node
  ledger (``refresh_ledger``: what other front doors took or returned
  shows in ``ListAndWatch`` within a pass). With neither the ledger nor
  repair there is no pass. A List that fails with the ledger on (the
  units Allocate took stay leased meanwhile), or a re-read of the ledger
  that fails, is logged once while it lasts.
- ``preferred(resource, requests)``: per request, ``plan_preferred`` then
  the allocator's choice among those units.
- ``registered(resource)`` counts a registration the kubelet accepted.
- ``write_spec()`` writes the node spec (``gpu-isolator-node.json`` in
  the CDI spec dir) when missing or different; ``create`` writes it, then
  spawns the process, so a plugin that cannot write it never starts.
- ``POST /kubelet-plugin/mark_healthy`` (the operator's recovery, R-K8-9):
  without the bearer credential (``--credential``) 401 and nothing
  changes; a plugin started without ``--credential`` answers 403 to
  everyone; then only POST (405), a JSON body ``{"uuid": "<GPU or MIG
  UUID>"}`` (400), a UUID this plugin offers (404); then the allocator's
  ``mark_healthy``: 200 with ``{"uuid", "unit", "healthy": true,
  "was_unhealthy"}``; the next ``ListAndWatch`` list shows it ``Healthy``.
- ``POST /kubelet-plugin/repair`` (R-PR-4, the operator who just ran
  ``systemctl daemon-reload``): the same credential checks as
  ``mark_healthy`` (403 without ``--credential``, 401, 405); a plugin
  started with ``--repair_pods=false`` answers 409; then one pass of the
  plugin's pass now (it waits for a pass under way): 200 with
  ``{"checked": N, "repaired": [{"pod", "namespace", "container",
  "gpus"}], "failed": [{..., "reason"}]}`` (and ``"waiting"`` when
  PodResources did not answer).
- Metrics (published in ``publish``, given back when it ends):
  counters ``kubelet/registrations``, ``kubelet/allocations``,
  ``kubelet/allocation_failures``; with pod repair ``kubelet/repair_passes``,
  ``kubelet/pods_repaired``, ``kubelet/repair_failures``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec


from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError
from runtime import Executor, MetricSet, Response, spawn

from ...cdi import CdiWriteError, NodeFacts, ensure_spec_file
from ...credential import BearerCredential
from ._allocate import ContainerAnswer, allocate_answer
from ._catalog import DeviceCatalog
from .._errors import FAILED_PRECONDITION, PluginRequestError
from .._operator import OperatorRoutes
from ..pod_repair import PodRepair, PodResourcesUnavailable, RepairPass
from ._leases import PodLeases
from ._preferred import plan_preferred

__all__ = ["KubeletPluginProcess", "PLUGIN_ID", "NODE_SPEC_FILE"]

logger = logging.getLogger(__name__)

PLUGIN_ID = "kubelet-plugin"
NODE_SPEC_FILE = "gpu-isolator-node.json"


class KubeletPluginProcess(OperatorRoutes):
    """The kubelet plugin's decisions (see module rules)."""

    def __init__(self, catalog: DeviceCatalog, allocator: NvidiaGpuAllocator, facts: NodeFacts, spec: bytes, *,
                 spec_dir: str, dev_dir: str, pass_device_specs: bool = False,
                 credential: BearerCredential | None = None, repair: PodRepair | None = None,
                 leases: PodLeases | None = None, lister: Any = None, shares: Any = None,
                 mps_spec: bytes | None = None) -> None:
        super().__init__(PLUGIN_ID)
        self.shares = shares
        """``PodShares`` with ``--mps_replicas``, else None."""
        self.mps_spec = mps_spec
        self.repair = repair
        self.leases = leases
        self.lister = lister if lister is not None else (repair.lister if repair is not None else None)
        """PodResources ``List`` (blocking): the pass's one call."""
        self._pass_lock = asyncio.Lock()
        self._pass_executor = Executor(1, name="kubelet-plugin-pass")
        self._waiting: str | None = None
        self._ledger_failing: str | None = None
        self.catalog = catalog
        self.allocator = allocator
        self.facts = facts
        self.spec = spec
        self.spec_dir = spec_dir
        self.dev_dir = dev_dir
        self.pass_device_specs = pass_device_specs
        self.credential = credential
        self.registrations = 0
        self.allocations = 0
        self.allocation_failures = 0
        self.executor = Executor(1, name="kubelet-plugin")
        """Blocking file work: the spec, the sockets' identities."""

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> "KubeletPluginProcess":
        """The process (arguments as ``__init__``), spawned once its spec is written."""
        plugin = cls(*args, **kwargs)
        try:
            await plugin.write_spec()  # before anything is served: a name handed out must resolve
        except BaseException:
            plugin.close()
            raise
        spawn(plugin)
        return plugin

    def close(self) -> None:
        """Shut its executors down (it ends with the command)."""
        self.executor.shutdown(wait=False)
        self._pass_executor.shutdown(wait=False)

    def finalize(self) -> None:
        super().finalize()
        self._pass_executor.shutdown(wait=False)

    def publish(self, metrics: MetricSet) -> None:
        metrics.counter("kubelet/registrations", "registrations the kubelet accepted",
                        read=lambda: self.registrations)
        metrics.counter("kubelet/allocations", "container requests the plugin answered with devices",
                        read=lambda: self.allocations)
        metrics.counter("kubelet/allocation_failures", "Allocate calls the plugin refused",
                        read=lambda: self.allocation_failures)
        self.route("/repair", KubeletPluginProcess._repair_route,
                   help="POST with the bearer credential: one pod repair pass now (after a systemctl daemon-reload)")
        repair = self.repair
        if repair is not None:
            metrics.counter("kubelet/repair_passes", "pod repair passes run", read=lambda: repair.passes)
            metrics.counter("kubelet/pods_repaired", "containers given back the GPU access a reload took",
                            read=lambda: repair.repaired)
            metrics.counter("kubelet/repair_failures", "containers pod repair could not judge or repair",
                            read=lambda: repair.failures)

    # -- the node spec -----------------------------------------------------------------
    async def write_spec(self) -> str | None:
        """Make the spec file hold the node spec: None when it did, else why it was written."""
        state = await self.executor.run(ensure_spec_file, self.spec_dir, NODE_SPEC_FILE, self.spec)
        if state is not None:
            logger.info("Wrote the CDI node spec %s/%s (it %s)", self.spec_dir, NODE_SPEC_FILE, _spec_was(state))
        if self.mps_spec is not None:
            from ._shares import MPS_SPEC_FILE

            written = await self.executor.run(ensure_spec_file, self.spec_dir, MPS_SPEC_FILE, self.mps_spec)
            if written is not None:
                logger.info("Wrote the CDI spec of MPS shares %s/%s (it %s)", self.spec_dir, MPS_SPEC_FILE,
                            _spec_was(written))
            state = state or written
        return state

    # -- the kubelet's calls ---------------------------------------------------------------
    def registered(self, resource: str) -> None:
        self.registrations += 1

    async def allocate(self, resource: str, requests: list[list[str]]) -> list[ContainerAnswer]:
        """Answers for every container request, or the call refused (see module rules)."""
        offer = self.catalog.by_resource[resource]
        snapshot = await self.allocator.health_since(None)
        try:
            answers = [
                allocate_answer(offer, ids, snapshot.unhealthy, uuids=self.catalog.uuids,
                                control_devices=self.facts.control_devices, dev_dir=self.dev_dir,
                                caps=self.facts.caps, pass_device_specs=self.pass_device_specs)
                for ids in requests
            ]
            try:
                await self.write_spec()
            except CdiWriteError as error:
                raise PluginRequestError(FAILED_PRECONDITION, f"{error}; the CDI device names would not resolve,"
                                                              " so nothing was allocated") from error
            if self.leases is not None:  # taken in the node ledger before the kubelet hears of them
                await self.leases.take(resource, [(ids, self.catalog.units_of(resource, ids) or [])
                                                  for ids in requests])
            if self.shares is not None:  # MPS: each share granted by its unit's daemon before the answer
                from ._shares import mps_device_name

                offer = self.catalog.by_resource[resource]
                await self.shares.grant([offer.by_id[i] for ids in requests for i in ids])
                answers = [msgspec.structs.replace(answer, cdi_devices=[
                    *answer.cdi_devices, *(mps_device_name(uuid) for uuid in dict.fromkeys(
                        offer.by_id[i].uuid for i in ids if offer.by_id[i].share is not None))])
                    for ids, answer in zip(requests, answers)]
        except PluginRequestError as error:
            self.allocation_failures += 1
            logger.warning("Allocate for %s refused: %s", resource, error)
            raise
        self.allocations += len(answers)
        for ids, answer in zip(requests, answers):
            logger.info("Allocate for %s: %s -> %s", resource, ", ".join(ids), ", ".join(answer.cdi_devices))
        return answers

    async def preferred(self, resource: str, requests: list[tuple[list[str], list[str], int]]) -> list[list[str]]:
        """The suggested IDs per request (see module rules)."""
        offer = self.catalog.by_resource[resource]
        plans = [plan_preferred(offer, available, must, size) for available, must, size in requests]
        answers = []
        for plan in plans:
            chosen = await self.allocator.preferred(plan.candidates, plan.count, plan.include)
            answers.append(plan.finish(chosen))
        return answers

    # -- the pass ----------------------------------------------------------------------------
    @property
    def has_pass(self) -> bool:
        """Whether the plugin runs passes (the node ledger or pod repair needs them)."""
        return self.lister is not None and (self.leases is not None or self.repair is not None
                                            or self.shares is not None)

    async def run_pass(self) -> RepairPass | None:
        """One pass: one PodResources List for the node ledger and pod repair (see module rules)."""
        async with self._pass_lock:
            started = time.monotonic()
            try:
                assigned: Any = await self._pass_executor.run(self.lister.list)
            except PodResourcesUnavailable as error:
                assigned = error
                if self.leases is not None and self._waiting is None:
                    logger.warning("The node ledger waits for the kubelet's PodResources API to learn which pods hold"
                                   " this plugin's units: %s; they stay leased meanwhile", error)
                self._waiting = str(error)
            else:
                if self.leases is not None and self._waiting is not None:
                    logger.info("The kubelet's PodResources API answers again: the node ledger gets back what no"
                                " pod holds")
                self._waiting = None
            if self.shares is not None and not isinstance(assigned, PodResourcesUnavailable):
                await self.shares.reconcile(assigned, started)  # first: a unit goes back once its daemon stopped
            if self.leases is not None and not isinstance(assigned, PodResourcesUnavailable):
                await self.leases.reconcile(assigned, started)
            result = await self.repair.run_pass(assigned) if self.repair is not None else None
            if self.leases is not None:
                await self._refresh_ledger()
            return result

    async def _refresh_ledger(self) -> None:
        """One re-read of the node ledger; a failure is logged once while it lasts (the next pass tries again)."""
        try:
            await self.allocator.refresh_ledger()
        except AllocatorError as error:
            if self._ledger_failing != str(error):
                logger.error("Reading the node ledger failed (%s); the next pass tries again", error)
            self._ledger_failing = str(error)
        else:
            if self._ledger_failing is not None:
                logger.info("The node ledger reads again")
            self._ledger_failing = None

    # -- the operator's routes -----------------------------------------------------------
    async def _repair_route(self, request: Any) -> Response:
        refused = self._operator_refusal(request, "run a pod repair", "")
        if refused is not None:
            return refused
        if self.repair is None:
            return Response.error(409, "pod repair is off (--repair_pods=false); restart the plugin without it")
        logger.info("Operator at %s asked for a pod repair pass", request.client)
        result = await self.run_pass()
        assert result is not None
        return Response.json(result.answer())


def _spec_was(state: str) -> str:
    """What ``ensure_spec_file``'s answer says of the file before it was written."""
    return "was missing" if state == "missing" else "differed from what this plugin serves"
