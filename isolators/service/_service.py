"""GpuIsolatorService: the isolator as a process users and agents can reach, who may do what.

Rules (SPEC R-SV-1, R-SC-1..8):
- One process, id ``gpu-isolator``, in front of an isolator handle. It
  holds what the kernel cannot tell (``ContainerRecord``s, checkpointed
  by ``_checkpoint``); the isolator holds the GPUs.
- Callers: users on the unix socket (``_front_door``; the kernel names
  them, ``_caller``), whose requests arrive as ``request(connection,
  frame)`` and are answered on the connection; agents on TCP, whose
  libprocess messages reach it only with the bearer credential (``admit``
  refuses the rest with 401 before anything is delivered, R-SC-6) and are
  answered to their PID. Every refusal is one line: the isolator's own
  text (Mesos' wording, e.g. "Requested 2 gpus but only 1 available") or
  the service's.
- Who may do what is decided by ``_caller.authorize`` on every verb
  naming a container, and by ``may_prepare`` for new ones: a user
  touches only containers their uid asked for ("Container 'ID' belongs
  to another user", nothing changed); containers without a command are
  root's. Limits per uid (root and agents are not limited), each refused
  with a clear line and counted: ``max_waiting_per_user`` requests in
  line, ``max_gpus_per_user`` units held (whole GPUs and MIG devices;
  checked when a request arrives and again when it is granted).
- A request asks for ``gpus`` and, under ``--nvidia_mig_strategy=mixed``,
  MIG devices by profile (``_demand``); one the node can never meet is
  refused at once, waiting or not (``NodeUnits.refusal``).
- Prepares are admitted one at a time, in arrival order (one pump), so a
  queue decision never races an allocation. First come, first served: a
  waiting request is served once enough GPUs are free for it, and nobody
  behind it is served before it; while anybody waits, a request that does
  not wait is refused. The line is tried again after every release and on
  every tick.
- Exec containers (a ``prepare`` with a ``command``) live as
  ``_exec_containers`` says: handed to the command's supervisor, released
  once their cgroup is empty; ``update`` of one is refused while it runs.
- A connection that closes takes its waiting requests with it; a TCP
  agent that goes away (R-NW-3) likewise. A ``signal`` the exec client
  forwards before its connection is handed on withdraws its request
  (``_exec_containers``). Other containers are cleaned up only by
  ``cleanup`` (Mesos' semantics).
- Reading: ``state(caller)`` is the state as ``caller`` may read it
  (``_state``).
- ``create`` recovers before the process serves (``_recovery``: its
  records and the kernel), then denies every GPU to the ``--confine``
  cgroups (``_confine``, R-SC-8; failing that, it does not start); the
  tick confines them again.
- ``GET /gpu-isolator/state`` (TCP, with the credential): the whole state.
- Metrics, published in ``initialize`` and given back in ``finalize``:
  gauges ``service/containers``, ``service/waiting``,
  ``service/releasing``; counters ``service/exec_started``,
  ``service/released_when_empty``, ``service/refused_by_owner``,
  ``service/refused_by_limit`` and ``service/unauthorized`` (401s).
- Termination (SIGTERM to ``serve``) touches no container: waiting
  requests are told the service stops; records, the kernel and the
  supervisors keep the rest for the next start.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec

from actors.flags import Flags
from actors.mig import resource_of_profile
from actors.resources import Resources
from runtime import PID, MetricSet, Process, Response, current_runtime, delay, dispatch, spawn

from .._errors import IsolatorError
from .._types import ContainerConfig, ContainerID
from ._caller import Caller, ServiceError, authorize, container_id, may_prepare
from ._demand import GPUS, demand_of, mig_counts, resources_text
from ._exec_containers import ExecContainers
from ._line import GRANT, QUEUE, PendingPrepare, WaitingLine, fits
from ._messages import (
    CleanedUp,
    Cleanup,
    Prepare,
    Prepared,
    Queued,
    SERVICE_ID,
    ServiceState,
    StateRequest,
    Statistics,
    Update,
    Updated,
    Usage,
    visible_devices_env,
)
from ._checkpoint import Checkpoint
from ._confine import Confinement
from ._records import ContainerRecord, RecordsFile
from ._recovery import recover
from ._state import state_for
from ._units import NodeUnits

__all__ = ["GpuIsolatorService", "UserLimits"]

logger = logging.getLogger(__name__)

REQUESTS: dict[str, type] = {"prepare": Prepare, "update": Update, "usage": Usage, "cleanup": Cleanup,
                             "state": StateRequest}


class UserLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one uid may hold and queue (root and agents are not limited)."""

    max_gpus_per_user: int | None = None
    max_waiting_per_user: int = 16


class _Agent:
    """A TCP peer that presented the credential: answered to its PID."""

    __slots__ = ("service", "pid", "caller")

    def __init__(self, service: "GpuIsolatorService", pid: PID) -> None:
        self.service = service
        self.pid = pid
        self.caller = Caller.agent(pid)

    def send(self, verb: str, body: Any) -> None:
        self.service.send(self.pid, verb, body)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Agent) and other.pid == self.pid

    def __hash__(self) -> int:
        return hash(self.pid)

    async def detach(self) -> None:  # pragma: no cover - an agent never asks for an exec container
        return None


class GpuIsolatorService(Process):
    """The isolator as a service (see module rules)."""

    def __init__(self, flags: Flags, components: Any, isolator: Any, records: dict[str, ContainerRecord],
                 records_io: RecordsFile, poll_interval: float = 1.0, *, limits: UserLimits | None = None,
                 credential: Any = None, confine: tuple[str, ...] = (), socket: str = "") -> None:
        super().__init__(SERVICE_ID)
        self.flags = flags
        self.components = components
        self.allocator = components.allocator
        self.isolator = isolator
        self.devices = isolator.devices
        self.backend: str = self.devices.backend_name
        self.records = records
        self.poll_interval = poll_interval
        self.limits = limits or UserLimits()
        self.credential = credential
        self.confine = tuple(confine)
        self.socket = socket
        self.confinement = Confinement(self.devices, self.confine)
        self.checkpoint = Checkpoint(records, records_io, self)
        self.execs = ExecContainers(isolator, records, self.checkpoint, cgroups_root=flags.cgroups_root,
                                    socket=socket, freed=self._kick)
        self._line = WaitingLine()
        self._pumping = False
        self._timer: Any = None
        self._stopping = False
        self.units = NodeUnits(self.allocator.pools(), components.inventory, flags.nvidia_mig_strategy)
        self.refused_by_owner = 0
        self.refused_by_limit = 0
        self.unauthorized = 0
        self._metrics: MetricSet | None = None

    @property
    def started(self) -> int:
        """Commands started in exec containers (``service/exec_started``)."""
        return self.execs.started

    @started.setter
    def started(self, count: int) -> None:
        self.execs.started = count

    @property
    def released_when_empty(self) -> int:
        """Exec containers released once empty (``service/released_when_empty``)."""
        return self.execs.released_when_empty

    @released_when_empty.setter
    def released_when_empty(self, count: int) -> None:
        self.execs.released_when_empty = count

    # -- construction and recovery -------------------------------------------------
    @classmethod
    async def create(cls, flags: Flags, components: Any, isolator: Any, poll_interval: float = 1.0,
                     **options: Any) -> "GpuIsolatorService":
        """Recover (``_recovery``), confine (``_confine``), then spawn the service process."""
        records, records_io = await recover(flags, isolator)
        service = cls(flags, components, isolator, records, records_io, poll_interval, **options)
        await service.confinement.deny(isolator.unit_rules)
        spawn(service)
        return service

    def initialize(self) -> None:
        self.install("prepare", GpuIsolatorService._on_prepare, Prepare)
        self.install("update", GpuIsolatorService._on_update, Update)
        self.install("usage", GpuIsolatorService._on_usage, Usage)
        self.install("cleanup", GpuIsolatorService._on_cleanup, Cleanup)
        self.route("/state", GpuIsolatorService._state_route,
                   help="containers with their GPUs and commands, free and unhealthy GPUs, the waiting line (JSON;"
                        " needs 'Authorization: Bearer <secret>')")
        self.admit(self._authenticate)
        metrics = self._metrics = MetricSet(current_runtime().metrics)
        metrics.gauge("service/containers", lambda: len(self.records), "containers the service holds")
        metrics.gauge("service/waiting", lambda: len(self._line.waiting()), "prepare requests waiting in line for GPUs")
        metrics.gauge("service/releasing", lambda: sum(r.releasing for r in self.records.values()),
                      "exec containers released once their last process exits")
        metrics.counter("service/exec_started", "commands started in exec containers", read=lambda: self.started)
        metrics.counter("service/released_when_empty", "exec containers released once empty",
                        read=lambda: self.released_when_empty)
        metrics.counter("service/refused_by_owner", "requests refused: the container belongs to another user",
                        read=lambda: self.refused_by_owner)
        metrics.counter("service/refused_by_limit", "requests refused by a per-user limit",
                        read=lambda: self.refused_by_limit)
        metrics.counter("service/unauthorized", "TCP requests refused without the bearer credential (401)",
                        read=lambda: self.unauthorized)
        self.checkpoint.save()  # what recovery kept (records of vanished cgroups are gone from the file too)
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
        self.execs.close()
        self.checkpoint.close()

    # -- who may ask (TCP) -----------------------------------------------------------
    def _authenticate(self, request: Any) -> Response | None:
        """Every TCP request for this process needs the credential (runs in the network)."""
        if self.credential is not None and self.credential.accepts(request.headers):
            return None
        self.unauthorized += 1
        from ..credential import BearerCredential

        return BearerCredential.unauthorized()

    # -- requests on the unix socket -----------------------------------------------------
    async def request(self, connection: Any, frame: Any) -> None:
        """One request from a user's connection (``_front_door``)."""
        kind = REQUESTS.get(frame.verb)
        try:
            if kind is None:
                raise msgspec.ValidationError(f"unknown request {frame.verb!r}")
            body = msgspec.convert(frame.body, type=kind)
        except msgspec.ValidationError as error:
            for fd in frame.fds:
                os.close(fd)
            connection.refuse(f"a {frame.verb!r} request that does not decode: {error}")
            return
        if frame.verb == "prepare":
            self._prepare(connection, body, frame.fds)
        elif frame.verb == "state":
            connection.send("state", await self.state(connection.caller))
        else:
            await {"update": self._update, "usage": self._usage, "cleanup": self._cleanup}[frame.verb](connection, body)

    def signal(self, connection: Any, frame: Any) -> None:
        """A signal the exec client forwarded before its command started: the
        request is withdrawn, nothing runs (see module rules)."""
        signo = frame.body.get("signo")
        if not isinstance(signo, int) or not 0 < signo < 65:
            connection.refuse(f"a 'signal' request without a signal number 1 to 64: {signo!r}")
            return
        for pending in self._line.drop_sender(connection):
            self.execs.withdraw(pending, signo)
        self.execs.signalled(connection, signo)

    def disconnected(self, connection: Any) -> None:
        """A user's connection closed: its waiting requests go (see module rules)."""
        self._drop(connection, f"its client ({connection.caller.describe()})")

    def _drop(self, sender: Any, who: str) -> None:
        """``sender`` went away: its requests not answered yet go, unanswered."""
        for pending in self._line.drop_sender(sender):
            pending.close_fds()
            logger.info("Container %s: %s went away while it waited; request dropped", pending.body.container_id, who)

    # -- messages from agents (TCP, credential checked by admit) --------------------------
    def _on_prepare(self, sender: PID | None, body: Prepare) -> None:
        if sender is not None:
            self.link(sender)
            self._prepare(_Agent(self, sender), body, ())

    async def _on_update(self, sender: PID | None, body: Update) -> None:
        if sender is not None:
            await self._update(_Agent(self, sender), body)

    async def _on_usage(self, sender: PID | None, body: Usage) -> None:
        if sender is not None:
            await self._usage(_Agent(self, sender), body)

    async def _on_cleanup(self, sender: PID | None, body: Cleanup) -> None:
        if sender is not None:
            await self._cleanup(_Agent(self, sender), body)

    def exited(self, pid: PID) -> None:
        self._drop(_Agent(self, pid), f"its agent {pid}")

    # -- prepare --------------------------------------------------------------------------
    def _prepare(self, channel: Any, body: Prepare, fds: tuple[int, ...]) -> None:
        caller: Caller = channel.caller
        pending = PendingPrepare(channel, body)
        pending.uid, pending.user = caller.uid, caller.user
        try:
            may_prepare(caller, body.command)
            pending.demand = self._check_new(body, fds)
            self._check_waiting(caller, body)
        except (ServiceError, ValueError) as error:
            pending.fds = fds
            self._answer(pending, str(error))
            return
        pending.fds = fds
        self._line.arrive(pending)
        self._kick()

    def _check_new(self, body: Prepare, fds: tuple[int, ...]) -> dict[str, int]:
        """What a new prepare asks for, per resource, once checked (see module rules)."""
        cid = container_id(body.container_id)
        self.execs.check(cid, body, fds)
        demand = demand_of(body.gpus, body.mig)
        refusal = self.units.refusal(demand)
        if refusal is not None:
            raise ServiceError(refusal)
        if str(cid) in self.records or self._line.holds(str(cid)):
            raise ServiceError("Container has already been prepared")
        return demand

    def _check_waiting(self, caller: Caller, body: Prepare) -> None:
        limit = self.limits.max_waiting_per_user
        if not body.wait or caller.privileged:
            return
        waiting = sum(1 for pending in self._line.pending() if pending.uid == caller.uid and pending.body.wait)
        if waiting >= limit:
            self.refused_by_limit += 1
            raise ServiceError(f"User '{caller.user}' has {waiting} requests waiting for GPUs already"
                               f" (--max_waiting_per_user={limit}): wait for them, or cancel one")

    async def _check_held(self, pending: PendingPrepare) -> str | None:
        """Why granting ``pending`` would take its user over ``--max_gpus_per_user`` (None: it would not)."""
        limit = self.limits.max_gpus_per_user
        if limit is None or pending.uid in (None, 0):
            return None
        held_by = await self.isolator.containers()
        held = sum(len(units) for name, units in held_by.items()
                   if (record := self.records.get(name)) is not None and record.owner == pending.uid)
        wanted = sum(pending.demand.values())
        if held + wanted <= limit:
            return None
        self.refused_by_limit += 1
        return (f"User '{pending.user}' holds {held} GPU(s); {wanted} more would exceed --max_gpus_per_user={limit}")

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
        over = await self._check_held(pending)
        if pending.cancelled:
            return
        if over is not None:
            self._answer(pending, over)
            return
        free = await self._free()
        if pending.cancelled:  # cancelled, or its client went away, meanwhile
            return
        decision = self._line.admission(pending.demand, body.wait, free)
        if decision == GRANT:
            await self._grant(pending)
        elif decision == QUEUE:
            position = self._line.enqueue(pending)
            logger.info("Container %s: waiting in line (position %d) for %d GPU(s)", body.container_id, position,
                        body.gpus)
            mig = mig_counts(pending.demand)
            pending.sender.send("queued", Queued(
                request=body.request, container_id=body.container_id, position=position, gpus=body.gpus,
                free=free.get(GPUS, 0), mig=mig, mig_free={p: free.get(resource_of_profile(p), 0) for p in mig}))
        else:
            self._answer(pending, decision)

    async def _grant(self, pending: PendingPrepare) -> None:
        body = pending.body
        name = body.container_id
        over = await self._check_held(pending)
        if over is not None:
            self._answer(pending, over)
            return
        record = ContainerRecord(container_id=name, command=body.command, client=pending.sender.caller.peer,
                                 uid=pending.uid, user=pending.user, since=time.time())
        self.records[name] = record
        try:
            with self.execs.granting(record, pending):
                await self._prepare_granted(record, pending)
        finally:
            pending.close_fds()

    async def _prepare_granted(self, record: ContainerRecord, pending: PendingPrepare) -> None:
        """Record the container, have the isolator prepare it, answer, and
        hand an exec container's command on."""
        body = pending.body
        name = record.container_id
        if not await self.checkpoint.save():
            del self.records[name]
            self._answer(pending, f"Container {name}: cannot record it in {self.checkpoint.file.path} (see the"
                                  " service's log); nothing was prepared")
            return
        try:
            await self.isolator.prepare(ContainerID(name),
                                        ContainerConfig(resources=Resources.parse(resources_text(pending.demand))))
        except Exception as error:
            if self.records.get(name) is record:
                del self.records[name]
                await self.checkpoint.save()
            logger.info("Container %s: prepare refused: %s", name, error)
            self._answer(pending, str(error))
            return
        if self.records.get(name) is not record:  # cleaned up while it was prepared
            self._answer(pending, f"Container {name} was cleaned up before it was prepared")
            return
        gpus = self.units.granted((await self.isolator.containers()).get(name, []))
        uuids = [gpu.uuid or "" for gpu in gpus]
        env = visible_devices_env(uuids)
        logger.info("Container %s: prepared with GPUs %s for %s%s", name, [g.mig_device or g.minor for g in gpus],
                    pending.sender.caller.describe(), f" to run {body.command}" if body.command else "")
        if pending.withdrawn is not None:
            await self.execs.withdrawn(record, pending)
            return
        pending.sender.send("prepared", Prepared(request=body.request, container_id=name, gpus=gpus, env=env))
        if record.is_exec:
            await self.execs.start(record, pending, env)

    def _answer(self, pending: PendingPrepare, error: str) -> None:
        pending.close_fds()
        body = pending.body
        pending.sender.send("prepared", Prepared(request=body.request, container_id=body.container_id, error=error))

    # -- the owner check ---------------------------------------------------------------
    def _owner(self, name: str) -> int | None:
        """Whose container ``name`` is (``ContainerRecord.owner``); None when the service holds none."""
        record = self.records.get(name)
        return record.owner if record is not None else None

    def _touchable(self, caller: Caller, verb: str, name: str) -> ContainerID:
        """The id of a container ``caller`` may ``verb``: its own, or any for
        root and agents (one the service holds no record of only for them)."""
        cid = container_id(name)
        if name in self.records:
            self._authorize(caller, verb, name, self._owner(name))
        elif not caller.privileged:
            raise ServiceError("Unknown container")
        return cid

    def _authorize(self, caller: Caller, verb: str, name: str, owner: int | None) -> None:
        try:
            authorize(caller, name, owner)
        except ServiceError:
            self.refused_by_owner += 1
            logger.warning("Container %s: %s refused to %s: it belongs to uid %s", name, verb, caller.describe(),
                           owner)
            raise

    # -- update and usage ----------------------------------------------------------------------
    async def _update(self, channel: Any, body: Update) -> None:
        name = body.container_id
        try:
            cid = self._touchable(channel.caller, "update", name)
            record = self.records.get(name)
            if record is not None and record.is_exec:
                raise ServiceError(f"Container {name} runs a command of 'gpu-isolator exec': its GPUs cannot change"
                                   " while it runs")
            await self.isolator.update(cid, Resources.parse(resources_text(demand_of(body.gpus, body.mig))))
            gpus = self.units.granted((await self.isolator.containers()).get(name, []))
        except (ServiceError, IsolatorError, ValueError) as error:
            channel.send("updated", Updated(request=body.request, container_id=name, error=str(error)))
            return
        logger.info("Container %s: updated to GPUs %s", name, [g.mig_device or g.minor for g in gpus])
        channel.send("updated", Updated(request=body.request, container_id=name, gpus=gpus))
        self._kick()  # a shrink frees GPUs for the line

    async def _usage(self, channel: Any, body: Usage) -> None:
        name = body.container_id
        try:
            cid = self._touchable(channel.caller, "usage", name)
            statistics = await self.isolator.usage(cid)
        except (ServiceError, IsolatorError, ValueError) as error:
            channel.send("statistics", Statistics(request=body.request, container_id=name, error=str(error)))
            return
        channel.send("statistics", Statistics(request=body.request, container_id=name, statistics=statistics))

    # -- cleanup and release -------------------------------------------------------------------
    async def _cleanup(self, channel: Any, body: Cleanup) -> None:
        name = body.container_id
        caller: Caller = channel.caller
        reply = CleanedUp(request=body.request, container_id=name)
        try:
            cid = container_id(name)
            waiting = [p for p in self._line.pending() if p.body.container_id == name]
            if waiting:
                for pending in waiting:
                    self._authorize(caller, "cancelling a waiting request", name, pending.uid)
                for pending in self._line.cancel(name):
                    self._answer(pending, f"Container {name}: cancelled by a cleanup while it waited for GPUs")
                logger.info("Container %s: waiting request cancelled by %s", name, caller.describe())
            elif name in self.records:
                self._authorize(caller, "cleanup", name, self._owner(name))
                record = self.records[name]
                if record.is_exec:
                    left = await self.execs.cleanup(record, caller)
                    if left is not None:
                        reply.released, reply.processes = False, left
                else:
                    await self.isolator.cleanup(cid)
                    if self.records.pop(name, None) is not None:
                        await self.checkpoint.save()
                    logger.info("Container %s: cleaned up by %s", name, caller.describe())
                    self._kick()
            elif caller.privileged:  # idempotent, as in Mesos; nothing of anyone's is touched otherwise
                await self.isolator.cleanup(cid)
        except (ServiceError, IsolatorError, ValueError) as error:
            reply = CleanedUp(request=body.request, container_id=name, error=str(error), released=False)
        channel.send("cleaned_up", reply)

    async def _tick(self) -> None:
        self._timer = None
        try:
            await self.execs.poll()
            if self._line.head() is not None:
                self._kick()  # health may have changed
            await self.confinement.again()
        finally:
            if not self._stopping:
                self._timer = delay(self.poll_interval, self.pid, GpuIsolatorService._tick)

    # -- the state ------------------------------------------------------------------
    async def _state_route(self, request: Any) -> Any:
        if request.method not in ("GET", "HEAD"):
            return Response.error(405, "/gpu-isolator/state answers GET")
        return Response.json(await self.state(Caller.agent("tcp")))

    async def state(self, caller: Caller | None = None) -> ServiceState:
        """The state as ``caller`` may read it (None: everything; ``_state``)."""
        held = await self.isolator.containers()
        available = await self.allocator.available()
        unhealthy = await self.allocator.unhealthy()
        return state_for(caller, held, available, unhealthy, self.records, self._line.waiting(), self.units,
                         backend=self.backend, address=str(self.pid), socket=self.socket)
