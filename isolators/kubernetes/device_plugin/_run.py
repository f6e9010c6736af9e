"""``gpu-isolator kubelet-plugin``: the plugin until SIGTERM or SIGINT.

Rules (R-K8-1, R-K8-8):
- ``PluginOptions``: the plugin's own options (``--device_plugin_dir``,
  ``--time_slicing_replicas``, ``--mps_replicas``, ``--mps_control``, ``--listen``, ``--credential``,
  ``--pass_device_specs``), the pass's (``pass_interval``:
  ``--repair_interval``; ``pod_resources_socket``:
  ``--pod_resources_socket``) and pod repair's (``repair``: a
  ``RepairOptions``, None with ``--repair_pods=false``); the isolator's
  ``Flags`` come from ``--flags FILE`` and ``--name=value`` as for
  ``serve``. The CDI spec dir is ``--cdi_spec_dir``, ``/var/run/cdi`` when
  not given (the plugin answers CDI names, so it always writes the node
  spec).
- ``run_plugin(flags, options)``: the credential is read first (a file it
  must not trust stops the start); then the node's parts (``node_parts``:
  runtime at ``--listen``, components), the node ledger joined as
  ``kubelet-plugin:nvidia.com/gpu`` (``PLUGIN_OWNER``, SPEC R-NL-1: on by
  default on the real NVML; another running process of that owner stops
  the start), the catalog, the node's facts and spec (written before
  anything is served), the plugin actor, and one ``resource_endpoint``
  per resource. ``ready(summary)`` is called once they run. On SIGTERM or
  SIGINT the endpoints stop (each removes its own socket, nothing else),
  then the actor and the components (the allocator returns the leases no
  pod holds and releases the owner's lock); it returns normally (exit 0).
- ``--mps_replicas`` N > 1 (SPEC R-MP-4): the front door's MPS daemons
  (``mps_daemons``: under ``--runtime_dir``, ``--mps_control`` the
  program; never stopped by the plugin's stop: running pods keep their
  shares, the next start takes the daemons over), ``PodShares`` and the
  CDI spec of the shares (``mps_spec``), written with the node spec.
- The plugin's pass (``KubeletPluginProcess.run_pass``: one PodResources
  List for the node ledger and pod repair) runs every ``pass_interval``
  seconds, the first at start (which reconciles the ledger: R-NL-3), when
  the ledger is on or pod repair is (with repair, through
  ``PodRepair.run``: a systemd reload starts one at once).
- No device rule is written and no isolator is started: the container
  runtime applies the CDI spec's device nodes. The one exception is pod
  repair (R-PR-1..5, on unless ``repair`` is None): ``node_repair`` over
  the catalog, in every pass (the first at start, which also makes the
  ``/dev/char`` links) and on ``POST /kubelet-plugin/repair``; it gives
  back only what a reload took from containers holding this plugin's
  devices.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import anyio

import msgspec

from actors.flags import Flags
from runtime import dispatch

from ...cdi import encode_spec, read_node_facts
from ...credential import BearerCredential
from .._run import DEFAULT_CDI_SPEC_DIR, mps_daemons, node_parts, serve_until_stopped
from ..pod_repair import DEFAULT_POD_RESOURCES_SOCKET, PodRepair, PodResourcesClient, RepairOptions, node_repair
from ._catalog import DeviceCatalog
from ._endpoint import resource_endpoint
from ._leases import PLUGIN_OWNER, PodLeases
from ._names import ALLOCATE_GRACE_S, DEFAULT_DIR
from ._plugin import NODE_SPEC_FILE, KubeletPluginProcess
from ._servicer import DevicePluginServicer
from ._shares import PodShares, mps_spec

__all__ = ["PluginOptions", "PluginSummary", "run_plugin"]

logger = logging.getLogger(__name__)


class PluginOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The plugin's own options (see module rules)."""

    device_plugin_dir: str = DEFAULT_DIR
    time_slicing_replicas: int = 1
    mps_replicas: int = 1
    """``--mps_replicas``: MPS shares per GPU (1: no MPS; SPEC R-MP-4)."""
    mps_control: str | None = None
    """``--mps_control``: the control daemon to run for shared units (None: where the driver's binaries are)."""
    mps_cgroup: str = "none"
    """``--mps_cgroup``: where the daemons are started (``none``: the front door's own cgroup)."""
    listen: str | None = None
    credential: str | None = None
    pass_device_specs: bool = False
    poll_interval: float = 1.0
    """Seconds between checks that the kubelet has not restarted."""
    repair: RepairOptions | None = RepairOptions()
    """Pod repair's options; None: ``--repair_pods=false``."""
    pass_interval: float = 5.0
    """Seconds between the plugin's passes (``--repair_interval``)."""
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    allocate_grace: float = ALLOCATE_GRACE_S
    """Seconds an Allocate waits for PodResources to name its IDs before its units go back."""


class PluginSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the plugin offers, once it runs (for the command's first line)."""

    resources: dict[str, int]
    """Resource name -> device IDs offered."""
    device_plugin_dir: str
    spec_file: str
    address: str | None = None


async def run_plugin(flags: Flags, options: PluginOptions,
                     ready: Callable[[PluginSummary], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT (see module rules)."""
    credential = BearerCredential.load(options.credential) if options.credential else None
    spec_dir = flags.cdi_spec_dir or DEFAULT_CDI_SPEC_DIR
    directory = os.path.abspath(options.device_plugin_dir)
    async with node_parts(flags, options.listen, "kubelet") as parts:
        components = parts.components
        ledger = await components.join_ledger(PLUGIN_OWNER)
        catalog = DeviceCatalog.build(components.allocator.pools(), components.inventory,
                                      options.time_slicing_replicas, options.mps_replicas)
        facts = await read_node_facts(flags, components.inventory, components.volume)
        spec = encode_spec(facts.spec(components.inventory, flags.dev_dir), "json")
        lister = PodResourcesClient(options.pod_resources_socket)
        repair = (await parts.sockets.run(node_repair, options.repair, catalog, facts, flags.dev_dir, lister)
                  if options.repair is not None else None)  # stats mounts
        leases = PodLeases(catalog, components.allocator, grace_s=options.allocate_grace) if ledger else None
        shares = mps = None
        if options.mps_replicas > 1:  # SPEC R-MP-4: the front door's MPS daemons, one per shared unit
            mps = mps_daemons(components.nvml, flags.runtime_dir, options.mps_control, options.mps_cgroup)
            shares = PodShares(catalog, mps, grace_s=options.allocate_grace,
                               allocator=components.allocator if ledger else None)
        try:
            plugin = await KubeletPluginProcess.create(
                catalog, components.allocator, facts, spec, spec_dir=spec_dir, dev_dir=flags.dev_dir,
                pass_device_specs=options.pass_device_specs, credential=credential, repair=repair,
                leases=leases, lister=lister, shares=shares,
                mps_spec=mps_spec(catalog, mps) if mps is not None else None)
            endpoints = [
                resource_endpoint(directory, offer, plugin.pid,
                                  DevicePluginServicer(offer, plugin.pid, components.allocator), parts.sockets,
                                  poll_s=options.poll_interval)
                for offer in catalog.offers
            ]
            tasks = [endpoint.run for endpoint in endpoints]
            if plugin.has_pass:
                tasks.append(lambda: _passes(plugin, repair, options.pass_interval))

            def summary() -> None:
                if ready is not None:
                    ready(PluginSummary(
                        resources={offer.resource: len(offer.devices) for offer in catalog.offers},
                        device_plugin_dir=directory, spec_file=os.path.join(spec_dir, NODE_SPEC_FILE),
                        address=parts.runtime.address if options.listen else None))

            await serve_until_stopped(parts, plugin.pid, tasks=tasks, ready=summary,
                                      removing="this plugin's sockets")
        finally:
            if repair is not None:
                repair.close()
            else:
                lister.close()


async def _passes(plugin: KubeletPluginProcess, repair: PodRepair | None, interval_s: float) -> None:
    """The plugin's passes until cancelled: through pod repair's loop when it runs (see module rules)."""
    one_pass = functools.partial(dispatch, plugin.pid, KubeletPluginProcess.run_pass)
    if repair is not None:
        await repair.run(interval_s, one_pass=one_pass)
        return
    while True:
        try:
            await one_pass()
        except Exception:  # noqa: BLE001 - a failed pass never takes the plugin down; the next one tries again
            logger.exception("The plugin's pass failed; trying again in %gs", interval_s)
        await anyio.sleep(interval_s)
