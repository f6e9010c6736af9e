"""``gpu-isolator exec``: a command in a container of its own, started by the service as you.

Rules (SPEC R-SV-2, R-SC-2):
- ``exec_command(socket, gpus, argv, wait, mig)`` starts taking signals
  (``SignalForwarder``), connects to the service's unix socket and asks
  for a container (``prepare``, with the command, this process's
  environment and working directory, and its stdin, stdout and stderr as
  descriptors; with ``wait`` it queues, saying so on stderr each time
  it moves up). The service starts the command itself, as the kernel says
  the caller is, inside the container's cgroup (``_supervisor``); the
  client only talks: it forwards its signals to the command (those the
  terminal sent to the whole foreground group, such as Ctrl-C, go to the
  command's whole process group) and exits with the command's status:
  its exit code, or 128 + N when signal N killed it. A whole GPU granted
  in MIG mode (the service runs ``none``) gets a note on stderr.
- Anything that stops the command from running is one line on stderr
  (``gpu-isolator exec: error: ...``) and exit status 125 (the service
  refused -- Mesos' "Requested N gpus but only M available" --, cannot be
  reached, or went away); 126 / 127 when the command cannot be executed /
  is not found; 128 + N when signal N came before the command ran. Every
  signal is sent on the connection as it comes (the client keeps no
  state that could race the command's start): one the service gets
  before it handed the connection to the supervisor withdraws the
  request, and the service answers so; one the supervisor gets reaches
  the command (just started, if need be).
- The command keeps its GPUs as long as any of its processes runs; when
  it leaves some behind, exec says how many (their GPUs go when they
  exit). Losing the connection once the command runs (its supervisor was
  killed) is an error (125): the exit status is unknown.
- No process of the client's is ever moved into a cgroup, and nothing it
  sends says who it is.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading

from ._client import LostService, Refused, SocketClient, request_id
from ._demand import demand_of, describe
from ._launcher import SignalForwarder

__all__ = ["exec_command", "ANSWER_TIMEOUT"]

ANSWER_TIMEOUT = 60.0
FAILED = 125
PROG = "gpu-isolator exec"


def _say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _stdio() -> tuple[tuple[int, int, int], list[int]]:
    """Descriptors 0, 1 and 2 (``/dev/null`` for any that is closed), and those opened for it."""
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            opened.append(null)
            fds.append(null)
    return (fds[0], fds[1], fds[2]), opened


def exec_command(socket_path: str, gpus: int, argv: list[str], wait: bool = False,
                 mig: dict[str, int] | None = None) -> int:
    """Run ``argv`` in a new container of ``gpus`` GPUs and ``mig`` MIG devices
    by profile (see module rules); the exit status."""
    forwarder = SignalForwarder()
    forwarder.start()  # before any other thread: they inherit the block
    try:
        cwd = os.getcwd()
    except OSError as error:
        _say(f"error: cannot tell the current directory: {error.strerror}")
        return FAILED
    try:
        client = SocketClient.connect(socket_path)
    except LostService as error:
        _say(f"error: {error}")
        return FAILED
    with client:
        return _run(client, forwarder, gpus, argv, wait, mig or {}, cwd)


def _run(client: SocketClient, forwarder: SignalForwarder, gpus: int, argv: list[str], wait: bool,
         mig: dict[str, int], cwd: str) -> int:
    container_id = f"exec-{secrets.token_hex(6)}"
    early: list[int] = []
    lock = threading.Lock()

    def forward(signo: int, group: bool) -> None:
        try:
            client.send("signal", {"signo": signo, "group": group})
        except LostService:
            pass

    def before(signo: int) -> None:  # before the request is out: sent right after it
        with lock:
            if forwarder.forward is None:
                early.append(signo)
                return
        forward(signo, False)

    def queued(body: dict) -> None:
        wanted = demand_of(body.get("gpus", 0), body.get("mig") or {})
        free = body.get("free", 0)
        text = f"{free}" if not body.get("mig") else " and ".join(
            ([f"{free} GPU(s)"] if body.get("gpus") else [])
            + [f"{(body.get('mig_free') or {}).get(profile, 0)} MIG {profile}" for profile in body["mig"]])
        _say(f"waiting for {describe(wanted)}: {text} free, {body.get('position', 1) - 1} request(s) ahead")

    forwarder.before = before
    client.on_queued = queued
    stdio, opened = _stdio()
    phase = "prepare"
    try:
        client.send("prepare", {"request": request_id("prepare"), "container_id": container_id, "gpus": gpus,
                                "mig": mig, "wait": wait, "command": argv, "env": dict(os.environ), "cwd": cwd},
                    stdio)
        for fd in opened:
            os.close(fd)
        with lock:
            forwarder.forward = forward  # from now on every signal goes to the service, then to the command
            for signo in early:
                forward(signo, False)
        frame = client.receive(None if wait else ANSWER_TIMEOUT)
        if frame.verb == "prepared":
            prepared = frame.body
            if prepared.get("error") is not None:
                _say(f"error: {prepared['error']}")
                return FAILED
            for gpu in prepared.get("gpus", []):
                if gpu.get("mig_mode"):
                    index = gpu.get("index") if gpu.get("index") is not None else gpu.get("minor")
                    _say(f"note: GPU {index} is in MIG mode and is granted whole (the service runs"
                         " --nvidia_mig_strategy=none): CUDA runs on it only through its MIG devices, which this"
                         " command does not hold")
            phase = "start"
            frame = client.receive(ANSWER_TIMEOUT)
        if frame.verb == "started":
            phase = "run"
            frame = client.receive(None)
        if frame.verb != "exited":
            _say(f"error: the service answered {frame.verb!r} where the command's end was expected")
            return FAILED
        end = frame.body
        if end.get("withdrawn"):
            _say(f"{signal.Signals(end['signal']).name} before the command started: request withdrawn")
        elif end.get("error"):
            _say(f"error: {end['error']}")
        if end.get("left"):
            _say(f"{end['left']} process(es) the command left are still running in {container_id}; its GPUs are"
                 " released when they exit")
        return int(end.get("status", FAILED))
    except TimeoutError:
        _say("error: the gpu-isolator service did not answer in time")
        return FAILED
    except (LostService, Refused) as error:
        if phase == "run":
            _say(f"error: lost the command's supervisor ({error}); the command's exit status is unknown")
        else:
            _say(f"error: {error}")
        return FAILED
    finally:
        forwarder.forward = None
