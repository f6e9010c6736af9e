"""The ``kubelet-plugin`` command of the ``gpu-isolator`` CLI.

Rules (R-K8-1):
- ``add_command(sub)`` adds the subcommand; options are spelled
  ``--name=value`` (or ``--name value``) as ``serve`` takes them, dashes or
  underscores: the plugin's own (``--device_plugin_dir``,
  ``--time_slicing_replicas``, ``--mps_replicas`` (SPEC R-MP-4, R-MP-8),
  ``--mps_control``, ``--listen``, ``--credential``,
  ``--pass_device_specs``, ``--flags FILE``) and, as extra options, every
  ``Flags`` field (``--host_file=``, ``--dev_dir=``, ``--cdi_spec_dir=``,
  ``--nvidia_mig_strategy=`` ...), read by ``service_flags``.
- Pod repair (R-PR-1): ``--repair_pods`` (on; ``--repair_pods=false``
  turns it off), ``--repair_interval=S`` (5: the plugin's pass, whose one
  PodResources List serves pod repair and the node ledger),
  ``--pod_resources_socket=PATH``, ``--kubepods_root=PATH``,
  ``--container_config=TEMPLATE`` (repeatable: where the runtime keeps a
  container's OCI config, ``{id}`` its id). The hidden
  ``--allocate_grace=S`` (10) is how long an Allocate's units wait for
  PodResources to name them before they go back (tests shorten it).
- Bad options exit 2 with one line (``--credential`` without ``--listen``,
  replicas below 1, ``--mps_replicas`` below 1 or with time-slicing
  (``check_sharing``'s words), an interval not above 0, a template without ``{id}``,
  an unknown flag). It logs at INFO on stderr and prints
  one line on stdout once it runs: what it offers, where, and the address
  of ``/metrics`` with ``--listen``; it exits 0 after SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .._command import PROG, front_door_flags, front_door_parser, usage_error

__all__ = ["add_command"]


def add_command(sub: Any) -> None:
    from ..pod_repair import DEFAULT_POD_RESOURCES_SOCKET
    from ._names import ALLOCATE_GRACE_S, DEFAULT_DIR

    plugin = front_door_parser(
        sub, "kubelet-plugin",
        help="offer this node's GPUs to the Kubernetes kubelet (device plugin v1beta1)",
        description="Serve the kubelet's device plugin API (v1beta1, gRPC) on a socket in the device plugin"
                    " directory and register with kubelet.sock: nvidia.com/gpu (and nvidia.com/mig-<profile> under"
                    " --nvidia_mig_strategy=mixed) with NVML health that recovers (mark_healthy), topology-aware"
                    " preferred allocation, and CDI device names in Allocate (the node spec it writes to"
                    " --cdi_spec_dir, default /var/run/cdi). It re-registers when the kubelet restarts and stops on"
                    " SIGTERM, removing only its own sockets.",
        routes="POST /kubelet-plugin/mark_healthy and /kubelet-plugin/repair",
        flags_example="--host_file=node.toml --dev_dir=/dev --nvidia_mig_strategy=mixed",
    )
    plugin.add_argument("--device_plugin_dir", "--device-plugin-dir", metavar="DIR", default=DEFAULT_DIR,
                        help=f"the kubelet's device plugin directory (default {DEFAULT_DIR})")
    plugin.add_argument("--time_slicing_replicas", "--time-slicing-replicas", metavar="N", type=int, default=1,
                        help="offer each GPU as N device IDs <UUID>::<i> (time-slicing; default 1)")
    plugin.add_argument("--mps_replicas", "--mps-replicas", metavar="N", type=int, default=1,
                        help="offer each GPU as N >= 2 MPS shares <UUID>::<i>, each limited to 1/N of its memory and"
                             " 100/N %% of its threads through the GPU's MPS control daemon (default 1: no MPS; not"
                             " with --time_slicing_replicas)")
    plugin.add_argument("--pass_device_specs", "--pass-device-specs", action="store_true",
                        help="also answer Allocate with device specs (/dev/nvidia<minor> and the control devices)")
    plugin.add_argument("--repair_pods", "--repair-pods", metavar="BOOL", nargs="?", const="true", default="true",
                        help="give running pods back the GPU access a systemd daemon-reload took (default true;"
                             " --repair_pods=false turns it off)")
    plugin.add_argument("--repair_interval", "--repair-interval", metavar="SECONDS", type=float, default=5.0,
                        help="seconds between the plugin's passes: one PodResources List each, for pod repair and"
                             " for returning to the node ledger the GPUs no pod holds any more (default 5)")
    plugin.add_argument("--allocate_grace", "--allocate-grace", metavar="SECONDS", type=float,
                        default=ALLOCATE_GRACE_S, help=argparse.SUPPRESS)
    plugin.add_argument("--pod_resources_socket", "--pod-resources-socket", metavar="PATH",
                        default=DEFAULT_POD_RESOURCES_SOCKET,
                        help=f"the kubelet's PodResources socket (default {DEFAULT_POD_RESOURCES_SOCKET})")
    plugin.add_argument("--kubepods_root", "--kubepods-root", metavar="PATH",
                        help="the cgroup pods live under, relative to each hierarchy's mount (default: kubepods.slice"
                             " for the systemd driver and kubepods for cgroupfs, both tried)")
    plugin.add_argument("--container_config", "--container-config", metavar="TEMPLATE", action="append",
                        help="where the container runtime keeps a container's OCI config, {id} its id (repeatable;"
                             " default: containerd's and CRI-O's places)")
    plugin.set_defaults(func=_cmd_kubelet_plugin, accepts_flags=True)


def _usage(message: str) -> Exception:
    return usage_error("kubelet-plugin", message)


def _cmd_kubelet_plugin(args: argparse.Namespace) -> int:
    from ..pod_repair import DEFAULT_CONFIG_TEMPLATES, RepairOptions
    from ._run import PluginOptions, PluginSummary, run_plugin

    from ._catalog import check_sharing

    refused = check_sharing(args.time_slicing_replicas, args.mps_replicas)
    if refused is not None:
        raise _usage(refused)
    repair_pods = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
        str(args.repair_pods).lower())
    if repair_pods is None:
        raise _usage(f"--repair_pods takes true or false, got {args.repair_pods!r}")
    if not args.repair_interval > 0:
        raise _usage(f"--repair_interval must be > 0 seconds, got {args.repair_interval}")
    templates = tuple(args.container_config or DEFAULT_CONFIG_TEMPLATES)
    for template in templates:
        if "{id}" not in template:
            raise _usage(f"--container_config {template!r} must name the container id as {{id}}")
    flags = front_door_flags(args, "kubelet-plugin")
    options = PluginOptions(device_plugin_dir=args.device_plugin_dir, time_slicing_replicas=args.time_slicing_replicas,
                            mps_replicas=args.mps_replicas, mps_control=args.mps_control,
                            mps_cgroup=args.mps_cgroup,
                            listen=args.listen, credential=args.credential,
                            pass_device_specs=args.pass_device_specs, poll_interval=args.poll_interval,
                            pass_interval=args.repair_interval, pod_resources_socket=args.pod_resources_socket,
                            allocate_grace=args.allocate_grace,
                            repair=RepairOptions(interval_s=args.repair_interval,
                                                 pod_resources_socket=args.pod_resources_socket,
                                                 kubepods_root=args.kubepods_root, container_configs=templates)
                            if repair_pods else None)

    def ready(summary: PluginSummary) -> None:
        offered = ", ".join(f"{name} ({count} devices)" for name, count in summary.resources.items())
        where = f"; metrics at http://{summary.address}/metrics" if summary.address else ""
        print(f"{PROG} kubelet-plugin: offering {offered} in {summary.device_plugin_dir};"
              f" CDI node spec {summary.spec_file}{where}", flush=True)

    asyncio.run(run_plugin(flags, options, ready=ready))
    return 0
