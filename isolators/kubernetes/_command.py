"""What the Kubernetes front doors' commands share: the operator's options, one-line usage errors, the flags.

Rules (R-K8-1, R-K8-9; SPEC section 21):
- ``front_door_parser(sub, command, help=, description=, routes=,
  flags_example=)`` adds the command's parser (no abbreviations; its
  epilog says that any other ``--name=value`` is one of the isolator's
  flags, with ``flags_example``) with the options every front door takes:
  ``--listen HOST:PORT``
  (``/metrics`` and the operator's ``routes``), ``--credential FILE`` (the
  bearer secret those routes need: root-owned, mode 0600; needs
  ``--listen``), ``--flags FILE`` (the isolator's flags, JSON or TOML),
  ``--mps_control PATH`` (SPEC R-MP-8: the ``nvidia-cuda-mps-control``
  the front door runs for units it shares through MPS; default None: the
  one where the driver's binaries are), ``--mps_cgroup NAME`` (where those
  daemons are started: ``<hierarchy>/<NAME>`` in every cgroup hierarchy,
  out of the front door's own so they outlive its container;
  default ``none``: the front door's own cgroup; the chart gives
  ``gpu-isolator-mps``; a bad name is one usage error) and
  the hidden ``--poll_interval`` (seconds between checks that the
  kubelet's sockets are still there, default 1). Options are spelled
  ``--name=value`` or ``--name value``, dashes or underscores, as
  ``serve`` takes them; every other ``--name=value`` is one of the
  isolator's ``Flags`` (read by ``service_flags``; they override
  ``--flags FILE``).
- ``usage_error(command, message)`` is the command's one-line error
  (``gpu-isolator <command>: error: <message>``, exit 2).
- ``front_door_flags(args, command)`` checks what every front door refuses
  (``--credential`` without ``--listen``, ``--poll_interval`` not above 0,
  a ``--mps_cgroup`` that is no relative cgroup path)
  and returns the isolator's ``Flags``; it sets INFO logging on stderr.
- Nothing here loads gRPC: the CLI builds every parser at start.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["PROG", "front_door_parser", "front_door_flags", "usage_error"]

PROG = "gpu-isolator"


def front_door_parser(sub: Any, command: str, *, help: str, description: str, routes: str,
                      flags_example: str) -> Any:
    """The command's parser with the options every Kubernetes front door takes (see module rules)."""
    parser = sub.add_parser(
        command, allow_abbrev=False, help=help, description=description,
        epilog=f"Any other --name=value option is one of the isolator's flags (Flags field names, e.g."
               f" {flags_example}); they override --flags FILE.",
    )
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help=f"serve /metrics and {routes} here (default: not at all)")
    parser.add_argument("--credential", metavar="FILE",
                        help="the bearer secret the operator's routes need (a root-owned file of mode 0600);"
                             " needs --listen")
    parser.add_argument("--flags", metavar="FILE", help="the isolator's flags as a JSON or TOML file")
    parser.add_argument("--mps_control", "--mps-control", metavar="PATH", default=None,
                        help="the nvidia-cuda-mps-control to run for GPUs shared through MPS (default: the one where"
                             " the driver's binaries are)")
    parser.add_argument("--mps_cgroup", "--mps-cgroup", metavar="NAME", default="none",
                        help="start those daemons in <hierarchy>/NAME of every cgroup hierarchy, out of this"
                             " command's own cgroup, so they and their clients outlive its container (e.g."
                             " gpu-isolator-mps; default: none, this command's own cgroup)")
    parser.add_argument("--poll_interval", "--poll-interval", metavar="SECONDS", type=float, default=1.0,
                        help=argparse.SUPPRESS)
    return parser


def usage_error(command: str, message: str) -> Exception:
    """The command's one-line usage error (see module rules)."""
    from ..cli import UsageError

    return UsageError(f"{PROG} {command}: error: {message}")


def front_door_flags(args: argparse.Namespace, command: str) -> Any:
    """The isolator's ``Flags`` of a front door's command line, once its common options are checked."""
    from ..service import service_flags

    if args.credential and not args.listen:
        raise usage_error(command, "--credential needs --listen HOST:PORT (the operator's route is served there)")
    if not args.poll_interval > 0:
        raise usage_error(command, f"--poll_interval must be > 0, got {args.poll_interval}")
    from actors.mps import NO_CGROUP, MpsError, validate_mps_cgroup

    if args.mps_cgroup != NO_CGROUP:
        try:
            validate_mps_cgroup(args.mps_cgroup)
        except MpsError as error:
            raise usage_error(command, f"--mps_cgroup: {error}") from None
    flags = service_flags(args.flags, getattr(args, "extra", []))
    logging.getLogger().setLevel(logging.INFO)
    return flags
