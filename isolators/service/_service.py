"""GpuIsolatorService: the isolator as a process other OS processes can reach.

Rules (SPEC R-SV-1..3):
- One process, id ``gpu-isolator`` (``gpu-isolator@HOST:PORT`` once the
  runtime listens), in front of an isolator handle. It holds what the
  kernel cannot tell (``ContainerRecord``: command, owner, client, the
  process moved in), checkpointed in its work dir before and after every
  change; the isolator holds the GPUs.
- Messages (``_messages``): ``prepare`` (``wait``: queue until enough GPUs
  are free), ``start`` (exec containers: move the sender's process in),
  ``update``, ``usage``, ``cleanup``; each answered to the sender's PID.
  Refusals carry one line: the isolator's own text (Mesos' wording, e.g.
  "Requested 2 gpus but only 1 available") or the service's.
- A request asks for ``gpus`` and, under ``--nvidia_mig_strategy=mixed``,
  MIG devices by profile (``_demand``); the isolator is asked for exactly
  that. One that the node can never meet is refused at once, waiting or
  not, with the text of ``NodeUnits.refusal`` (``_units``: Mesos' form,
  and on a MIG node what to ask for instead).
- Prepares are admitted one at a time, in arrival order (one pump), so a
  queue decision never races an allocation. First come, first served: a
  waiting request is served once enough GPUs are free for it, and nobody
  behind it is served before it; while anybody waits, a request that does
  not wait is refused (nothing is free for it). The line is tried again
  after every release and on every tick (health may change).
- Exec containers (a ``prepare`` with a ``command``) are refused on the
  in-memory backend (it enforces nothing) and for senders not on this
  host (no socket here listens at the sender's address). ``start`` needs
  the ``prepared`` reply's token, and moves only a process of the user
  owning the sender's socket (root: any) into the cgroup -- the v1 devices
  cgroup or the v2 unified one -- confirmed by the kernel. Their GPUs
  cannot be changed by ``update`` while they run.
- The service links to every sender of a ``prepare``. When a sender goes
  away (its connection breaks, R-NW-3) its waiting requests are dropped
  and its exec containers become ``releasing``; so does an exec container
  whose ``cleanup`` comes while processes remain in it. A releasing
  container is cleaned up once its cgroup holds no process: polled every
  ``poll_interval`` seconds through the executor, all of them in one job.
  Other containers are cleaned up only by ``cleanup`` (Mesos' semantics:
  an agent that dies does not take its containers with it).
- ``create`` recovers before the process serves: records are loaded, the
  isolator recovers the containers they name (and finds the others under
  the cgroups root: kept as ``recovered``, released only by ``cleanup``),
  records whose cgroup is gone are dropped, and each exec container's
  client is linked again (already gone: it is released once empty).
- ``GET /gpu-isolator/state``: ``ServiceState`` as JSON -- containers with
  their GPUs (minors and UUIDs) and MIG devices, command, user, client,
  process and state; free and unhealthy GPUs; every MIG device handed out
  (name, profile, UUID, holder or health) and the strategy; GPUs in MIG
  mode handed out whole (``none``); the waiting line.
- Metrics (``/metrics``), published in ``initialize`` through a
  ``runtime.MetricSet`` and given back in ``finalize``: gauges
  ``service/containers``, ``service/waiting``, ``service/releasing``;
  counters ``service/exec_started`` (processes moved in) and
  ``service/released_when_empty``.
- Termination (SIGTERM to ``serve``) touches no container: waiting
  requests are told the service stops; records and the kernel keep the
  rest for the next start.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from actors import Gpu
from actors.flags import Flags
from actors.mig import resource_of_profile
from actors.resources import Resources
from runtime import PID, Executor, Failure, MetricSet, Process, Response, current_runtime, delay, dispatch, spawn

from .._errors import IsolatorError
from .._types import ContainerConfig, ContainerID, ContainerState
from . import _host
from ._demand import GPUS, demand_of, mig_counts, resources_text
from ._messages import (
    CleanedUp,
    Cleanup,
    Prepare,
    Prepared,
    SERVICE_ID,
    Queued,
    ServiceState,
    Start,
    Started,
    Statistics,
    Update,
    Updated,
    Usage,
    visible_devices_env,
)
from ._line import GRANT, QUEUE, PendingPrepare, WaitingLine, fits
from ._records import ContainerRecord, RecordsFile, records_file, recovered_records
from ._units import NodeUnits

__all__ = ["GpuIsolatorService", "ServiceError"]

logger = logging.getLogger(__name__)


class ServiceError(Failure):
    """A request the service refuses; the message says why."""


class GpuIsolatorService(Process):
    """The isolator as a network-reachable process (see module rules)."""

    def __init__(self, flags: Flags, components: Any, isolator: Any, records: dict[str, ContainerRecord],
                 records_io: RecordsFile, poll_interval: float = 1.0) -> None:
        super().__init__(SERVICE_ID)
        self.flags = flags
        self.components = components
        self.allocator = components.allocator
        self.isolator = isolator
        self.devices = isolator.devices
        self.backend: str = self.devices.backend_name
        self.records = records
        self._records_io = records_io
        self.poll_interval = poll_interval
        self._host = Executor(2, name="gpu-isolator-service")
        self._writer = Executor(1, name="gpu-isolator-records")
        self._line = WaitingLine()
        self._tokens: dict[str, str] = {}
        self._pumping = False
        self._polling = False
        self._timer: Any = None
        self._stopping = False
        self.units = NodeUnits(self.allocator.pools(), components.inventory, flags.nvidia_mig_strategy)
        self.started = 0
        self.released_when_empty = 0
        self._metrics: MetricSet | None = None

    # -- construction and recovery -------------------------------------------------
    @classmethod
    async def create(cls, flags: Flags, components: Any, isolator: Any, poll_interval: float = 1.0) -> "GpuIsolatorService":
        """Recover (see module rules), then spawn the service process."""
        records_io = RecordsFile(records_file(flags.work_dir), isolator.devices.root)
        reader = Executor(1, name="gpu-isolator-records")
        try:
            loaded = await reader.run(records_io.load)
        finally:
            reader.shutdown(wait=False)
        states, named = [], {}
        for record in loaded:
            try:
                cid = ContainerID(record.container_id)
            except ValueError as error:
                logger.warning("Record of container %r dropped: %s", record.container_id, error)
                continue
            states.append(ContainerState(cid))
            named[record.container_id] = record
        await isolator.recover(states, set())
        known = await isolator.containers()
        records = recovered_records(named, known)
        service = cls(flags, components, isolator, records, records_io, poll_interval)
        spawn(service)
        return service

    def initialize(self) -> None:
        self.install("prepare", GpuIsolatorService._on_prepare, Prepare)
        self.install("start", GpuIsolatorService._on_start, Start)
        self.install("update", GpuIsolatorService._on_update, Update)
        self.install("usage", GpuIsolatorService._on_usage, Usage)
        self.install("cleanup", GpuIsolatorService._on_cleanup, Cleanup)
        self.route("/state", GpuIsolatorService._state_route,
                   help="containers with their GPUs and commands, free and unhealthy GPUs, the waiting line (JSON)")
        metrics = self._metrics = MetricSet(current_runtime().metrics)
        metrics.gauge("service/containers", lambda: len(self.records), "containers the service holds")
        metrics.gauge("service/waiting", lambda: len(self._line.waiting()), "prepare requests waiting in line for GPUs")
        metrics.gauge("service/releasing", lambda: sum(r.releasing for r in self.records.values()),
                      "exec containers released once their last process exits")
        metrics.counter("service/exec_started", "processes moved into exec containers", read=lambda: self.started)
        metrics.counter("service/released_when_empty", "exec containers released once empty",
                        read=lambda: self.released_when_empty)
        for record in self.records.values():
            if record.is_exec and record.client is not None and not record.releasing:
                self.link(PID.parse(record.client))  # gone already: exited() releases it once empty
            elif record.is_exec and record.client is None:
                record.releasing = True
        self._save()  # what recovery kept (records of vanished cgroups are gone from the file too)
        self._timer = delay(self.poll_interval, self.pid, GpuIsolatorService._tick)

    def finalize(self) -> None:
        self._stopping = True
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for pending in self._line.close():
            self._answer(pending, "the gpu-isolator service is stopping; ask again once it runs")
        self._host.shutdown(wait=False)
        self._writer.shutdown(wait=False)  # a write in its thread still finishes

    # -- records ------------------------------------------------------------------------
    def _save(self) -> Any:
        """Checkpoint every record: encoded now, written in order by one
        thread; a Future of whether the write succeeded (a failure is logged)."""
        data = self._records_io.encode(list(self.records.values()))
        return dispatch(self.pid, GpuIsolatorService._write, data)

    async def _write(self, data: bytes) -> bool:
        try:
            await self._writer.run(self._records_io.write, data)
        except OSError as error:
            logger.error("Cannot write the service's records %s: %s; a restart may forget which containers"
                         " run exec commands", self._records_io.path, error)
            return False
        return True

    # -- prepare --------------------------------------------------------------------------
    def _on_prepare(self, sender: PID | None, body: Prepare) -> None:
        if sender is None:
            logger.error("Container %s: prepare without a sender to answer; dropped", body.container_id)
            return
        pending = PendingPrepare(sender, body)
        try:
            pending.demand = self._check_new(body)
        except (ServiceError, ValueError) as error:
            self._answer(pending, str(error))
            return
        self.link(sender)
        self._line.arrive(pending)
        self._kick()

    def _check_new(self, body: Prepare) -> dict[str, int]:
        """What a new prepare asks for, per resource, once checked (see module rules)."""
        cid = _container_id(body.container_id)
        if body.command is not None:
            if self.backend == "memory":
                raise ServiceError(
                    "this gpu-isolator service runs the in-memory device backend, which enforces nothing: exec"
                    " needs cgroups (serve with --device_backend=cgroups_v1 or cgroups_v2, as root)")
            if not body.command or not all(isinstance(word, str) and word for word in body.command[:1]):
                raise ServiceError(f"Container {cid}: the command is empty")
        demand = demand_of(body.gpus, body.mig)
        refusal = self.units.refusal(demand)
        if refusal is not None:
            raise ServiceError(refusal)
        if str(cid) in self.records or self._line.holds(str(cid)):
            raise ServiceError("Container has already been prepared")
        return demand

    def _kick(self) -> None:
        if not self._pumping and not self._stopping:
            self._pumping = True
            dispatch(self.pid, GpuIsolatorService._pump)

    async def _pump(self) -> None:
        try:
            while not self._stopping:
                arriving = self._line.next_arrival()
                if arriving is not None:
                    await self._admit(arriving)
                    continue
                head = self._line.head()
                if head is not None and fits(head.demand, await self._free()) and head is self._line.head():
                    await self._grant(self._line.pop_head())
                    continue
                break
        finally:
            self._pumping = False

    async def _free(self) -> dict[str, int]:
        """Free units per resource."""
        return self.units.free(await self.allocator.available())

    async def _admit(self, pending: PendingPrepare) -> None:
        body = pending.body
        if body.command is not None:
            sender = pending.sender
            pending.uid, pending.user = await self._host.run(_sender_user, sender.host, sender.port)
            if pending.cancelled:
                return
            if pending.uid is None:
                self._answer(pending, f"exec runs commands on the service's host only: no socket of this host"
                                      f" listens at {sender.host}:{sender.port} (the client's address)")
                return
        free = await self._free()
        if pending.cancelled:  # cancelled, or its sender went away, meanwhile
            return
        decision = self._line.admission(pending.demand, body.wait, free)
        if decision == GRANT:
            await self._grant(pending)
        elif decision == QUEUE:
            position = self._line.enqueue(pending)
            logger.info("Container %s: waiting in line (position %d) for %d GPU(s)", body.container_id, position,
                        body.gpus)
            mig = mig_counts(pending.demand)
            self.send(pending.sender, "queued", Queued(
                request=body.request, container_id=body.container_id, position=position, gpus=body.gpus,
                free=free.get(GPUS, 0), mig=mig, mig_free={p: free.get(resource_of_profile(p), 0) for p in mig}))
        else:
            self._answer(pending, decision)

    async def _grant(self, pending: PendingPrepare) -> None:
        body = pending.body
        name = body.container_id
        record = ContainerRecord(container_id=name, command=body.command, client=str(pending.sender),
                                 uid=pending.uid, user=pending.user, since=time.time())
        self.records[name] = record
        if not await self._save():
            del self.records[name]
            self._answer(pending, f"Container {name}: cannot record it in {self._records_io.path} (see the"
                                  " service's log); nothing was prepared")
            return
        try:
            await self.isolator.prepare(ContainerID(name),
                                        ContainerConfig(resources=Resources.parse(resources_text(pending.demand))))
        except Exception as error:
            if self.records.get(name) is record:
                del self.records[name]
                await self._save()
            logger.info("Container %s: prepare refused: %s", name, error)
            self._answer(pending, str(error))
            return
        if self.records.get(name) is not record:  # cleaned up while it was prepared
            self._answer(pending, f"Container {name} was cleaned up before it was prepared")
            return
        gpus = self.units.granted((await self.isolator.containers()).get(name, []))
        token = None
        if record.is_exec:
            token = self._tokens[name] = secrets.token_hex(16)
        uuids = [gpu.uuid or "" for gpu in gpus]
        logger.info("Container %s: prepared with GPUs %s for %s%s", name, [g.mig_device or g.minor for g in gpus],
                    pending.sender, f" to run {body.command}" if body.command else "")
        self.send(pending.sender, "prepared", Prepared(request=body.request, container_id=name, gpus=gpus,
                                                       env=visible_devices_env(uuids), token=token))

    def _answer(self, pending: PendingPrepare, error: str) -> None:
        body = pending.body
        self.send(pending.sender, "prepared", Prepared(request=body.request, container_id=body.container_id,
                                                       error=error))

    # -- start ------------------------------------------------------------------------------
    async def _on_start(self, sender: PID | None, body: Start) -> None:
        if sender is None:
            return
        name = body.container_id
        try:
            record = self.records.get(name)
            if record is None or not record.is_exec:
                raise ServiceError(f"Container {name} is not an exec container of this service")
            if record.client != str(sender) or not secrets.compare_digest(self._tokens.get(name, ""), body.token):
                raise ServiceError(f"Container {name}: only the client that prepared it may start it (wrong token)")
            if record.pid is not None or record.releasing:
                raise ServiceError(f"Container {name} has already been started")
            del self._tokens[name]
            cgroup_dir = self.devices.path(name)
            suffix = f"/{self.flags.cgroups_root}/{name}"
            controller = "devices" if self.backend == "cgroups_v1" else ""
            await self._host.run(_host.move_into, body.pid, cgroup_dir, suffix, controller, record.uid)
        except (ServiceError, _host.HostError, ValueError) as error:
            logger.warning("Container %s: start refused: %s", name, error)
            self.send(sender, "started", Started(request=body.request, container_id=name, error=str(error)))
            return
        record.pid = body.pid
        self.started += 1
        await self._save()
        logger.info("Container %s: process %d moved into %s", name, body.pid, cgroup_dir)
        self.send(sender, "started", Started(request=body.request, container_id=name, pid=body.pid, cgroup=cgroup_dir,
                                             cgroup_suffix=suffix, controller=controller))

    # -- update and usage ----------------------------------------------------------------------
    async def _on_update(self, sender: PID | None, body: Update) -> None:
        if sender is None:
            return
        name = body.container_id
        try:
            cid = _container_id(name)
            record = self.records.get(name)
            if record is not None and record.is_exec:
                raise ServiceError(f"Container {name} runs a command of 'gpu-isolator exec': its GPUs cannot change"
                                   " while it runs")
            await self.isolator.update(cid, Resources.parse(resources_text(demand_of(body.gpus, body.mig))))
            gpus = self.units.granted((await self.isolator.containers()).get(name, []))
        except (ServiceError, IsolatorError, ValueError) as error:
            self.send(sender, "updated", Updated(request=body.request, container_id=name, error=str(error)))
            return
        logger.info("Container %s: updated to GPUs %s", name, [g.mig_device or g.minor for g in gpus])
        self.send(sender, "updated", Updated(request=body.request, container_id=name, gpus=gpus))
        self._kick()  # a shrink frees GPUs for the line

    async def _on_usage(self, sender: PID | None, body: Usage) -> None:
        if sender is None:
            return
        try:
            statistics = await self.isolator.usage(_container_id(body.container_id))
        except (IsolatorError, ValueError) as error:
            self.send(sender, "statistics", Statistics(request=body.request, container_id=body.container_id,
                                                       error=str(error)))
            return
        self.send(sender, "statistics", Statistics(request=body.request, container_id=body.container_id,
                                                   statistics=statistics))

    # -- cleanup and release -------------------------------------------------------------------
    async def _on_cleanup(self, sender: PID | None, body: Cleanup) -> None:
        if sender is None:
            return
        name = body.container_id
        reply = CleanedUp(request=body.request, container_id=name)
        try:
            cid = _container_id(name)
            cancelled = self._line.cancel(name)
            if cancelled:
                for pending in cancelled:
                    self._answer(pending, f"Container {name}: cancelled by a cleanup while it waited for GPUs")
                logger.info("Container %s: waiting request cancelled by %s", name, sender)
            else:
                record = self.records.get(name)
                if record is not None and record.is_exec:
                    if not record.releasing:
                        record.releasing = True
                        await self._save()
                    count = (await self._host.run(_host.process_counts, [self.devices.path(name)]))[0]
                    if count == 0:
                        await self._release(record, f"cleanup by {sender}")
                    else:
                        reply.released, reply.processes = False, count
                        logger.info("Container %s: %d process(es) still inside; its GPUs go when they exit",
                                    name, count)
                else:
                    await self.isolator.cleanup(cid)
                    if self.records.pop(name, None) is not None:
                        await self._save()
                    logger.info("Container %s: cleaned up by %s", name, sender)
                    self._kick()
        except (IsolatorError, ValueError) as error:
            reply = CleanedUp(request=body.request, container_id=name, error=str(error), released=False)
        self.send(sender, "cleaned_up", reply)

    async def _release(self, record: ContainerRecord, why: str) -> None:
        name = record.container_id
        await self.isolator.cleanup(ContainerID(name))
        if self.records.get(name) is record:
            del self.records[name]
            self._tokens.pop(name, None)
            await self._save()
            self.released_when_empty += 1
            logger.info("Container %s: released its GPUs (%s; no process left in it)", name, why)
        self._kick()

    def exited(self, pid: PID) -> None:
        client = str(pid)
        for pending in self._line.drop_sender(pid):
            logger.info("Container %s: its client %s went away while it waited; request dropped",
                        pending.body.container_id, client)
        changed = False
        for record in self.records.values():
            if record.is_exec and record.client == client and not record.releasing:
                record.releasing = changed = True
                logger.info("Container %s: its client %s went away; released once no process is left in it",
                            record.container_id, client)
        if changed:
            self._save()
            dispatch(self.pid, GpuIsolatorService._poll)

    async def _tick(self) -> None:
        self._timer = None
        try:
            await self._poll()
            if self._line.head() is not None:
                self._kick()  # health may have changed
        finally:
            if not self._stopping:
                self._timer = delay(self.poll_interval, self.pid, GpuIsolatorService._tick)

    async def _poll(self) -> None:
        """Release every releasing container whose cgroup holds no process (one executor job)."""
        if self._polling:
            return
        releasing = [record for record in self.records.values() if record.releasing]
        if not releasing:
            return
        self._polling = True
        try:
            counts = await self._host.run(_host.process_counts, [self.devices.path(r.container_id) for r in releasing])
            for record, count in zip(releasing, counts):
                if count == 0 and self.records.get(record.container_id) is record:
                    try:
                        await self._release(record, "its client is gone" if record.client else "recovered")
                    except Exception as error:  # the next tick tries again
                        logger.error("Container %s: release failed: %s", record.container_id, error)
        finally:
            self._polling = False

    # -- GET /gpu-isolator/state ------------------------------------------------------------------
    async def _state_route(self, request: Any) -> Any:
        if request.method not in ("GET", "HEAD"):
            return Response.error(405, "/gpu-isolator/state answers GET")
        return Response.json(await self.state())

    async def state(self) -> ServiceState:
        """What ``GET /gpu-isolator/state`` answers."""
        held = await self.isolator.containers()
        available = await self.allocator.available()
        unhealthy = await self.allocator.unhealthy()
        containers, holders = {}, {}
        for name in sorted(held):
            minors = [unit for unit in held[name] if isinstance(unit, int)]
            migs = [unit for unit in held[name] if not isinstance(unit, int)]
            holders.update(dict.fromkeys(migs, name))
            record = self.records.get(name) or ContainerRecord(container_id=name)
            containers[name] = record.view(minors, [self.units.uuid(m) for m in minors], migs,
                                           [self.units.uuid(m) for m in migs])
        return ServiceState(
            containers=containers,
            free=sorted(g.minor for g in available if isinstance(g, Gpu)),
            unhealthy={str(g.minor): reason for g, reason in sorted(unhealthy.items()) if isinstance(g, Gpu)},
            waiting=[pending.view() for pending in self._line.waiting()],
            total=sorted(g.minor for g in self.units.whole),
            backend=self.backend,
            address=str(self.pid),
            mig_strategy=self.units.strategy,
            mig_devices=self.units.mig_views(holders, unhealthy),
            mig_mode=self.units.mig_mode,
        )


def _container_id(text: str) -> ContainerID:
    """A top-level container id from a message (validated before any use)."""
    if not isinstance(text, str) or "." in text:
        raise ServiceError(f"Invalid container id {text!r}: the service manages top-level containers only")
    return ContainerID(text)


def _sender_user(host: str, port: int) -> tuple[int | None, str | None]:
    uid = _host.listener_uid(host, port)
    return uid, _host.user_name(uid)
