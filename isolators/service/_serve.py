"""``gpu-isolator serve``: the isolator as a service until SIGTERM or SIGINT.

Rules (SPEC R-SV-1):
- ``service_flags(file, args)``: the isolator's flags from a JSON or TOML
  file of ``Flags`` field names, then ``--name=value`` arguments over it.
- ``serve(flags, listen)`` runs a runtime listening at ``listen``, the
  isolator's components, the isolator and the service process (which
  recovers first: see ``GpuIsolatorService``), calls ``ready(service)``
  once it serves, and returns on SIGTERM or SIGINT: the service, the
  isolator (and its device worker) and the components stop; no container
  is cleaned up, so commands keep running and keep their GPUs, and the
  next ``serve`` recovers them.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Callable, Iterable

import anyio

from actors.flags import Flags
from runtime import Runtime, terminate, wait

if TYPE_CHECKING:
    from ._service import GpuIsolatorService

__all__ = ["serve", "service_flags"]

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


async def serve(flags: Flags, listen: str, *, poll_interval: float = 1.0,
                ready: Callable[["GpuIsolatorService"], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT (see module rules)."""
    from .._components import NvidiaComponents  # the whole agent: imported once flags were read
    from .._process import NvidiaGpuIsolatorProcess
    from ._service import GpuIsolatorService

    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with Runtime(listen=listen):
            components = await NvidiaComponents.create(flags)
            try:
                isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
                try:
                    service = await GpuIsolatorService.create(flags, components, isolator, poll_interval)
                    if ready is not None:
                        ready(service)
                    async for signum in signals:
                        logger.info("Stopping on %s; containers are left running", signal.Signals(signum).name)
                        break
                    terminate(service.pid)
                    await wait(service.pid)
                finally:
                    await isolator.close()
            finally:
                await components.close()
