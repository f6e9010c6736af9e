"""``gpu-isolator exec``: run a command inside a container the service grants.

Rules (SPEC R-SV-2):
- ``exec_command(agent, gpus, argv, wait, mig)`` forks the command at once
  (``PendingCommand``: it waits, running nothing), starts taking signals
  (``SignalForwarder``), then in a runtime listening on this host asks the
  service at ``agent`` for a container (``prepare``; with ``wait`` it
  queues, saying so once on stderr), has the service move the command's
  process into it (``start``), checks with the kernel that it is there
  (``/proc/<pid>/cgroup``), and only then lets it run, with
  ``NVIDIA_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` set to the
  granted GPUs' UUIDs (a MIG device's ``MIG-...`` UUID; ``mig``: MIG
  devices by profile, under ``--nvidia_mig_strategy=mixed``). A whole GPU
  granted in MIG mode (the service runs ``none``) gets a note on stderr:
  CUDA runs on it only through MIG devices, which the command does not
  hold. Signals are forwarded while it runs; when it ends
  the container is cleaned up (the service releases the GPUs once no
  process is left in it) and its status is returned: its exit code, or
  128 + N when signal N killed it.
- Anything that stops the command from running is one line on stderr
  (``gpu-isolator exec: error: ...``) and exit status 125 (the service
  refused -- Mesos' "Requested N gpus but only M available" --, cannot be
  reached, or went away); 126 / 127 when the command cannot be executed /
  is not found; 128 + N when signal N came before the command ran (the
  request is withdrawn). Whatever was granted is cleaned up.
- The client links to the service: losing it before the command runs is
  an error; while it runs, the command goes on (the kernel keeps enforcing
  its grant) and the cleanup at the end is retried for ``CLEANUP_RETRY``
  seconds (a restarted service answers it); after that the service itself
  releases the container once it is empty.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys

import anyio

from runtime import PID, Executor, Failure, Runtime, dispatch, spawn

from . import _host
from ._launcher import PendingCommand, SignalForwarder, exit_code
from ._client import LostService, ServiceClient
from ._demand import demand_of, describe
from ._messages import SERVICE_ID, CleanedUp, Cleanup, Prepare, Prepared, Queued, Start, Started

__all__ = ["exec_command", "DEFAULT_AGENT", "agent_address", "CLEANUP_RETRY"]

logger = logging.getLogger(__name__)

DEFAULT_AGENT = "127.0.0.1:5052"
CLEANUP_RETRY = 15.0
ANSWER_TIMEOUT = 60.0
FAILED = 125
PROG = "gpu-isolator exec"


def agent_address(agent: str | None) -> str:
    """``--agent``, else ``$GPU_ISOLATOR_AGENT``, else the default; checked."""
    text = agent or os.environ.get("GPU_ISOLATOR_AGENT") or DEFAULT_AGENT
    parse_address(text)
    return text


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); ValueError naming the value otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Invalid address {text!r}: expected HOST:PORT, e.g. {DEFAULT_AGENT}")
    return host, int(port)


def local_address_toward(host: str, port: int) -> str:
    """The address of this host that reaches ``host:port`` (where the client listens)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def exec_command(agent: str, gpus: int, argv: list[str], wait: bool = False, mig: dict[str, int] | None = None) -> int:
    """Run ``argv`` in a new container of ``gpus`` GPUs and ``mig`` MIG devices
    by profile (see module rules); the exit status."""
    host, port = parse_address(agent)
    command = PendingCommand.fork(argv)
    forwarder = SignalForwarder()
    forwarder.start()
    try:
        return asyncio.run(_exec(host, port, gpus, command, forwarder, wait, mig or {}))
    finally:
        command.close()
        if command.status is None:
            command.wait()  # aborted: it exits at once


async def _exec(host: str, port: int, gpus: int, command: PendingCommand, forwarder: SignalForwarder,
                wait: bool, mig: dict[str, int]) -> int:
    try:
        local = local_address_toward(host, port)
    except OSError as error:
        _say(f"error: cannot reach {host}:{port}: {error.strerror or error}")
        return FAILED
    executor = Executor(2, name="gpu-isolator-exec")
    async with Runtime(listen=f"{local}:0"):
        client = ServiceClient(PID(SERVICE_ID, host, port), id="gpu-isolator-exec")
        spawn(client)
        container_id = f"exec-{secrets.token_hex(6)}"
        try:
            return await _run(client, container_id, gpus, command, forwarder, executor, wait, mig)
        finally:
            executor.shutdown(wait=False)


async def _run(client: ServiceClient, container_id: str, gpus: int, command: PendingCommand,
               forwarder: SignalForwarder, executor: Executor, wait: bool, mig: dict[str, int]) -> int:
    loop = asyncio.get_running_loop()
    interrupted: list[int] = []
    granted = False
    with anyio.CancelScope() as setup:
        def before(signo: int) -> None:
            interrupted.append(signo)
            setup.cancel()

        forwarder.before = lambda signo: loop.call_soon_threadsafe(before, signo)
        try:
            request = f"{container_id}/prepare"

            def queued(body: Queued) -> None:
                wanted = demand_of(body.gpus, body.mig)
                free = f"{body.free}" if not body.mig else " and ".join(
                    ([f"{body.free} GPU(s)"] if body.gpus else [])
                    + [f"{body.mig_free.get(profile, 0)} MIG {profile}" for profile in body.mig])
                _say(f"waiting for {describe(wanted)}: {free} free, {body.position - 1} request(s) ahead")

            client.on_queued = queued
            with anyio.fail_after(None if wait else ANSWER_TIMEOUT):
                prepared: Prepared = await dispatch(client.pid, ServiceClient.ask, "prepare", Prepare(
                    request=request, container_id=container_id, gpus=gpus, mig=mig, wait=wait, command=command.argv))
            if prepared.error is not None:
                _say(f"error: {prepared.error}")
                return FAILED
            granted = True
            for gpu in prepared.gpus:
                if gpu.mig_mode:
                    _say(f"note: GPU {gpu.index if gpu.index is not None else gpu.minor} is in MIG mode and is granted"
                         " whole (the service runs --nvidia_mig_strategy=none): CUDA runs on it only through its MIG"
                         " devices, which this command does not hold")
            with anyio.fail_after(ANSWER_TIMEOUT):
                started: Started = await dispatch(client.pid, ServiceClient.ask, "start", Start(
                    request=f"{container_id}/start", container_id=container_id, token=prepared.token or "",
                    pid=command.pid))
            if started.error is not None:
                raise Failure(started.error)
            where = _host.cgroup_of(command.pid, started.controller or "")
            if where is None or not where.endswith(started.cgroup_suffix or "\0"):
                raise Failure(f"the command's process {command.pid} is not in the container's cgroup (the kernel"
                              f" says {where!r}); not running it")
            forwarder.target = command.pid
        except TimeoutError:
            _say("error: the gpu-isolator service did not answer in time")
            return await _give_up(client, container_id, granted, command, FAILED)
        except Failure as error:
            _say(f"error: {error}")
            return await _give_up(client, container_id, granted, command, FAILED)
    if interrupted:
        name = signal.Signals(interrupted[0]).name
        _say(f"{name} before the command started: request withdrawn")
        return await _give_up(client, container_id, True, command, 128 + interrupted[0])
    logger.info("Container %s: running %s as process %d with GPUs %s", container_id, command.argv, command.pid,
                [g.mig_device or g.minor for g in prepared.gpus])
    error = await executor.run(command.run, prepared.env)
    if error is not None:
        _say(f"error: cannot run {command.argv[0]!r}: {error.strerror}")
    status = exit_code(await executor.run(command.wait))
    forwarder.target = None
    await _cleanup(client, container_id)
    return status


async def _give_up(client: ServiceClient, container_id: str, granted: bool, command: PendingCommand, code: int) -> int:
    command.abort()
    if granted:
        await _cleanup(client, container_id, retry=3.0)
    return code


async def _cleanup(client: ServiceClient, container_id: str, retry: float = CLEANUP_RETRY) -> None:
    """Ask the service to clean the container up, retrying while it cannot be reached."""
    deadline = anyio.current_time() + retry
    attempt = 0
    while True:
        attempt += 1
        try:
            with anyio.fail_after(max(0.1, deadline - anyio.current_time())):
                answer: CleanedUp = await dispatch(client.pid, ServiceClient.ask, "cleanup", Cleanup(
                    request=f"{container_id}/cleanup/{attempt}", container_id=container_id))
            break
        except LostService:
            if anyio.current_time() >= deadline:
                _say(f"the service did not answer the cleanup of {container_id}; it releases the container's GPUs"
                     " itself once no process is left in it")
                return
            await anyio.sleep(0.25)
        except TimeoutError:
            _say(f"the service did not answer the cleanup of {container_id} in time; it releases the container's"
                 " GPUs itself once no process is left in it")
            return
    if answer.error is not None:
        _say(f"cleanup of {container_id} failed: {answer.error}")
    elif not answer.released:
        _say(f"{answer.processes} process(es) the command left are still running in {container_id}; its GPUs are"
             " released when they exit")
