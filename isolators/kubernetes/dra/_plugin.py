"""DraPluginProcess: the DRA driver's decisions, in one actor.

Rules (issue 37 items 3-5; SPEC section 21):
- One process, id ``dra-plugin``, over the components' allocator (health;
  nothing is allocated from it: the scheduler allocates, the container
  runtime applies the CDI spec's device nodes), the ``DraCatalog``, the
  node's CDI facts, the Kubernetes client and the ``PreparedClaims``
  loaded from the checkpoint.
- ``prepare(refs)`` answers every claim asked, by uid: a ``ClaimAnswer``
  with devices, or with ``error`` naming the claim and why (one claim's
  refusal never fails another). A uid already prepared is answered from
  the table (no API request: idempotent, and a deleted claim or a restart
  changes nothing). Otherwise the claim is read from the API server (all
  of a call's claims at once, each bounded by the client's timeout; not
  found, or the server down or slow, is that claim's error) and checked
  (``plan_claim``); a device unhealthy now is refused unless the result
  has admin access; a device prepared for another claim is refused unless
  sharing allows it (``PreparedClaims.conflicts``; reserved meanwhile, so
  concurrent prepares cannot both take it); an MPS share (``--sharing=mps``)
  that would take its device past its memory, or past 100 % of its
  threads, beside the shares prepared there is refused naming the sums
  (the scheduler never allocates that; a driver does not trust that it
  did). With the node ledger
  (``ledger``, SPEC R-NL-2/4) its devices' units are then taken for the
  claim (``allocator.hold(units, uid)``: holders inside this driver share,
  as adminAccess and shareID results do; a unit another front door of
  the node holds refuses the claim naming unit, owner and holder). Then
  the claim is committed and only then answered; a commit that fails lets
  go of what it took.
- A commit writes a CDI spec per new claim (``render_claim_spec``), then
  the checkpoint of every claim prepared after it, then removes the specs
  of unprepared claims: one executor job. Commits are queued and run one
  at a time; a commit takes every change queued meanwhile (group commit:
  100 concurrent prepares cost a few jobs, not 100), and the checkpoint it
  writes is the table after all of them, so no claim answered prepared is
  missing from it. The table changes only once its commit landed; a
  failed write answers each claim of that commit with the error (specs
  just written removed: nothing prepared, nothing lost).
- ``unprepare(uids)``: a commit without them; their devices stay held
  until it landed, and only then are their units let go in the node
  ledger (``let_go(uid)``). A uid never prepared (or already unprepared) succeeds:
  idempotent. A uid whose prepare is being committed is refused (try
  again): answering done would leave it prepared once that commit lands.
- ``create`` (restart): the checkpoint is read first; spec files of
  prepared claims are rewritten when missing or
  different, spec files of this driver's prefix no claim holds (a crash
  between the two writes) are removed. A prepared claim holding a device
  this node no longer publishes (a GPU gone, MIG reconfigured) stays
  prepared with its spec left as it is, logged, until it is unprepared.
  With the node ledger (R-NL-3) the checkpoint is the truth the driver
  reconciles from: every prepared claim holds its units again (claim uid
  as holder), then ``release_unclaimed`` returns what the last run leased
  and no claim holds; a unit the ledger refuses (another front door holds
  it: two grants) is logged at ERROR and the claim stays prepared, holding
  its other units (``hold_the_rest``: they never go back to be handed out
  while its pod may use them).
- A checkpoint that cannot be decoded (truncated, garbage, a version this
  release does not know: ``UnreadableFile``; SPEC R-SH-3) never stops the
  driver for good: the claims are rebuilt from the API server
  (``claims_of_node``: the ResourceClaims allocated to this node), the
  file is moved aside (``set_aside``) and an ERROR names it, where it went
  and how many claims were rebuilt (and each claim left out, and why).
  Rebuilt claims hold their units in the node ledger; one whose unit
  another front door holds is left out (logged at ERROR: answering it
  prepared would hand out a unit in use; the kubelet's next prepare of it
  is refused naming the holder), its other units held all the same until
  the kubelet unprepares it (an unprepare lets go of whatever a uid holds,
  prepared or not). Then the checkpoint of the rebuilt
  claims is written and their specs as above. The file stays where it is
  until the rebuild is known: an API server that cannot be listed (tried
  ``REBUILD_TRIES`` times: ``_rebuild``) stops the start with a ``CheckpointError``
  naming the file and the API server's answer, and the next start tries
  again (a missing checkpoint would read as "nothing prepared" and let go
  of units pods use).
- MPS shares (``--sharing=mps``, SPEC R-MP-1..3, R-MP-5; ``mps``: the
  front door's ``actors.mps.MpsDaemons``): once a claim's units are held,
  each of its shares is granted by the unit's daemon (started, or joined
  when it runs) with the share's limits (``ShareLimits``: memory exactly
  the consumed bytes, threads the consumed compute or 100 when it reserved
  none), share id ``<claim uid>/<device>``; a share the daemons refuse (the
  daemon cannot start: its exit and log; limits other than the unit's live
  shares have: MPS holds one set of limits per unit) refuses the claim
  naming why, and what it took is given back. The claim's spec gives each
  shared device the daemon's pipe directory at ``/tmp/nvidia-mps`` and the
  unit's ``/dev/shm``. Unprepare returns the claim's shares once its
  commit landed (the unit's last share stops its daemon), then its units.
  The prepared shares' limits (``live``) are what the slice's publisher
  follows: a unit's policies narrow to its live shares' limits, so the
  scheduler allocates only equal shares beside them.
  At start every prepared claim's shares are granted again (a daemon left
  running is taken over); one refused is logged at ERROR and the claim
  stays prepared. Then every daemon left running with no share (a claim
  whose prepare was never answered, or whose unprepare landed as the
  driver died) is stopped (``stop_left_daemons``: its unit held first in
  the node ledger), before the units no prepared claim holds go back.
- ``registered(ok, error)`` records what the kubelet's plugin watcher said.
- Metrics: counters ``dra/prepares`` (claims prepared, repeats included),
  ``dra/unprepares``, ``dra/prepare_failures`` (claims refused);
  ``dra/registrations``.
- ``POST /dra-plugin/mark_healthy`` is the device plugin's operator route
  (the shared ``OperatorRoutes``: credential, body, 401/403/404, the
  allocator's ``mark_healthy``); the slice loses the device's taint and
  NodeWatchResources shows it healthy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from actors import NvidiaGpuAllocator
from actors.allocator import AllocatorError
from actors.file_format import UnreadableFile
from runtime import Executor, Failure, MetricSet, spawn

from ...cdi import CdiWriteError, NodeFacts, apply_spec_changes, list_spec_files, read_spec_files
from ...credential import BearerCredential
from .._ledger_watch import hold_the_rest
from .._operator import OperatorRoutes
from ._claim_spec import claim_spec_file, claim_spec_prefix, render_claim_spec
from ._claims import ClaimPlan, ClaimRef, ClaimRefused, check_uid, plan_claim
from ._devices import DraCatalog
from ._kube import api_failure
from ._prepared import (CheckpointError, PreparedClaim, PreparedClaims, PreparedDevice, prepared_claim,
                        read_checkpoint, write_checkpoint)
from ._rebuild import rebuild_claims, replace_unreadable
from ._sharing import LiveShares, ShareLimits, over_capacity

__all__ = ["DraPluginProcess", "ClaimAnswer", "DRA_PLUGIN_ID"]

logger = logging.getLogger(__name__)

DRA_PLUGIN_ID = "dra-plugin"


class ClaimAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The answer for one claim: its devices, or why not."""

    devices: list[PreparedDevice] = []
    error: str = ""


def _restore(spec_dir: str, prefix: str, wanted: dict[str, bytes], kept: set[str]) -> tuple[list[str], list[str]]:
    """At start: rewrite missing or changed claim specs, remove orphans, leave ``kept`` (blocking; one job)."""
    present = read_spec_files(spec_dir, prefix)
    writes = [(name, data) for name, data in wanted.items() if present.get(name) != data]
    removals = [name for name in list_spec_files(spec_dir, prefix) if name not in wanted and name not in kept]
    apply_spec_changes(spec_dir, writes, removals)
    return [name for name, _ in writes], removals


def _commit_files(spec_dir: str, writes: list[tuple[str, bytes]], checkpoint: str, data: bytes,
                  removals: list[str]) -> None:
    """One commit (blocking): the new claims' specs, then the checkpoint, then the gone claims' specs.
    A failed checkpoint write removes the specs just written; once the checkpoint landed nothing fails the
    commit (the gone claims' specs that could not be removed are orphans, removed at the next start)."""
    apply_spec_changes(spec_dir, writes, [])
    try:
        write_checkpoint(checkpoint, data)
    except CheckpointError:
        apply_spec_changes(spec_dir, [], [name for name, _ in writes])
        raise
    try:  # the checkpoint landed: the commit is done; a spec left behind is removed at the next start
        apply_spec_changes(spec_dir, [], removals)
    except CdiWriteError as error:
        logger.warning("Unprepared claims' CDI specs not all removed (%s); the next start removes them", error)


class DraPluginProcess(OperatorRoutes):
    """The DRA driver's decisions (see module rules)."""

    def __init__(self, catalog: DraCatalog, allocator: NvidiaGpuAllocator, facts: NodeFacts, client: Any, *,
                 driver: str, node: str, spec_dir: str, dev_dir: str, checkpoint: str,
                 prepared: list[PreparedClaim], credential: BearerCredential | None = None,
                 ledger: bool = False, mps: Any = None) -> None:
        super().__init__(DRA_PLUGIN_ID)
        self.ledger = ledger
        """The allocator joined the node ledger: claims take and let go of their units there."""
        self.catalog = catalog
        self.allocator = allocator
        self.facts = facts
        self.client = client
        self.driver = driver
        self.node = node
        self.spec_dir = spec_dir
        self.dev_dir = dev_dir
        self.checkpoint = checkpoint
        self.table = PreparedClaims(prepared)
        self.credential = credential
        self.prepares = self.unprepares = self.prepare_failures = self.registrations = 0
        self.executor = Executor(1, name="dra-plugin")
        """Blocking file work: claim specs, the checkpoint."""
        self._queue: list[tuple[list[PreparedClaim], list[PreparedClaim], asyncio.Future]] = []
        self._committing = False
        self.mps = mps
        """The front door's MPS daemons (``--sharing=mps``), None without sharing."""
        self.live = LiveShares()
        """The limits of the prepared shares by device, which the slice follows."""
        self._follow_table()

    @classmethod
    async def create(cls, catalog: DraCatalog, allocator: NvidiaGpuAllocator, facts: NodeFacts, client: Any, *,
                     driver: str, node: str, spec_dir: str, dev_dir: str, checkpoint: str,
                     credential: BearerCredential | None = None, ledger: bool = False,
                     mps: Any = None) -> "DraPluginProcess":
        """The process, spawned once the checkpoint is read, the claims' specs restored and (``ledger``) their
        units held again in the node ledger."""
        executor = Executor(1, name="dra-plugin-start")
        try:
            unreadable: UnreadableFile | None = None
            try:
                prepared = await executor.run(read_checkpoint, checkpoint)
            except UnreadableFile as error:
                unreadable = error
                prepared = await rebuild_claims(client, error, driver=driver, node=node, catalog=catalog)
            plugin = cls(catalog, allocator, facts, client, driver=driver, node=node, spec_dir=spec_dir,
                         dev_dir=dev_dir, checkpoint=checkpoint, prepared=prepared, credential=credential,
                         ledger=ledger, mps=mps)
            if ledger:
                refused = await plugin._hold_again(prepared, rebuilt=unreadable is not None)
                if unreadable is not None:  # a rebuilt claim whose unit another holds is not prepared
                    prepared = [claim for claim in prepared if claim.ref.uid not in refused]
                    plugin.table = PreparedClaims(prepared)
            if unreadable is not None:
                await executor.run(replace_unreadable, checkpoint, plugin.table.encode(), unreadable, len(prepared))
            wanted, kept = {}, set()
            for claim in prepared:
                name = claim_spec_file(driver, claim.ref.uid)
                gone = [d.device for d in claim.devices if d.device not in catalog.by_name]
                if gone:
                    kept.add(name)
                    logger.warning("Prepared %s holds %s, which this node no longer publishes: its spec is left as"
                                   " it is until the kubelet unprepares it", claim.ref, ", ".join(gone))
                else:
                    wanted[name] = plugin._spec(claim.ref.uid, claim.devices)
            written, removed = await executor.run(_restore, spec_dir, claim_spec_prefix(driver), wanted, kept)
        finally:
            executor.shutdown(wait=False)
        if prepared or written or removed:
            logger.info("Restored %d prepared claims from %s (specs rewritten: %s; orphans removed: %s)",
                        len(prepared), checkpoint if unreadable is None else "the API server",
                        ", ".join(written) or "none", ", ".join(removed) or "none")
        if mps is not None:  # first: a unit goes back to the node ledger once its daemon stopped
            await plugin._restore_shares(plugin.table.claims.values())
            from .._run import stop_left_daemons

            await stop_left_daemons(mps, allocator if ledger else None,
                                    {facts.uuid: facts.unit for facts in catalog.by_name.values()})
        if ledger:
            returned = await allocator.release_unclaimed()
            if returned:
                logger.info("Reconciled with the %s: units leased by the last run that no prepared claim holds"
                            " went back to the node ledger: %s", "checkpoint" if unreadable is None else
                            "ResourceClaims", ", ".join(returned))
        plugin._follow_table()  # the table as restored (a rebuild may leave claims out)
        spawn(plugin)
        return plugin

    async def _hold_again(self, prepared: list[PreparedClaim], rebuilt: bool) -> set[str]:
        """At start: every prepared claim holds its units again; the uids of those the ledger refused (a
        ``rebuilt`` claim was never answered prepared by this run's checkpoint: it is left out)."""
        holds = [(claim, self.allocator.hold(units, claim.ref.uid)) for claim in prepared
                 if (units := self._units(claim.devices))]
        refused = set()
        for claim, future in holds:
            try:
                await future
            except AllocatorError as error:
                refused.add(claim.ref.uid)
                await hold_the_rest(self.allocator, frozenset(self._units(claim.devices)), claim.ref.uid)
                if rebuilt:
                    logger.error("Not prepared again from the API server: %s: %s; the kubelet's prepare of it is"
                                 " refused while that holds", claim.ref, error)
                else:
                    logger.error("Prepared %s holds units the node ledger refuses to this driver: %s. Two front"
                                 " doors granted one GPU; find which one must give it back", claim.ref, error)
        return refused

    def _follow_table(self) -> None:
        """``live`` as the prepared claims' shares are now (the slice is published again on a change)."""
        self.live.update(d for claim in self.table.claims.values() for d in claim.devices)

    async def _restore_shares(self, prepared: list[PreparedClaim]) -> None:
        """At start: every prepared claim's MPS shares granted again (a running daemon is taken over)."""
        for claim in prepared:
            try:
                await self._grant(claim.ref.uid, claim.devices)
            except Exception as error:  # noqa: BLE001 - the daemons' refusal: the claim stays prepared, said loudly
                logger.error("Prepared %s: its MPS shares cannot be granted again: %s", claim.ref, error)

    @staticmethod
    def share_id(uid: str, device: str) -> str:
        return f"{uid}/{device}"

    async def _grant(self, uid: str, devices: list[Any]) -> None:
        """Grant the shares of ``devices`` through their units' daemons; all or none (what was granted goes
        back when one is refused)."""
        from actors.mps import ShareLimits as DaemonLimits

        granted = []
        try:
            for device in devices:
                if device.share is None or device.device not in self.catalog.by_name:
                    continue
                facts = self.catalog.by_name[device.device]
                limits = DaemonLimits(memory_bytes=device.share.memory_bytes,
                                      thread_percentage=device.share.thread_percent or 100)
                await self.mps.share(facts.uuid, self.share_id(uid, device.device), limits)
                granted.append(device.device)
        except BaseException:
            for name in granted:
                await self.mps.release(self.share_id(uid, name))
            raise

    async def _return_shares(self, uid: str, devices: list[Any]) -> bool:
        """The MPS shares of ``devices`` back to their daemons (a unit's last share stops its daemon); False
        (logged) when a daemon could not be stopped: the claim's units then stay held."""
        if self.mps is None:
            return True
        done = True
        for device in devices:
            if device.share is not None:
                try:
                    await self.mps.release(self.share_id(uid, device.device))
                except Exception as error:  # noqa: BLE001 - the unit stays held rather than handed out half-undone
                    logger.error("Claim uid %s: its MPS share of %s was not returned cleanly (%s); its units stay"
                                 " held in the node ledger", uid, device.device, error)
                    done = False
        return done

    async def _share(self, planned: list[ClaimPlan], answers: dict[str, ClaimAnswer]) -> list[ClaimPlan]:
        """Each plan's MPS shares granted; the plans that got them (the others refused, their units and
        reservation given back)."""
        shared = []
        for plan in planned:
            try:
                await self._grant(plan.ref.uid, plan.devices)
            except Exception as error:  # noqa: BLE001 - the daemons' refusal, named in the claim's answer
                from actors.mps import UnequalShare

                self.table.release(plan.ref.uid)
                await self._let_go([plan.ref.uid])
                later = ("; the kubelet tries again, and it is prepared once the unit's other shares are unprepared"
                         " (or delete its pod, for the scheduler to allocate the claim anew)"
                         if isinstance(error, UnequalShare) else "")
                answers[plan.ref.uid] = self._refused(ClaimRefused(
                    f"{plan.ref}: its MPS share cannot be granted: {error}; nothing was prepared{later}"))
                continue
            shared.append(plan)
        return shared

    def _units(self, devices: list[Any]) -> list[Any]:
        """The units of ``devices`` this node still publishes (one each)."""
        return list(dict.fromkeys(self.catalog.by_name[d.device].unit for d in devices
                                  if d.device in self.catalog.by_name))

    def publish(self, metrics: MetricSet) -> None:
        metrics.counter("dra/prepares", "claims prepared (repeats included)", read=lambda: self.prepares)
        metrics.counter("dra/unprepares", "claims unprepared", read=lambda: self.unprepares)
        metrics.counter("dra/prepare_failures", "claims the driver refused to prepare",
                        read=lambda: self.prepare_failures)
        metrics.counter("dra/registrations", "registrations the kubelet's plugin watcher accepted",
                        read=lambda: self.registrations)

    # -- the kubelet's calls ---------------------------------------------------------------
    def registered(self, ok: bool, error: str) -> None:
        if ok:
            self.registrations += 1
            logger.info("The kubelet registered driver %s", self.driver)
        else:
            logger.error("The kubelet refused to register driver %s: %s", self.driver, error)

    def _spec(self, uid: str, devices: list[Any]) -> bytes:
        units = [(d.device, self.catalog.by_name[d.device].unit) for d in devices]
        mps = None
        if self.mps is not None:
            paths = {d.device: self.mps.paths(self.catalog.by_name[d.device].uuid) for d in devices
                     if d.share is not None}
            mps = {name: (where.pipe, where.shm) for name, where in paths.items()}
        return render_claim_spec(self.driver, uid, units, self.catalog.uuids, self.facts, self.dev_dir, mps)

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, ClaimAnswer]:
        """An answer for every claim (see module rules)."""
        answers: dict[str, ClaimAnswer] = {}
        asked = []
        for ref in refs:
            prepared = self.table.claims.get(ref.uid)
            if prepared is not None:
                answers[ref.uid] = ClaimAnswer(devices=prepared.devices)
                continue
            try:
                check_uid(ref)
            except ClaimRefused as refused:
                answers[ref.uid] = self._refused(refused)
                continue
            asked.append(ref)
        fetched = await asyncio.gather(*(self._read(ref) for ref in asked), return_exceptions=True)
        unhealthy = (await self.allocator.health_since(None)).unhealthy if asked else {}
        planned: list[ClaimPlan] = []
        for ref, claim in zip(asked, fetched):
            prepared = self.table.claims.get(ref.uid)  # prepared by a concurrent call meanwhile
            if prepared is not None:
                answers[ref.uid] = ClaimAnswer(devices=prepared.devices)
                continue
            try:
                if isinstance(claim, BaseException):
                    raise ClaimRefused(f"{ref}: cannot be read: {api_failure(claim)}; nothing was prepared")
                plan = plan_claim(ref, claim, driver=self.driver, node=self.node, catalog=self.catalog)
                sick = [f"{d.device} ({unhealthy[self.catalog.by_name[d.device].unit]})" for d in plan.devices
                        if not d.admin_access and self.catalog.by_name[d.device].unit in unhealthy]
                if sick:
                    raise ClaimRefused(f"{ref}: device {', '.join(sick)} is unhealthy; nothing was prepared. Once"
                                       " fixed an operator marks it healthy (POST /dra-plugin/mark_healthy)")
                taken = self.table.conflicts(plan)
                if taken:
                    raise ClaimRefused(f"{ref}: device {', '.join(taken)} is not shared (no adminAccess or"
                                       " shareID), so it cannot be prepared twice; nothing was prepared")
                crowded = self._over_capacity(plan)
                if crowded:
                    raise ClaimRefused(f"{ref}: {'; '.join(crowded)}; nothing was prepared")
            except ClaimRefused as refused:
                answers[ref.uid] = self._refused(refused)
                continue
            self.table.reserve(plan)
            planned.append(plan)
        if planned and self.ledger:
            planned = await self._take(planned, answers)
        if planned and self.mps is not None:
            planned = await self._share(planned, answers)
        if planned:
            answers.update(await self._write(planned))
        return {ref.uid: answers[ref.uid] for ref in refs}

    def _over_capacity(self, plan: ClaimPlan) -> list[str]:
        """Why each share of ``plan`` does not fit beside the shares prepared (or being prepared) on its device."""
        held: dict[str, list[ShareLimits]] = {}
        for uid, devices in [(u, c.devices) for u, c in self.table.claims.items()] + [
                (u, p.devices) for u, p in self.table.reserved.items()]:
            if uid != plan.ref.uid:
                for device in devices:
                    if device.share is not None:
                        held.setdefault(device.device, []).append(device.share)
        found = []
        for device in plan.devices:
            if device.share is not None:
                why = over_capacity(device.device, self.catalog.by_name[device.device].memory_mib, device.share,
                                    held.get(device.device, []))
                if why is not None:
                    found.append(why)
                held.setdefault(device.device, []).append(device.share)
        return found

    async def _take(self, planned: list[ClaimPlan], answers: dict[str, ClaimAnswer]) -> list[ClaimPlan]:
        """Each plan's units taken in the node ledger for its claim; the plans that got them (the others
        refused, their reservation released)."""
        holds = [(plan, self.allocator.hold(self._units(plan.devices), plan.ref.uid)) for plan in planned]
        taken = []
        for plan, future in holds:
            try:
                await future
            except Exception as error:  # noqa: BLE001 - another front door holds a unit, or the ledger failed
                self.table.release(plan.ref.uid)
                answers[plan.ref.uid] = self._refused(ClaimRefused(f"{plan.ref}: {error}; nothing was prepared"))
                continue
            taken.append(plan)
        return taken

    def _refused(self, refused: ClaimRefused) -> ClaimAnswer:
        self.prepare_failures += 1
        logger.warning("NodePrepareResources refused: %s", refused)
        return ClaimAnswer(error=str(refused))

    async def _read(self, ref: ClaimRef) -> Any:
        from lightkube.resources.resource_v1 import ResourceClaim

        return await self.client.get(ResourceClaim, ref.name, namespace=ref.namespace)

    async def _write(self, plans: list[ClaimPlan]) -> dict[str, ClaimAnswer]:
        claims = [prepared_claim(self.driver, plan) for plan in plans]
        try:
            await self._commit(claims, [])
        except Exception as error:  # noqa: BLE001 - the files' errors, or a commit interrupted: nothing prepared
            for plan in plans:
                await self._return_shares(plan.ref.uid, plan.devices)
            await self._let_go([plan.ref.uid for plan in plans])  # so nothing stays held in the node ledger
            return {plan.ref.uid: self._refused(ClaimRefused(f"{plan.ref}: {error}; nothing was prepared"))
                    for plan in plans}
        answers = {}
        for claim in claims:
            self.prepares += 1
            logger.info("Prepared %s: %s", claim.ref, ", ".join(i for d in claim.devices for i in d.cdi_device_ids))
            answers[claim.ref.uid] = ClaimAnswer(devices=claim.devices)
        return answers

    async def _commit(self, adds: list[PreparedClaim], removes: list[PreparedClaim]) -> None:
        """Make the files and the table hold ``adds`` and not ``removes`` (see module rules): queued, and
        written by whichever call finds no commit running, with every change queued meanwhile (one job)."""
        done = asyncio.get_running_loop().create_future()
        self._queue.append((adds, removes, done))
        if not self._committing:
            self._committing = True
            try:
                while self._queue:
                    batch, self._queue = self._queue, []
                    added = [claim for adds, _, _ in batch for claim in adds]
                    removed = [claim for _, removes, _ in batch for claim in removes]
                    try:
                        after = dict(self.table.claims)
                        for claim in removed:
                            after.pop(claim.ref.uid, None)
                        after.update((claim.ref.uid, claim) for claim in added)
                        writes = [(claim_spec_file(self.driver, c.ref.uid), self._spec(c.ref.uid, c.devices))
                                  for c in added]
                        removals = [claim_spec_file(self.driver, c.ref.uid) for c in removed]
                        await self.executor.run(_commit_files, self.spec_dir, writes, self.checkpoint,
                                                PreparedClaims(list(after.values())).encode(), removals)
                    except (CdiWriteError, CheckpointError) as error:
                        self._fail_commit(added, batch, error)
                        continue
                    except BaseException as error:  # anything else (a bug, cancellation): every waiter answered
                        batch += self._queue
                        self._queue = []
                        self._fail_commit([claim for adds, _, _ in batch for claim in adds], batch, Failure(
                            f"the commit of {len(batch)} claim change(s) was interrupted ({type(error).__name__}:"
                            f" {error}); nothing was prepared, try again"))
                        done.exception()  # this call raises its own error below: its answer is read
                        raise
                    for claim in removed:
                        self.table.remove(claim.ref.uid)
                    for claim in added:
                        self.table.add(claim)
                    self._follow_table()
                    for _, _, future in batch:
                        future.set_result(None)
            finally:
                self._committing = False
        await done

    def _fail_commit(self, added: list[PreparedClaim], batch: list[Any], error: Exception) -> None:
        """A commit that did not land: its claims' reservations go, each waiter gets ``error``."""
        for claim in added:
            self.table.release(claim.ref.uid)
        for _, _, future in batch:
            if not future.done():
                future.set_exception(error)

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        """uid -> error ("" when done) for every claim (see module rules)."""
        answers: dict[str, str] = {}
        gone: list[PreparedClaim] = []
        unknown: list[str] = []
        for ref in refs:
            try:
                check_uid(ref)
            except ClaimRefused as refused:
                answers[ref.uid] = str(refused).replace("nothing was prepared", "nothing was unprepared")
                continue
            if ref.uid in self.table.reserved:  # its prepare is being committed: it would outlive this answer
                answers[ref.uid] = (f"{ref}: it is being prepared right now; nothing was unprepared, try again once"
                                    " that prepare answered")
                continue
            claim = self.table.claims.get(ref.uid)
            if claim is not None:
                gone.append(claim)
            else:
                unknown.append(ref.uid)  # it may hold units all the same (a claim left out of a rebuild)
            answers[ref.uid] = ""
        if gone:
            try:
                await self._commit([], gone)
            except (CdiWriteError, CheckpointError) as error:
                for claim in gone:
                    answers[claim.ref.uid] = f"{claim.ref}: {error}; it stays prepared"
                return answers
            returned = []
            for claim in gone:
                self.unprepares += 1
                logger.info("Unprepared %s", claim.ref)
                if await self._return_shares(claim.ref.uid, claim.devices):
                    returned.append(claim.ref.uid)
            await self._let_go(returned)
        await self._let_go(unknown)
        return answers

    async def _let_go(self, uids: list[str]) -> None:
        """The claims ``uids`` hold their units no more (the node ledger gets back what no claim holds)."""
        if not self.ledger:
            return
        for future in [self.allocator.let_go(uid) for uid in uids]:
            await future
