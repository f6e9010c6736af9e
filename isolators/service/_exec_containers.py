"""Exec containers' life: granted, handed to the command's supervisor, released once empty.

Rules (SPEC R-SC-2):
- An exec container is one prepared with a ``command`` (unix socket
  only, ``may_prepare``). ``check`` refuses one that cannot run before it
  waits: on the in-memory backend, which enforces nothing; an empty
  command; a directory that is not absolute; an environment variable
  with ``=`` or NUL in its name or NUL in its value; anything but the
  caller's stdin, stdout and stderr (3 descriptors) with it. Descriptors
  come only with a command.
- Once its GPUs are granted the caller gets ``prepared``; then
  (``start``) the connection and the caller's stdio go to the command's
  supervisor (``_launcher``, ``_supervisor``), which starts the command
  inside the cgroup as the caller and talks to the client from then on.
  A client gone before the hand-over releases the container; a command
  that does not start leaves it ``releasing``.
- While it is granted (``granting``) it is never released as empty: its
  supervisor is not in it yet.
- A ``signal`` the exec client forwards before its connection is handed
  on withdraws its request (``withdraw``, ``signalled``): the client gets
  ``exited`` (``withdrawn``, 128 + N) and nothing runs; one forwarded
  later reaches the command (through its supervisor).
- The container lives while processes remain in its cgroup: it is
  released once the cgroup is empty (``release``; each counted) -- seen
  when its supervisor (a child of the service) exits, and on every tick
  (``poll``: one executor job for every cgroup; also after a restart,
  when the service is no longer its parent). A command that ended leaving
  processes behind makes it ``releasing``: they keep its GPUs until they
  exit.
- ``cleanup`` of an exec container (its owner's, checked by the service)
  marks it ``releasing``: released now when nothing runs in it, else once
  empty (the processes left are counted, its supervisor not).
- Every release tells the service (``freed``): the line is tried again.
- Every log line names the container id.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from runtime import Executor

from .._types import ContainerID
from . import _host
from ._caller import Caller, ServiceError
from ._checkpoint import Checkpoint
from ._frames import encode
from ._launcher import LaunchSpec, launch
from ._line import Channel, PendingPrepare
from ._messages import Exited, Prepare
from ._records import ContainerRecord

__all__ = ["ExecContainers", "withdrawn_exit"]

logger = logging.getLogger(__name__)


def withdrawn_exit(container_id: str, signo: int) -> Exited:
    """What the exec client is told of a request its signal ``signo`` withdrew: nothing ran."""
    return Exited(container_id=container_id, status=128 + signo, signal=signo, withdrawn=True)


class ExecContainers:
    """The service's exec containers from grant to release (see module rules)."""

    def __init__(self, isolator: Any, records: dict[str, ContainerRecord], checkpoint: Checkpoint, *,
                 cgroups_root: str, socket: str, freed: Callable[[], None]) -> None:
        self.isolator = isolator
        self.devices = isolator.devices
        self.backend: str = self.devices.backend_name
        self.records = records
        self.checkpoint = checkpoint
        self.cgroups_root = cgroups_root
        self.socket = socket
        self._freed = freed
        self._host = Executor(2, name="gpu-isolator-service")
        self._launching: set[str] = set()
        """Exec containers being granted: not released as "empty" before their supervisor is in."""
        self._granting: dict[Any, PendingPrepare] = {}
        """Exec requests being granted, by connection (a signal then withdraws them)."""
        self._supervisors: dict[str, Any] = {}
        self._polling = False
        self.started = 0
        self.released_when_empty = 0

    def close(self) -> None:
        self._host.shutdown(wait=False)

    # -- before it is granted ------------------------------------------------------------
    def check(self, cid: ContainerID, body: Prepare, fds: tuple[int, ...]) -> None:
        """Refuse an exec request that cannot run (see module rules)."""
        if body.command is None:
            if fds:
                raise ServiceError("descriptors come only with a command")
            return
        if self.backend == "memory":
            raise ServiceError(
                "this gpu-isolator service runs the in-memory device backend, which enforces nothing: exec"
                " needs cgroups (serve with --device_backend=cgroups_v1 or cgroups_v2, as root)")
        if not body.command or not all(isinstance(word, str) and "\0" not in word for word in body.command) \
                or not body.command[0]:
            raise ServiceError(f"Container {cid}: the command is empty")
        if body.cwd is None or not body.cwd.startswith("/") or "\0" in body.cwd:
            raise ServiceError(f"Container {cid}: the command needs the absolute directory it starts in (cwd)")
        if any("\0" in key or "=" in key or not key or "\0" in value for key, value in (body.env or {}).items()):
            raise ServiceError(f"Container {cid}: an environment variable with '=' or NUL in its name or NUL in"
                               " its value")
        if len(fds) != 3:
            raise ServiceError(f"Container {cid}: the command's stdin, stdout and stderr come with the request"
                               f" (3 descriptors; got {len(fds)})")

    @contextmanager
    def granting(self, record: ContainerRecord, pending: PendingPrepare) -> Iterator[None]:
        """While ``record`` is being granted (see module rules; nothing for other containers)."""
        if not record.is_exec:
            yield
            return
        name = record.container_id
        self._launching.add(name)
        self._granting[pending.sender] = pending
        try:
            yield
        finally:
            self._launching.discard(name)
            if self._granting.get(pending.sender) is pending:
                del self._granting[pending.sender]

    # -- withdrawn by a signal -------------------------------------------------------------
    def withdraw(self, pending: PendingPrepare, signo: int) -> None:
        """Tell the client its request is withdrawn; nothing runs (see module rules)."""
        pending.close_fds()
        logger.info("Container %s: withdrawn by signal %d before its command started", pending.body.container_id,
                    signo)
        pending.sender.send("exited", withdrawn_exit(pending.body.container_id, signo))

    def signalled(self, connection: Channel, signo: int) -> None:
        """A signal on ``connection``: the exec request it has being granted is withdrawn (``grant`` sees it
        before the command starts)."""
        granting = self._granting.get(connection)
        if granting is not None and granting.withdrawn is None:
            granting.withdrawn = signo

    async def withdrawn(self, record: ContainerRecord, pending: PendingPrepare) -> None:
        """Granted, but a signal withdrew it first: the client is told, the container released."""
        assert pending.withdrawn is not None
        self.withdraw(pending, pending.withdrawn)
        await self.release(record, "withdrawn before its command started")

    # -- the hand-over -----------------------------------------------------------------------
    async def start(self, record: ContainerRecord, pending: PendingPrepare, env: dict[str, str]) -> None:
        """Hand the command to its supervisor (see module rules)."""
        name = record.container_id
        caller: Caller = pending.sender.caller
        conn_fd = await pending.sender.detach() if not pending.cancelled else None
        if conn_fd is None:
            logger.info("Container %s: its client went away before the command started", name)
            await self.release(record, "its client went away before the command started")
            return
        if pending.withdrawn is not None:  # a signal read while the connection was handed on
            try:
                os.write(conn_fd, encode("exited", msgspec.json.encode(withdrawn_exit(name, pending.withdrawn))))
            except OSError:
                pass
            os.close(conn_fd)
            pending.close_fds()
            await self.release(record, "withdrawn before its command started")
            return
        cgroup = self.devices.path(name)
        spec = LaunchSpec(
            container_id=name, argv=list(record.command or []), env={**(pending.body.env or {}), **env},
            cwd=pending.body.cwd or "/", uid=caller.uid, gid=caller.gid, groups=list(caller.groups),
            procs=[os.path.join(cgroup, "cgroup.procs")],
            controller="devices" if self.backend == "cgroups_v1" else "",
            suffix=f"/{self.cgroups_root}/{name}", cgroup=cgroup, socket=self.socket)
        try:
            launched = await self._host.run(launch, spec, conn_fd, pending.fds)
        finally:
            os.close(conn_fd)
        if launched.popen is not None:
            self._supervisors[name] = launched.popen  # reaped by poll
        if launched.pid is None:
            logger.warning("Container %s: its command did not start: %s", name, launched.error)
            record.releasing = True
            await self.checkpoint.save()
            return
        record.pid = launched.pid
        record.supervisor = launched.popen.pid
        self.started += 1
        await self.checkpoint.save()
        logger.info("Container %s: %s runs as process %d (uid %d) in %s", name, record.command, launched.pid,
                    caller.uid, cgroup)

    # -- released once empty ---------------------------------------------------------------
    async def cleanup(self, record: ContainerRecord, by: Caller) -> int | None:
        """A cleanup of exec container ``record`` by ``by`` (see module rules): None
        when it is released now, else how many of its processes are left."""
        name = record.container_id
        if not record.releasing:
            record.releasing = True
            await self.checkpoint.save()
        pids = (await self._host.run(_host.cgroup_pids, [self.devices.path(name)]))[0]
        count = sum(pid != record.supervisor for pid in pids)  # the command's, not its supervisor
        if not pids and name not in self._launching:
            await self.release(record, f"cleanup by {by.describe()}")
            return None
        logger.info("Container %s: %d process(es) still inside; its GPUs go when they exit", name, count)
        return count

    async def release(self, record: ContainerRecord, why: str) -> None:
        name = record.container_id
        await self.isolator.cleanup(ContainerID(name))
        if self.records.get(name) is record:
            del self.records[name]
            await self.checkpoint.save()
            self.released_when_empty += 1
            logger.info("Container %s: released its GPUs (%s; no process left in it)", name, why)
        self._freed()

    async def poll(self) -> None:
        """Release every exec container whose cgroup holds no process (one executor job)."""
        if self._polling:
            return
        for name, popen in list(self._supervisors.items()):
            if popen.poll() is not None:  # reaped
                del self._supervisors[name]
        polled = [record for record in self.records.values()
                  if (record.is_exec or record.releasing) and record.container_id not in self._launching]
        if not polled:
            return
        self._polling = True
        try:
            found = await self._host.run(_host.cgroup_pids, [self.devices.path(r.container_id) for r in polled])
            changed = False
            for record, pids in zip(polled, found):
                if self.records.get(record.container_id) is not record:
                    continue
                if not pids:
                    try:
                        await self.release(record, "its command ended" if record.pid else "nothing runs in it")
                    except Exception as error:  # the next tick tries again
                        logger.error("Container %s: release failed: %s", record.container_id, error)
                elif not record.releasing and record.supervisor is not None and record.supervisor not in pids:
                    record.releasing = changed = True  # its command ended, leaving processes behind
                    logger.info("Container %s: its command ended; %d process(es) it left keep its GPUs until"
                                " they exit", record.container_id, len(pids))
            if changed:
                await self.checkpoint.save()
        finally:
            self._polling = False
