"""The ``dra-plugin`` command of the ``gpu-isolator`` CLI.

Rules (issue 37 item 1; SPEC section 21):
- ``add_command(sub)`` adds the subcommand: the driver's own options
  (``--driver_name`` default ``gpu.isolator.dev``, ``--plugins_registry_dir``,
  ``--plugins_dir``, ``--node_name`` default ``$NODE_NAME``,
  ``--kubeconfig`` default in-cluster, ``--listen``, ``--credential``,
  ``--flags FILE``) and, as extra options, every ``Flags`` field
  (``--host_file=``, ``--dev_dir=``, ``--cdi_spec_dir=``, ``--work_dir=`` ...),
  spelled ``--name=value`` as ``kubelet-plugin`` takes them.
- ``--mps_replicas N`` (with ``--sharing=mps``; default 1): every
  shareable unit is N equal shares (``_sharing``); below 1, or above 1
  without ``--sharing=mps``, is a usage error.
- ``--sharing=none|mps`` (SPEC R-MP-5, R-MP-8; default ``none``): with
  ``mps`` every unit is published for MPS shares with consumable capacity
  (``_sharing``); ``--mps_control=PATH`` (every front door's) names the
  control daemon.
- Bad options exit 2 with one line: no node name, an unknown ``--sharing``, a bad ``--mps_replicas``,
  an invalid driver name,
  ``--credential`` without ``--listen``, a kubeconfig that cannot be used.
  It logs at INFO on stderr and prints one line on stdout once it serves:
  the driver, node, devices, sockets, and ``/metrics`` with ``--listen``;
  exit 0 after SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from .._command import PROG, front_door_flags, front_door_parser, usage_error

__all__ = ["add_command"]


def add_command(sub: Any) -> None:
    from ._names import DEFAULT_DRIVER_NAME, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

    plugin = front_door_parser(
        sub, "dra-plugin",
        help="be this node's Kubernetes DRA driver (resource.k8s.io/v1 ResourceSlices and claims)",
        description="Publish this node's GPUs (and MIG devices) as a ResourceSlice, register with the kubelet's"
                    " plugin watcher and prepare the devices allocated to ResourceClaims (a CDI spec per claim in"
                    " --cdi_spec_dir, default /var/run/cdi). Unhealthy devices are tainted on the slice and shown"
                    " in DRAResourceHealth; a recovered one (mark_healthy) loses its taint.",
        routes="POST /dra-plugin/mark_healthy",
        flags_example="--host_file=node.toml --dev_dir=/dev --work_dir=/var/lib/gpu-isolator",
    )
    plugin.add_argument("--driver_name", "--driver-name", metavar="NAME", default=DEFAULT_DRIVER_NAME,
                        help=f"the DRA driver's name, a DNS subdomain (default {DEFAULT_DRIVER_NAME})")
    plugin.add_argument("--plugins_registry_dir", "--plugins-registry-dir", metavar="DIR",
                        default=DEFAULT_REGISTRY_DIR,
                        help=f"the kubelet's plugin watcher directory (default {DEFAULT_REGISTRY_DIR})")
    plugin.add_argument("--plugins_dir", "--plugins-dir", metavar="DIR", default=DEFAULT_PLUGINS_DIR,
                        help=f"where the DRA socket <DIR>/<driver>/dra.sock goes (default {DEFAULT_PLUGINS_DIR})")
    plugin.add_argument("--node_name", "--node-name", metavar="NAME", default=None,
                        help="this node's name, the ResourceSlice pool's (default $NODE_NAME)")
    plugin.add_argument("--kubeconfig", metavar="FILE", default=None,
                        help="the API server's kubeconfig (default: the pod's service account, in-cluster)")
    plugin.add_argument("--sharing", metavar="MODE", default="none",
                        help="none (default: every GPU is one device, allocated whole) or mps: every GPU is published"
                             " for shares with consumable capacity memory (bytes) and compute (percent of its"
                             " threads), each share limited through the GPU's MPS control daemon")
    plugin.add_argument("--mps_replicas", "--mps-replicas", metavar="N", type=int, default=1,
                        help="with --sharing=mps: every GPU is N equal shares (1/N of its memory, 100/N %% of its"
                             " threads), so claims scheduled at once never ask one GPU for different limits (default"
                             " 1: any size a claim asks, in steps of 256Mi)")
    plugin.add_argument("--api_timeout", "--api-timeout", metavar="SECONDS", type=float, default=10.0,
                        help="the bound of every API server request (default 10)")
    plugin.set_defaults(func=_cmd_dra_plugin, accepts_flags=True)


def _usage(message: str) -> Exception:
    return usage_error("dra-plugin", message)


def _cmd_dra_plugin(args: argparse.Namespace) -> int:
    from ._names import check_driver_name, check_node_name
    from ._run import DraOptions, DraSummary, run_dra_plugin

    node = args.node_name or os.environ.get("NODE_NAME")
    if not node:
        raise _usage("no node name: pass --node_name=NAME or set NODE_NAME (the DaemonSet sets it from"
                     " spec.nodeName)")
    try:
        check_node_name(node)
    except ValueError as error:
        raise _usage(f"--node_name: {error}") from None
    try:
        check_driver_name(args.driver_name)
    except ValueError as error:
        raise _usage(f"--driver_name: {error}") from None
    from ._sharing import SHARING_MODES

    if args.sharing not in SHARING_MODES:
        raise _usage(f"--sharing takes {' or '.join(SHARING_MODES)}, got {args.sharing!r}")
    if args.mps_replicas < 1:
        raise _usage(f"--mps_replicas must be a whole number >= 2 (1, the default, lets each claim ask its own"
                     f" size), got {args.mps_replicas}")
    if args.mps_replicas > 1 and args.sharing != "mps":
        raise _usage(f"--mps_replicas {args.mps_replicas} needs --sharing=mps (it cuts every GPU into MPS shares)")
    if not args.api_timeout > 0:
        raise _usage(f"--api_timeout must be > 0, got {args.api_timeout}")
    flags = front_door_flags(args, "dra-plugin")
    options = DraOptions(node_name=node, driver_name=args.driver_name, plugins_registry_dir=args.plugins_registry_dir,
                         plugins_dir=args.plugins_dir, kubeconfig=args.kubeconfig, listen=args.listen,
                         credential=args.credential, api_timeout_s=args.api_timeout, poll_interval=args.poll_interval,
                         sharing=args.sharing, mps_replicas=args.mps_replicas, mps_control=args.mps_control,
                         mps_cgroup=args.mps_cgroup)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per API request otherwise

    def ready(summary: DraSummary) -> None:
        where = f"; metrics at http://{summary.address}/metrics" if summary.address else ""
        print(f"{PROG} dra-plugin: driver {summary.driver} on node {summary.node} serving"
              f" {len(summary.devices)} devices ({', '.join(summary.devices)}); registration"
              f" {summary.registration_socket}, DRA {summary.dra_socket}{where}", flush=True)

    asyncio.run(run_dra_plugin(flags, options, ready=ready))
    return 0
