"""``gpu-isolator serve``: the isolator as a service until SIGTERM or SIGINT.

Rules (SPEC R-SV-1, R-SC-1, R-SC-6..8):
- ``service_flags(file, args)``: the isolator's flags from a JSON or TOML
  file of ``Flags`` field names, then ``--name=value`` arguments over it.
- ``serve(flags, options)`` checks, before anything touches them, that the
  work dir and the socket's directory can be trusted (``_trust``; else it
  refuses to start, naming the path), loads the bearer credential when
  one is given (``isolators.credential``: a root-owned 0600 file, else it
  refuses to start), binds the unix socket (``_front_door.bind_socket``),
  and then runs a runtime (listening on ``options.listen`` for agents and
  ``/metrics`` when given; nothing else is reachable over TCP without the
  credential), the isolator's components, the isolator and the service
  process (which recovers and confines first: see
  ``GpuIsolatorService``) with its front door. The isolator joins the node
  ledger (SPEC 22) as ``serve:<socket>``: its GPUs are shared with every
  other front door of the node. It calls ``ready(service)``
  once it serves, and returns on SIGTERM or SIGINT: the front door, the
  service, the isolator (and its device worker) and the components stop;
  no container is cleaned up, so commands keep running under their
  supervisors and keep their GPUs, and the next ``serve`` recovers them.
  The socket is removed when it stops.
- The soft limit on open files is raised to the hard one (every
  connection is a descriptor; the per-user cap keeps one user's share).
"""

from __future__ import annotations

import grp
import logging
import os
import resource
import signal
from typing import TYPE_CHECKING, Callable, Iterable

import anyio
import msgspec

from actors.flags import Flags
from actors.ledger import serve_owner
from runtime import Runtime, terminate, wait

from ._client import DEFAULT_SOCKET
from ._trust import check_trusted_dir

if TYPE_CHECKING:
    from ._service import GpuIsolatorService

__all__ = ["ServeOptions", "serve", "service_flags"]

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ServeOptions(msgspec.Struct, kw_only=True):
    """``serve``'s own options (the isolator's are ``Flags``)."""

    socket: str = DEFAULT_SOCKET
    socket_group: str | None = None
    listen: str | None = None
    credential: str | None = None
    confine: tuple[str, ...] = ()
    max_gpus_per_user: int | None = None
    max_waiting_per_user: int = 16
    max_connections_per_user: int = 32
    idle_timeout: float = 10.0
    poll_interval: float = 1.0


def service_flags(file: str | None, args: Iterable[str] = ()) -> Flags:
    """Flags from ``file`` (or the defaults) with ``args`` (``--name=value``) over them."""
    flags = Flags.from_file(file) if file else Flags()
    args = list(args)
    if not args:
        return flags
    given = Flags.from_args(args)  # every name and value checked here
    fields = set(Flags.__struct_fields__)
    names = set()
    for arg in args:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].strip().replace("-", "_")
            names.add(name[3:] if name not in fields and name.startswith("no_") else name)
    return flags.replace(**{name: getattr(given, name) for name in sorted(names & fields)})


def _group(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise ValueError(f"--socket_group {name!r}: no such group (groupadd {name}, then add its users)") from None


def _trusted_work_dir(work_dir: str) -> None:
    check_trusted_dir(work_dir, "work directory")
    if not os.path.isdir(work_dir):
        os.makedirs(work_dir, 0o700, exist_ok=True)
    check_trusted_dir(work_dir, "work directory")  # what exists now, made by us or not


def _raise_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


async def serve(flags: Flags, options: ServeOptions | None = None, *,
                ready: Callable[["GpuIsolatorService"], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT (see module rules)."""
    from .._components import NvidiaComponents  # the whole agent: imported once flags were read
    from .._process import NvidiaGpuIsolatorProcess
    from ..credential import BearerCredential
    from ._front_door import DoorLimits, FrontDoor, bind_socket
    from ._service import GpuIsolatorService, UserLimits

    options = options or ServeOptions()
    credential = BearerCredential.load(options.credential) if options.credential else None
    group = _group(options.socket_group)
    _trusted_work_dir(flags.work_dir)  # the first thing that may make anything
    if options.listen is not None and credential is None:
        logger.warning("Listening on %s without --credential: every request there that reads or changes"
                       " containers is refused (401); /metrics stays readable", options.listen)
    _raise_open_files()
    path = os.path.abspath(options.socket)
    sock = bind_socket(path, group)
    bound = os.stat(path)
    try:
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async with Runtime(listen=options.listen):
                components = await NvidiaComponents.create(flags)
                try:
                    isolator = await NvidiaGpuIsolatorProcess.create(flags, components,
                                                                     ledger_owner=serve_owner(path))
                    try:
                        service = await GpuIsolatorService.create(
                            flags, components, isolator, options.poll_interval,
                            limits=UserLimits(max_gpus_per_user=options.max_gpus_per_user,
                                              max_waiting_per_user=options.max_waiting_per_user),
                            credential=credential, confine=tuple(options.confine), socket=path)
                        door = FrontDoor(sock, service.pid, DoorLimits(
                            max_connections_per_user=options.max_connections_per_user,
                            idle_timeout=options.idle_timeout), path)
                        async with anyio.create_task_group() as tasks:
                            await tasks.start(door.serve)
                            if ready is not None:
                                ready(service)
                            async for signum in signals:
                                logger.info("Stopping on %s; containers are left running",
                                            signal.Signals(signum).name)
                                break
                            terminate(service.pid)
                            await wait(service.pid)
                            await door.close()
                            tasks.cancel_scope.cancel()
                    finally:
                        await isolator.close()
                finally:
                    await components.close()
    finally:
        sock.close()
        try:
            if os.stat(path).st_ino == bound.st_ino:
                os.unlink(path)
        except OSError:
            pass

