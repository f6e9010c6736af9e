"""The ``serve``, ``exec`` and ``status`` commands of the ``gpu-isolator`` CLI.

Rules:
- ``add_commands(sub)`` adds the three subcommands to the CLI's parser;
  each sets ``func``. ``serve`` accepts the isolator's flags as extra
  ``--name=value`` options (``accepts_flags``); the other commands refuse
  unknown options as every command does.
- ``serve`` logs at INFO on stderr and prints one line on stdout once it
  serves (``serving as gpu-isolator@HOST:PORT ...``); it exits 0 after
  SIGTERM or SIGINT.
- ``exec`` returns the command's status (see ``_exec``); its own errors
  exit 125, bad arguments 2 (as every command).
- ``status`` prints the table (``--json``: the state document as served).
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


def add_commands(sub: Any) -> None:
    from ._exec import DEFAULT_AGENT

    serve = sub.add_parser(
        "serve", allow_abbrev=False,
        help="run the isolator as a service that 'exec' and other libprocess peers can reach",
        description="Run the isolator as the libprocess process gpu-isolator@HOST:PORT: messages prepare, start,"
                    " update, usage and cleanup (replies go to the sender), GET /gpu-isolator/state, /metrics,"
                    " /__processes__. It recovers the containers it left running, and stops on SIGTERM or SIGINT"
                    " without touching them.",
        epilog="Any other --name=value option is one of the isolator's flags (Flags field names, e.g."
               " --device_backend=cgroups_v2 --host_file=node.toml); they override --flags FILE.",
    )
    serve.add_argument("--listen", metavar="HOST:PORT", default=DEFAULT_AGENT,
                       help=f"where to listen (default {DEFAULT_AGENT}; port 0: any free port; keep it on"
                            " loopback: any peer that reaches it may ask for GPUs)")
    serve.add_argument("--flags", metavar="FILE", help="the isolator's flags as a JSON or TOML file")
    serve.add_argument("--poll-interval", metavar="SECONDS", type=float, default=1.0,
                       help="how often containers whose client is gone are checked for remaining processes"
                            " (default 1)")
    serve.set_defaults(func=_cmd_serve, accepts_flags=True)

    exec_ = sub.add_parser(
        "exec", allow_abbrev=False,
        help="run a command with N GPUs of its own, enforced by the kernel",
        description="Ask the service for a container with N GPUs (the best-connected free ones) and/or MIG devices"
                    " by profile (--mig), run CMD inside"
                    " its cgroup with NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES set to their UUIDs,"
                    " forward signals to it, and release the GPUs when it ends. Exit status: the command's (128+N"
                    " when signal N killed it); 125 when it could not be started (e.g. too few free GPUs),"
                    " 126/127 when it cannot be executed / is not found. Options come before CMD (or '--').",
    )
    exec_.add_argument("--agent", metavar="HOST:PORT",
                       help=f"the service (default: $GPU_ISOLATOR_AGENT, else {DEFAULT_AGENT})")
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
        "status", allow_abbrev=False, help="show the service's containers, free and unhealthy GPUs",
        description="Show the containers of the service (their GPUs, users, processes and commands), its free"
                    " and unhealthy GPUs and the requests waiting for GPUs (GET /gpu-isolator/state).",
    )
    status.add_argument("--agent", metavar="HOST:PORT",
                        help=f"the service (default: $GPU_ISOLATOR_AGENT, else {DEFAULT_AGENT})")
    status.add_argument("--json", action="store_true", help="print the state document as JSON")
    status.set_defaults(func=_cmd_status)


def _usage(message: str) -> Exception:
    from ..cli import UsageError

    return UsageError(message)


def _cmd_serve(args: argparse.Namespace) -> int:
    from ._serve import serve, service_flags

    flags = service_flags(args.flags, getattr(args, "extra", []))
    if not args.poll_interval > 0:
        raise _usage(f"{PROG} serve: error: --poll-interval must be > 0, got {args.poll_interval}")
    logging.getLogger().setLevel(logging.INFO)

    def ready(service: Any) -> None:
        backend = service.backend
        note = "; in memory: nothing is enforced and exec is refused" if backend == "memory" else ""
        units = service.units
        mig = f", {len(units.mig_pool)} MIG device(s) ({units.strategy})" if units.mig_pool else ""
        print(f"{PROG} serve: serving as {service.pid} ({backend} at {service.devices.root};"
              f" {len(units.whole)} GPU(s){mig}, {len(service.records)} container(s)"
              f" recovered{note})", flush=True)

    asyncio.run(serve(flags, args.listen, poll_interval=args.poll_interval, ready=ready))
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    from ._demand import merge_mig_options
    from ._exec import agent_address, exec_command

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
    try:
        agent = agent_address(args.agent)
    except ValueError as error:
        raise _usage(f"{PROG} exec: error: {error}") from None
    return exec_command(agent, args.gpus or 0, command, wait=args.wait, mig=mig)


def _cmd_status(args: argparse.Namespace) -> int:
    from ._exec import agent_address, parse_address
    from ._status import fetch_state, render_state

    try:
        host, port = parse_address(agent_address(args.agent))
    except ValueError as error:
        raise _usage(f"{PROG} status: error: {error}") from None
    state = fetch_state(host, port)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(state)) + b"\n")
        sys.stdout.flush()
    else:
        print(render_state(state), flush=True)
    return 0
