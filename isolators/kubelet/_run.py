"""``gpu-isolator kubelet-plugin``: the plugin until SIGTERM or SIGINT.

Rules (R-K8-1, R-K8-8):
- ``PluginOptions``: the plugin's own options (``--device_plugin_dir``,
  ``--time_slicing_replicas``, ``--listen``, ``--credential``,
  ``--pass_device_specs``); the isolator's ``Flags`` come from
  ``--flags FILE`` and ``--name=value`` as for ``serve``. The CDI spec dir
  is ``--cdi_spec_dir``, ``/var/run/cdi`` when not given (the plugin
  answers CDI names, so it always writes the node spec).
- ``run_plugin(flags, options)``: the credential is read first (a file it
  must not trust stops the start); then a runtime (listening at
  ``--listen`` for ``/metrics`` and the operator's route), the components
  (inventory, allocator with health and topology, volume: R-NV-1, so no
  NVML and no host file is an ``IsolatorError``), the catalog, the node's
  facts and spec (written before anything is served), the plugin actor,
  and one ``ResourceEndpoint`` per resource. ``ready(summary)`` is called
  once they run. On SIGTERM or SIGINT the endpoints stop (each removes
  its own socket, nothing else), then the actor and the components; it
  returns normally (exit 0).
- No device rule is written and no isolator is started: the container
  runtime applies the CDI spec's device nodes. The one exception is pod
  repair (R-PR-1..5, on unless ``repair_pods=False``): a ``PodRepair``
  over the catalog, the kubelet's PodResources socket
  (``pod_resources_socket``) and the kernel (``KernelPodHost``: the v1
  devices hierarchy and the cgroup2 mount that exist, under
  ``kubepods_root`` or both default roots), passing every
  ``repair_interval`` seconds (the first at start, which also makes the
  ``/dev/char`` links) and on ``POST /kubelet-plugin/repair``; it gives
  back only what a reload took from containers holding this plugin's
  devices.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable

import anyio
import msgspec

from actors.flags import Flags
from runtime import Executor, Runtime, terminate, wait

from ..cdi import NodeFacts, encode_spec, read_node_facts
from ..credential import BearerCredential
from ._names import DEFAULT_DIR
from ._catalog import DeviceCatalog
from ._endpoint import ResourceEndpoint
from ._plugin import NODE_SPEC_FILE, KubeletPluginProcess
from ._pod_cgroups import DEFAULT_CONFIG_TEMPLATES, DEFAULT_KUBEPODS_ROOTS
from ._pod_host import KernelPodHost
from ._pod_repair import PodRepair
from ._pod_resources import DEFAULT_POD_RESOURCES_SOCKET, PodResourcesClient
from ._servicer import DevicePluginServicer

__all__ = ["PluginOptions", "PluginSummary", "run_plugin", "DEFAULT_CDI_SPEC_DIR"]

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def stop_on_signal(signals: Any, removing: str) -> None:
    """Return at the first of ``STOP_SIGNALS`` (an anyio signal receiver), saying so."""
    async for signum in signals:
        logger.info("Stopping on %s: removing %s", signal.Signals(signum).name, removing)
        return
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"


class PluginOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The plugin's own options (see module rules)."""

    device_plugin_dir: str = DEFAULT_DIR
    time_slicing_replicas: int = 1
    listen: str | None = None
    credential: str | None = None
    pass_device_specs: bool = False
    poll_interval: float = 1.0
    """Seconds between checks that the kubelet has not restarted."""
    repair_pods: bool = True
    repair_interval: float = 5.0
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    kubepods_root: str | None = None
    """Relative to each hierarchy's mount; None: ``kubepods.slice`` and ``kubepods``."""
    container_configs: tuple[str, ...] = DEFAULT_CONFIG_TEMPLATES
    """Where the runtime keeps a container's OCI config, ``{id}`` its id."""


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
    from .._components import NvidiaComponents  # the agent's parts, imported once flags were read

    credential = BearerCredential.load(options.credential) if options.credential else None
    spec_dir = flags.cdi_spec_dir or DEFAULT_CDI_SPEC_DIR
    directory = os.path.abspath(options.device_plugin_dir)
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with Runtime(listen=options.listen) as runtime:
            components = await NvidiaComponents.create(flags)
            sockets = Executor(1, name="kubelet-sockets")
            try:
                catalog = DeviceCatalog.build(components.allocator.pools(), components.inventory,
                                              options.time_slicing_replicas)
                facts = await read_node_facts(flags, components.inventory, components.volume)
                spec = encode_spec(facts.spec(components.inventory, flags.dev_dir), "json")
                repair = (await sockets.run(_pod_repair, options, catalog, facts, flags.dev_dir)  # stats the mounts
                          if options.repair_pods else None)
                plugin = await KubeletPluginProcess.create(
                    catalog, components.allocator, facts, spec, spec_dir=spec_dir, dev_dir=flags.dev_dir,
                    pass_device_specs=options.pass_device_specs, credential=credential, repair=repair)
                endpoints = [
                    ResourceEndpoint(directory, offer, plugin.pid,
                                     DevicePluginServicer(offer, plugin.pid, components.allocator), sockets,
                                     poll_s=options.poll_interval)
                    for offer in catalog.offers
                ]
                try:
                    async with anyio.create_task_group() as group:
                        for endpoint in endpoints:
                            group.start_soon(endpoint.run)
                        if repair is not None:
                            group.start_soon(repair.run, options.repair_interval)
                        if ready is not None:
                            ready(PluginSummary(
                                resources={offer.resource: len(offer.devices) for offer in catalog.offers},
                                device_plugin_dir=directory, spec_file=os.path.join(spec_dir, NODE_SPEC_FILE),
                                address=runtime.address if options.listen else None))
                        await stop_on_signal(signals, "this plugin's sockets")
                        group.cancel_scope.cancel()
                finally:
                    terminate(plugin.pid)
                    await wait(plugin.pid)
                    if repair is not None:
                        repair.close()
            finally:
                sockets.shutdown(wait=False)
                await components.close()


def _pod_repair(options: PluginOptions, catalog: DeviceCatalog, facts: NodeFacts, dev_dir: str) -> PodRepair:
    """The pod repair over this node's hierarchies (see module rules)."""
    from actors.devices import default_hierarchy

    hierarchies = []
    v1 = default_hierarchy("cgroups_v1")
    if v1 is not None and os.path.isfile(os.path.join(v1, "devices.list")):
        hierarchies.append((v1, 1))
    v2 = default_hierarchy("cgroups_v2")
    if v2 is not None and os.path.isfile(os.path.join(v2, "cgroup.procs")):
        hierarchies.append((v2, 2))
    roots = (options.kubepods_root.strip("/"),) if options.kubepods_root else DEFAULT_KUBEPODS_ROOTS
    host = KernelPodHost(hierarchies, roots, options.container_configs, dev_dir=dev_dir)
    if hierarchies:
        logger.info("Pod repair every %gs: PodResources at %s, pods' cgroups under %s in %s",
                    options.repair_interval, options.pod_resources_socket, " or ".join(roots),
                    ", ".join(f"{mount} (v{version})" for mount, version in hierarchies))
    else:
        logger.warning("Pod repair finds no cgroup hierarchy to look in (neither a v1 devices hierarchy nor a"
                       " cgroup2 mount under /sys/fs/cgroup): it will check and repair no pod; mount them in the"
                       " plugin's container (/sys/fs/cgroup from the host)")
    return PodRepair(catalog, PodResourcesClient(options.pod_resources_socket), host,
                     control_devices=facts.control_devices, dev_dir=dev_dir, caps=facts.caps)
