"""GpuIsolatorService: the isolator as a process users and agents can reach, who may do what.

Rules (SPEC R-SV-1, R-SC-1..8):
- One process, id ``gpu-isolator``, in front of an isolator handle: the
  actor that answers the verbs. It owns the parts that do the work:
  ``Admission`` (prepares, the waiting line, per-user limits, the grant),
  ``ExecContainers`` (commands handed to their supervisor, released once
  empty), ``Checkpoint`` (the ``ContainerRecord``s -- what the kernel
  cannot tell -- written in order) and ``Confinement`` (``--confine``);
  it recovers with ``_recovery`` and is read through ``_state``. The
  isolator holds the GPUs.
- Callers: users on the unix socket (``_front_door``; the kernel names
  them, ``_caller``), whose requests arrive as ``request(connection,
  frame)`` and are answered on the connection; agents on TCP, whose
  libprocess messages reach it only with the bearer credential (``admit``
  refuses the rest with 401 before anything is delivered, R-SC-6) and are
  answered to their PID. Every refusal is one line: the isolator's own
  text (Mesos' wording, e.g. "Requested 2 gpus but only 1 available") or
  the service's.
- Who may do what is decided by ``_caller.authorize`` on every verb
  naming a container (counted: ``refused_by_owner``), and by
  ``may_prepare`` for new ones (``_admission``): a user touches only
  containers their uid asked for ("Container 'ID' belongs to another
  user", nothing changed); containers without a command are root's
  (``ContainerRecord.owner``). ``update`` and ``usage`` of a container
  the service holds no record of are refused to users ("Unknown
  container"); root and agents reach the isolator with it.
- ``update`` of an exec container is refused while it runs; an update
  tries the line again (a shrink frees GPUs), as every release does.
  ``cleanup`` cancels a container's waiting request, releases an exec
  container once empty (``ExecContainers.cleanup``), or has the isolator
  clean up any other one (idempotent for root and agents, as in Mesos).
- A connection that closes takes its waiting requests with it; a TCP
  agent that goes away (R-NW-3) likewise (``Admission.drop``). A
  ``signal`` the exec client forwards before its connection is handed on
  withdraws its request (``_exec_containers``). Other containers are
  cleaned up only by ``cleanup`` (Mesos' semantics).
- Reading: ``state(caller)`` is the state as ``caller`` may read it
  (``_state``); ``GET /gpu-isolator/state`` (TCP, with the credential):
  the whole state.
- ``create`` recovers before the process serves (``_recovery``: its
  records and the kernel), then denies every GPU to the ``--confine``
  cgroups (``_confine``, R-SC-8; failing that, it does not start). Once
  it runs it writes what recovery kept. Every tick (``poll_interval``)
  releases the exec containers found empty, tries the line again (health
  may have changed) and confines the ``--confine`` cgroups again.
- Metrics, published in ``initialize`` and given back in ``finalize``:
  gauges ``service/containers``, ``service/waiting``,
  ``service/releasing``; counters ``service/exec_started``,
  ``service/released_when_empty``, ``service/refused_by_owner``,
  ``service/refused_by_limit`` and ``service/unauthorized`` (401s).
- Termination (SIGTERM to ``serve``) touches no container: waiting
  requests are told the service stops (``Admission.close``); records,
  the kernel and the supervisors keep the rest for the next start.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from actors.flags import Flags
from actors.resources import Resources
from runtime import PID, MetricSet, Process, Response, current_runtime, delay, spawn

from .._errors import IsolatorError
from .._types import ContainerID
from ._admission import Admission, UserLimits
from ._caller import Caller, ServiceError, authorize, container_id
from ._checkpoint import Checkpoint
from ._confine import Confinement
from ._demand import demand_of, resources_text
from ._exec_containers import ExecContainers
from ._messages import (
    CleanedUp,
    Cleanup,
    Prepare,
    SERVICE_ID,
    ServiceState,
    StateRequest,
    Statistics,
    Update,
    Updated,
    Usage,
)
from ._records import ContainerRecord, RecordsFile
from ._recovery import recover
from ._state import state_for
from ._units import NodeUnits

__all__ = ["GpuIsolatorService", "UserLimits"]

logger = logging.getLogger(__name__)

REQUESTS: dict[str, type] = {"prepare": Prepare, "update": Update, "usage": Usage, "cleanup": Cleanup,
                             "state": StateRequest}


def _counted(part: str, name: str, doc: str) -> property:
    """A counter a part keeps, read and set as the service's own attribute."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, count: setattr(getattr(self, part), name, count), doc=doc)


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
        self.units = NodeUnits(self.allocator.pools(), components.inventory, flags.nvidia_mig_strategy)
        self.confinement = Confinement(self.devices, self.confine)
        self.checkpoint = Checkpoint(records, records_io, self)
        self.execs = ExecContainers(isolator, records, self.checkpoint, cgroups_root=flags.cgroups_root,
                                    socket=socket, freed=self._kick)
        self.admission = Admission(isolator, self.allocator, self.units, records, self.checkpoint, self.execs,
                                   self.limits, self)
        self._timer: Any = None
        self._stopping = False
        self.refused_by_owner = 0
        self.unauthorized = 0
        self._metrics: MetricSet | None = None

    started = _counted("execs", "started", "Commands started in exec containers (``service/exec_started``).")
    released_when_empty = _counted("execs", "released_when_empty",
                                   "Exec containers released once empty (``service/released_when_empty``).")
    refused_by_limit = _counted("admission", "refused_by_limit",
                                "Requests refused by a per-user limit (``service/refused_by_limit``).")

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
        metrics.gauge("service/waiting", lambda: len(self.admission.line.waiting()),
                      "prepare requests waiting in line for GPUs")
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

    async def finalize(self) -> None:
        self._stopping = True
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.admission.close("the gpu-isolator service is stopping; ask again once it runs")
        self.execs.close()
        await self.checkpoint.close()  # what was saved and not yet written lands

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
            self.admission.arrive(connection, body, frame.fds)
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
        for pending in self.admission.line.drop_sender(connection):
            self.execs.withdraw(pending, signo)
        self.execs.signalled(connection, signo)

    def disconnected(self, connection: Any) -> None:
        """A user's connection closed: its waiting requests go (see module rules)."""
        self.admission.drop(connection, f"its client ({connection.caller.describe()})")

    # -- messages from agents (TCP, credential checked by admit) --------------------------
    def _on_prepare(self, sender: PID | None, body: Prepare) -> None:
        if sender is not None:
            self.link(sender)
            self.admission.arrive(_Agent(self, sender), body, ())

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
        self.admission.drop(_Agent(self, pid), f"its agent {pid}")

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

    # -- cleanup -------------------------------------------------------------------
    async def _cleanup(self, channel: Any, body: Cleanup) -> None:
        name = body.container_id
        caller: Caller = channel.caller
        reply = CleanedUp(request=body.request, container_id=name)
        try:
            cid = container_id(name)
            waiting = [p for p in self.admission.line.pending() if p.body.container_id == name]
            if waiting:
                for pending in waiting:
                    self._authorize(caller, "cancelling a waiting request", name, pending.uid)
                self.admission.cancel(name, f"Container {name}: cancelled by a cleanup while it waited for GPUs")
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

    def _kick(self) -> None:
        """Try the line again: GPUs were freed (``Admission.kick``)."""
        self.admission.kick()

    async def _tick(self) -> None:
        self._timer = None
        try:
            await self.execs.poll()
            if self.admission.line.head() is not None:
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
        return state_for(caller, held, available, unhealthy, self.records, self.admission.line.waiting(), self.units,
                         backend=self.backend, address=str(self.pid), socket=self.socket)
