"""How a Kubernetes front door runs: its node's parts, served until SIGTERM or SIGINT.

Rules (R-K8-8; SPEC section 21):
- ``node_parts(flags, listen, name)`` (an async context manager) is what
  every front door runs on: the stop signals' receiver (opened first, so a
  signal during the start is not lost), a runtime (listening at
  ``listen`` for ``/metrics`` and the operator's routes), the components
  (inventory, allocator with health and topology, volume: R-NV-1, so no
  NVML and no host file is an ``IsolatorError``) and one executor for the
  sockets' file work. On the way out the executor and the components
  close, whatever happened.
- ``serve_until_stopped(parts, process, tasks=, started=, ready=,
  removing=)``: starts the ``started`` tasks (each reports ``started``,
  e.g. a socket listening) one after the other, then the ``tasks``, calls
  ``ready()``, and waits for the first of ``STOP_SIGNALS`` (logged:
  "Stopping on SIGTERM: removing <removing>"); then every task is
  cancelled (each socket removes its own file, nothing else) and the
  front door's actor ``process`` terminated and waited for. It returns
  normally: the command exits 0.
- ``mps_daemons(nvml, runtime_dir, control, cgroup)`` is a sharing front
  door's ``actors.mps.MpsDaemons`` (SPEC R-MP-1, R-MP-8), its daemons
  started in ``cgroup`` (``--mps_cgroup``).
  ``stop_left_daemons(mps, allocator, units)``, once a restarted sharing
  front door has granted its live shares again (and before it returns
  what the earlier life leased and nothing holds now): every daemon left
  running with no share (its last share went while the front door was
  down) is stopped (``MpsDaemons.left_running`` / ``stop_left``). With the
  node ledger (``allocator`` given) the unit is held first for
  ``LEFT_DAEMON_HOLDER`` (take before any effect, R-NL-2) and let go once
  the daemon stopped; a unit another front door holds is refused there and
  its daemon left alone: it is theirs (the runtime directory may be the
  node's, shared by every front door). A unit the front door does not
  manage (not in ``units``, UUID -> unit) is left alone. A failure is
  logged; the next start tries again.
- ``DEFAULT_CDI_SPEC_DIR`` (``/var/run/cdi``) is where a front door writes
  its CDI specs when ``--cdi_spec_dir`` is not given.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import anyio

from actors.flags import Flags
from runtime import PID, Executor, Runtime, terminate, wait

__all__ = ["DEFAULT_CDI_SPEC_DIR", "LEFT_DAEMON_HOLDER", "STOP_SIGNALS", "NodeParts", "mps_daemons", "node_parts",
           "serve_until_stopped", "stop_left_daemons", "stop_on_signal"]

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"


class NodeParts(NamedTuple):
    """What a front door runs on (see module rules)."""

    signals: Any
    runtime: Runtime
    components: Any
    """``NvidiaComponents``: ``inventory``, ``allocator``, ``volume``."""
    sockets: Executor


@asynccontextmanager
async def node_parts(flags: Flags, listen: str | None, name: str) -> AsyncIterator[NodeParts]:
    """The signals, runtime, components and sockets' executor of a front door (see module rules)."""
    from .._components import NvidiaComponents  # the agent's parts, imported once flags were read

    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with Runtime(listen=listen) as runtime:
            components = await NvidiaComponents.create(flags)
            sockets = Executor(1, name=f"{name}-sockets")
            try:
                yield NodeParts(signals, runtime, components, sockets)
            finally:
                sockets.shutdown(wait=False)
                await components.close()


def mps_daemons(nvml: Any, runtime_dir: str, control: str | None, cgroup: str = "none") -> Any:
    """The front door's MPS daemons (``actors.mps.MpsDaemons``, SPEC R-MP-1): one per shared unit under
    ``runtime_dir``, ``control`` the ``nvidia-cuda-mps-control`` to run (None: found on PATH, where the
    driver's binaries are), started in ``cgroup`` (``--mps_cgroup``; ``none``: the front door's own). Never closed by the front door's stop: prepared shares' pods keep their daemons,
    and the next start takes them over."""
    from actors.mps import DEFAULT_MPS_CONTROL, MpsDaemons

    return MpsDaemons(nvml, runtime_dir, control or DEFAULT_MPS_CONTROL, cgroup=cgroup)


LEFT_DAEMON_HOLDER = "mps-daemon-left-running"
"""The node ledger holder a front door stops a daemon left running under (see module rules)."""


async def stop_left_daemons(mps: Any, allocator: Any, units: Mapping[str, Any]) -> list[str]:
    """Stop the daemons left running with no share (see module rules); the units whose daemon stopped."""
    from actors.allocator import AllocatorError

    stopped = []
    for uuid in await mps.left_running():
        unit = units.get(uuid)
        if unit is None:
            continue
        if allocator is not None:
            try:
                await allocator.hold([unit], LEFT_DAEMON_HOLDER)
            except AllocatorError as error:
                logger.info("MPS control daemon of %s runs with no share of this front door, and the unit is not"
                            " its to stop: %s", uuid, error)
                continue
        try:
            if await mps.stop_left(uuid):
                stopped.append(uuid)
        except Exception as error:  # noqa: BLE001 - said loudly; the next start tries again
            logger.error("MPS control daemon of %s, left running with no share, could not be stopped: %s", uuid,
                         error)
        finally:
            if allocator is not None:
                await allocator.let_go(LEFT_DAEMON_HOLDER, [unit])
    if stopped:
        logger.info("MPS control daemons left running with no share stopped: %s", ", ".join(stopped))
    return stopped


async def stop_on_signal(signals: Any, removing: str) -> None:
    """Return at the first of ``STOP_SIGNALS`` (an anyio signal receiver), saying so."""
    async for signum in signals:
        logger.info("Stopping on %s: removing %s", signal.Signals(signum).name, removing)
        return


async def serve_until_stopped(parts: NodeParts, process: PID, *, tasks: Sequence[Callable[[], Any]] = (),
                              started: Sequence[Callable[..., Any]] = (), ready: Callable[[], None] | None = None,
                              removing: str) -> None:
    """Run the front door's tasks until SIGTERM or SIGINT, then stop them and ``process`` (see module rules)."""
    try:
        async with anyio.create_task_group() as group:
            for start in started:
                await group.start(start)
            for task in tasks:
                group.start_soon(task)
            if ready is not None:
                ready()
            await stop_on_signal(parts.signals, removing)
            group.cancel_scope.cancel()
    finally:
        terminate(process)
        await wait(process)
