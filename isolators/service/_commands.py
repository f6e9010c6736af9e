"""The ``serve``, ``exec`` and ``status`` commands of the ``gpu-isolator`` CLI.

Rules:
- ``add_commands(sub)`` adds the three subcommands to the CLI's parser;
  each sets ``func``. ``serve`` accepts the isolator's flags as extra
  ``--name=value`` options (``accepts_flags``); its own options are spelled
  the same way (``--socket=PATH``, ``--socket_group=G``,
  ``--listen=H:P``, ``--credential=FILE``, ``--confine=CGROUP``,
  ``--max_gpus_per_user=N``, ...; SPEC R-SC-1). The other commands refuse
  unknown options as every command does.
- ``serve`` logs at INFO on stderr and prints one line on stdout once it
  serves (``serving on <socket> ...``); it exits 0 after SIGTERM or
  SIGINT, 2 when it refuses to start (an untrusted work dir, a credential
  file others may read, a socket another service answers on...).
- ``exec`` returns the command's status (see ``_exec``); its own errors
  exit 125, bad arguments 2 (as every command).
- ``status`` prints the table (``--json``: the state document as served).
- ``exec`` and ``status`` reach the service at ``--socket``, else
  ``$GPU_ISOLATOR_SOCKET``, else ``/run/gpu-isolator/gpu-isolator.sock``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

import msgspec

__all__ = ["add_commands"]

PROG = "gpu-isolator"


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_commands(sub: Any) -> None:
    from ._client import DEFAULT_SOCKET

    serve = sub.add_parser(
        "serve", allow_abbrev=False,
        help="run the isolator as the service users reach with 'exec' and 'status'",
        description="Run the isolator as a service. Users reach it on a unix socket, where the kernel says who is"
                    " asking (SO_PEERCRED): exec starts their command as them inside a container of its own, and"
                    " each user touches and reads only their own containers. Agents may reach it over TCP with a"
                    " bearer credential. It recovers the containers it left running, and stops on SIGTERM or"
                    " SIGINT without touching them.",
        epilog="Any other --name=value option is one of the isolator's flags (Flags field names, e.g."
               " --device_backend=cgroups_v2 --host_file=node.toml); they override --flags FILE.",
    )
    serve.add_argument("--socket", metavar="PATH", default=DEFAULT_SOCKET,
                       help=f"the unix socket users reach it on (default {DEFAULT_SOCKET}; its directory is made"
                            " root's, mode 0755)")
    serve.add_argument("--socket_group", metavar="GROUP",
                       help="only root and this group may connect (socket mode 0660; default: everyone, 0666)")
    serve.add_argument("--listen", metavar="HOST:PORT",
                       help="also listen on TCP for agents (libprocess messages, /metrics); requests that read or"
                            " change containers need --credential's secret (Authorization: Bearer)")
    serve.add_argument("--credential", metavar="FILE",
                       help="the bearer secret TCP agents present (a root-owned file of mode 0600)")
    serve.add_argument("--confine", metavar="CGROUP", action="append", default=[],
                       help="deny every GPU and MIG node to this cgroup and those below it (a path from the"
                            " hierarchy's root, e.g. user.slice); repeatable; re-checked every tick")
    serve.add_argument("--max_gpus_per_user", metavar="N", type=_count,
                       help="GPUs (and MIG devices) one user's commands may hold at once (default: no limit)")
    serve.add_argument("--max_waiting_per_user", metavar="N", type=_count, default=16,
                       help="requests one user may have waiting in line (default 16)")
    serve.add_argument("--max_connections_per_user", metavar="N", type=_positive, default=32,
                       help="connections one user may hold open (default 32)")
    serve.add_argument("--idle_timeout", metavar="SECONDS", type=float, default=10.0,
                       help="close a connection that sends nothing for this long while none of its requests is"
                            " unanswered, or that leaves a frame unfinished (default 10)")
    serve.add_argument("--flags", metavar="FILE", help="the isolator's flags as a JSON or TOML file")
    serve.add_argument("--poll-interval", metavar="SECONDS", type=float, default=1.0,
                       help="how often exec containers are checked for remaining processes, and --confine"
                            " re-checked (default 1)")
    serve.set_defaults(func=_cmd_serve, accepts_flags=True)

    exec_ = sub.add_parser(
        "exec", allow_abbrev=False,
        help="run a command with N GPUs of its own, enforced by the kernel",
        description="Ask the service for a container with N GPUs (the best-connected free ones) and/or MIG devices"
                    " by profile (--mig). The service starts CMD as you, inside the container's cgroup, with your"
                    " environment, directory, stdin, stdout and stderr, NVIDIA_VISIBLE_DEVICES and"
                    " CUDA_VISIBLE_DEVICES set to the GPUs' UUIDs; exec forwards signals to it and exits with its"
                    " status (128+N when signal N killed it); 125 when it could not be started (e.g. too few free"
                    " GPUs), 126/127 when it cannot be executed / is not found. Options come before CMD (or"
                    " '--').",
    )
    exec_.add_argument("--socket", metavar="PATH",
                       help=f"the service's socket (default: $GPU_ISOLATOR_SOCKET, else {DEFAULT_SOCKET})")
    exec_.add_argument("--gpus", metavar="N", type=int,
                       help="how many GPUs (whole GPUs; MIG devices where the service runs"
                            " --nvidia_mig_strategy=single)")
    exec_.add_argument("--mig", metavar="PROFILE[:N]", action="append", default=[],
                       help="N MIG devices of PROFILE (e.g. 1g.18gb:2; N defaults to 1), where the service runs"
                            " --nvidia_mig_strategy=mixed; repeat for several profiles ('status' lists them)")
    exec_.add_argument("--wait", action="store_true",
                       help="wait in line until they are free (first come, first served) instead of failing")
    exec_.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ARGS",
                       help="the command and its arguments")
    exec_.set_defaults(func=_cmd_exec)

    status = sub.add_parser(
        "status", allow_abbrev=False, help="show your containers, what others hold, free and unhealthy GPUs",
        description="Show your containers (their GPUs, processes and commands; root: everyone's), how many GPUs"
                    " other users hold, the free and unhealthy GPUs and the requests waiting for GPUs.",
    )
    status.add_argument("--socket", metavar="PATH",
                        help=f"the service's socket (default: $GPU_ISOLATOR_SOCKET, else {DEFAULT_SOCKET})")
    status.add_argument("--json", action="store_true", help="print the state document as JSON")
    status.set_defaults(func=_cmd_status)


def _usage(message: str) -> Exception:
    from ..cli import UsageError

    return UsageError(message)


def _cmd_serve(args: argparse.Namespace) -> int:
    from ._serve import ServeOptions, serve, service_flags

    flags = service_flags(args.flags, getattr(args, "extra", []))
    if not args.poll_interval > 0:
        raise _usage(f"{PROG} serve: error: --poll-interval must be > 0, got {args.poll_interval}")
    if not args.idle_timeout > 0:
        raise _usage(f"{PROG} serve: error: --idle_timeout must be > 0, got {args.idle_timeout}")
    if args.listen is not None:
        from runtime import parse_address

        try:
            parse_address(args.listen)
        except ValueError as error:
            raise _usage(f"{PROG} serve: error: {error}") from None
    logging.getLogger().setLevel(logging.INFO)
    options = ServeOptions(socket=args.socket, socket_group=args.socket_group, listen=args.listen,
                           credential=args.credential, confine=tuple(args.confine),
                           max_gpus_per_user=args.max_gpus_per_user, max_waiting_per_user=args.max_waiting_per_user,
                           max_connections_per_user=args.max_connections_per_user, idle_timeout=args.idle_timeout,
                           poll_interval=args.poll_interval)

    def ready(service: Any) -> None:
        backend = service.backend
        note = "; in memory: nothing is enforced and exec is refused" if backend == "memory" else ""
        units = service.units
        mig = f", {len(units.mig_pool)} MIG device(s) ({units.strategy})" if units.mig_pool else ""
        tcp = f" and as {service.pid}" if args.listen else ""
        confined = f"; confined: {', '.join(service.confine)}" if service.confine else ""
        print(f"{PROG} serve: serving on {service.socket}{tcp} ({backend} at {service.devices.root};"
              f" {len(units.whole)} GPU(s){mig}, {len(service.records)} container(s)"
              f" recovered{confined}{note})", flush=True)

    asyncio.run(serve(flags, options, ready=ready))
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    from ._client import socket_path
    from ._demand import merge_mig_options
    from ._exec import exec_command

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _usage(f"{PROG} exec: error: no command given (usage: {PROG} exec --gpus N [--] CMD ARGS...)")
    if args.gpus is None and not args.mig:
        raise _usage(f"{PROG} exec: error: say what the command gets: --gpus N (0: no GPU) and/or --mig PROFILE[:N]")
    if args.gpus is not None and args.gpus < 0:
        raise _usage(f"{PROG} exec: error: --gpus must be a whole number >= 0, got {args.gpus}")
    try:
        mig = merge_mig_options(args.mig)
    except ValueError as error:
        raise _usage(f"{PROG} exec: error: {error}") from None
    return exec_command(socket_path(args.socket), args.gpus or 0, command, wait=args.wait, mig=mig)


def _cmd_status(args: argparse.Namespace) -> int:
    from ._client import socket_path
    from ._status import fetch_state, render_state

    state = fetch_state(socket_path(args.socket))
    if args.json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(state)) + b"\n")
        sys.stdout.flush()
    else:
        print(render_state(state), flush=True)
    return 0
