"""The admission of prepares: checked, admitted in arrival order, waiting in line, granted.

Rules (SPEC R-SV-2, R-SC-4):
- A prepare ``arrive``s and is checked before it waits: who may ask for a
  new container (``_caller.may_prepare``), its id (``container_id``), an
  exec request's command and stdio (``ExecContainers.check``), and the
  demand. A request asks for ``gpus`` and, under
  ``--nvidia_mig_strategy=mixed``, MIG devices by profile (``_demand``);
  one the node can never meet is refused at once, waiting or not
  (``NodeUnits.refusal``); so is a container already prepared or waiting.
- Limits per uid (root and agents are not limited), each refused with a
  clear line and counted (``refused_by_limit``): ``max_waiting_per_user``
  requests in line (checked when a request arrives),
  ``max_gpus_per_user`` units held (whole GPUs and MIG devices; checked
  when a request is admitted and again when it is granted).
- Prepares are admitted one at a time, in arrival order (one pump,
  ``kick``), so a queue decision never races an allocation. First come,
  first served (``_line``): a waiting request is served once enough GPUs
  are free for it, and nobody behind it is served before it; while
  anybody waits, a request that does not wait is refused. The service
  kicks the line after every release and on every tick.
- A grant records the container (checkpointed before the isolator
  prepares it; a record that cannot be written refuses the request, and
  nothing is prepared), has the isolator prepare it, and answers
  ``prepared`` with the GPUs and their environment; a refusal by the
  isolator is answered with its own text (Mesos' wording) and drops the
  record. An exec container's command is then handed on
  (``ExecContainers``).
- A request whose sender goes away (``drop``) or whose container is
  cleaned up while it waits (``cancel``) leaves the line; ``close()``
  (the service stops) answers every one still pending that the service
  stops, and admits nothing more.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from actors.mig import resource_of_profile
from actors.resources import Resources
from runtime import Process, defer

from .._types import ContainerConfig, ContainerID
from ._caller import Caller, ServiceError, container_id, may_prepare
from ._checkpoint import Checkpoint
from ._demand import GPUS, demand_of, mig_counts, resources_text
from ._exec_containers import ExecContainers
from ._line import GRANT, QUEUE, Channel, PendingPrepare, WaitingLine, fits
from ._messages import Prepare, Prepared, Queued, visible_devices_env
from ._records import ContainerRecord
from ._units import NodeUnits

__all__ = ["Admission", "UserLimits"]

logger = logging.getLogger(__name__)


class UserLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one uid may hold and queue (root and agents are not limited)."""

    max_gpus_per_user: int | None = None
    max_waiting_per_user: int = 16


class Admission:
    """The service's prepares from arrival to grant (see module rules)."""

    def __init__(self, isolator: Any, allocator: Any, units: NodeUnits, records: dict[str, ContainerRecord],
                 checkpoint: Checkpoint, execs: ExecContainers, limits: UserLimits, actor: Process) -> None:
        self.isolator = isolator
        self.allocator = allocator
        self.units = units
        self.records = records
        self.checkpoint = checkpoint
        self.execs = execs
        self.limits = limits
        self._actor = actor
        self.line = WaitingLine()
        self.refused_by_limit = 0
        self._pumping = False
        self._stopping = False

    # -- arriving -------------------------------------------------------------------------
    def arrive(self, channel: Channel, body: Prepare, fds: tuple[int, ...]) -> None:
        """A new prepare (``fds``: an exec request's stdio, the admission's to close)."""
        caller: Caller = channel.caller
        pending = PendingPrepare(channel, body)
        pending.uid, pending.user = caller.uid, caller.user
        try:
            may_prepare(caller, body.command)
            pending.demand = self._check_new(body, fds)
            self._check_waiting(caller, body)
        except (ServiceError, ValueError) as error:
            pending.fds = fds
            self.answer(pending, str(error))
            return
        pending.fds = fds
        self.line.arrive(pending)
        self.kick()

    def _check_new(self, body: Prepare, fds: tuple[int, ...]) -> dict[str, int]:
        """What a new prepare asks for, per resource, once checked (see module rules)."""
        cid = container_id(body.container_id)
        self.execs.check(cid, body, fds)
        demand = demand_of(body.gpus, body.mig)
        refusal = self.units.refusal(demand)
        if refusal is not None:
            raise ServiceError(refusal)
        if str(cid) in self.records or self.line.holds(str(cid)):
            raise ServiceError("Container has already been prepared")
        return demand

    def _check_waiting(self, caller: Caller, body: Prepare) -> None:
        limit = self.limits.max_waiting_per_user
        if not body.wait or caller.privileged:
            return
        waiting = sum(1 for pending in self.line.pending() if pending.uid == caller.uid and pending.body.wait)
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

    # -- the pump -------------------------------------------------------------------------
    def kick(self) -> None:
        """Admit what arrived and serve the line, in one pump (see module rules)."""
        if not self._pumping and not self._stopping:
            self._pumping = True
            defer(self._actor.pid, self._pump)()

    async def _pump(self) -> None:
        try:
            while not self._stopping:
                arriving = self.line.next_arrival()
                if arriving is not None:
                    await self._admit(arriving)
                    continue
                head = self.line.head()
                if head is not None and fits(head.demand, await self._free()) and head is self.line.head():
                    await self._grant(self.line.pop_head())
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
            self.answer(pending, over)
            return
        free = await self._free()
        if pending.cancelled:  # cancelled, or its client went away, meanwhile
            return
        decision = self.line.admission(pending.demand, body.wait, free)
        if decision == GRANT:
            await self._grant(pending)
        elif decision == QUEUE:
            position = self.line.enqueue(pending)
            logger.info("Container %s: waiting in line (position %d) for %d GPU(s)", body.container_id, position,
                        body.gpus)
            mig = mig_counts(pending.demand)
            pending.sender.send("queued", Queued(
                request=body.request, container_id=body.container_id, position=position, gpus=body.gpus,
                free=free.get(GPUS, 0), mig=mig, mig_free={p: free.get(resource_of_profile(p), 0) for p in mig}))
        else:
            self.answer(pending, decision)

    # -- the grant ------------------------------------------------------------------------
    async def _grant(self, pending: PendingPrepare) -> None:
        body = pending.body
        name = body.container_id
        over = await self._check_held(pending)
        if over is not None:
            self.answer(pending, over)
            return
        record = ContainerRecord(container_id=name, command=body.command, client=pending.sender.caller.peer,
                                 uid=pending.uid, user=pending.user, since=time.time())
        self.records[name] = record
        try:
            with self.execs.granting(record, pending):
                await self._prepare(record, pending)
        finally:
            pending.close_fds()

    async def _prepare(self, record: ContainerRecord, pending: PendingPrepare) -> None:
        """Record the container, have the isolator prepare it, answer, and
        hand an exec container's command on (see module rules)."""
        body = pending.body
        name = record.container_id
        if not await self.checkpoint.save():
            del self.records[name]
            self.answer(pending, f"Container {name}: cannot record it in {self.checkpoint.file.path} (see the"
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
            self.answer(pending, str(error))
            return
        if self.records.get(name) is not record:  # cleaned up while it was prepared
            self.answer(pending, f"Container {name} was cleaned up before it was prepared")
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

    # -- leaving unanswered ---------------------------------------------------------------
    def answer(self, pending: PendingPrepare, error: str) -> None:
        """Refuse ``pending`` with ``error`` (its descriptors closed)."""
        pending.close_fds()
        body = pending.body
        pending.sender.send("prepared", Prepared(request=body.request, container_id=body.container_id, error=error))

    def cancel(self, name: str, why: str) -> None:
        """Every request for container ``name`` not answered yet is answered ``why``."""
        for pending in self.line.cancel(name):
            self.answer(pending, why)

    def drop(self, sender: Any, who: str) -> None:
        """``sender`` went away: its requests not answered yet go, unanswered."""
        for pending in self.line.drop_sender(sender):
            pending.close_fds()
            logger.info("Container %s: %s went away while it waited; request dropped", pending.body.container_id, who)

    def close(self, why: str) -> None:
        """The service stops: every request still pending is answered ``why``; nothing more is admitted."""
        self._stopping = True
        for pending in self.line.close():
            self.answer(pending, why)
