"""``gpu-isolator dra-plugin``: the DRA driver until SIGTERM or SIGINT.

Rules (issue 37; SPEC section 21):
- ``DraOptions``: the driver's own options; the isolator's ``Flags`` come
  from ``--flags FILE`` and ``--name=value`` as for ``kubelet-plugin``. The
  CDI spec dir is ``--cdi_spec_dir``, ``/var/run/cdi`` when not given.
- ``run_dra_plugin(flags, options)``: the credential and the kubeconfig
  are read first (either one bad stops the start: ``DraSetupError``, exit
  2, nothing served); then a runtime (``--listen``: ``/metrics`` and the
  operator's route), the components (inventory, allocator with health,
  volume: no NVML and no host file is an ``IsolatorError``), the node
  ledger joined as ``dra-plugin:<driver>`` (SPEC R-NL-1: on by default on
  the real NVML; another running process of that owner stops the start),
  the catalog (with ``--sharing=mps`` its units published for MPS
  shares, and the front door's MPS daemons, ``mps_daemons``: one per
  shared unit under ``--runtime_dir``, ``--mps_control`` the program),
  the node's CDI facts, the process (checkpoint read,
  claims' specs restored, their units held again in the ledger and the
  rest of the last run's returned: R-NL-3), then the DRA socket (``<plugins_dir>/<driver>/dra.sock``:
  DRAPlugin v1 and v1beta1, DRAResourceHealth v1 and v1alpha1) and only then the
  registration socket (``<registry>/<driver>-reg.sock``), so the plugin
  watcher never finds a driver it cannot dial. The ResourceSlice is
  published at once and kept current (``keep_published``): a restarted
  driver republishes before the kubelet's 30 s grace ends, and a slice a
  restarted kubelet (or anyone else) deleted or changed is put back; a
  unit another front door takes in the node ledger leaves the slice, and
  comes back once returned, within one ``--poll_interval`` (the ledger is
  read again each interval: ``refresh_ledger_every``). ``ready`` is
  called once both sockets listen.
- Sockets, registration and the run loop are the shared ones
  (``SocketServer``, ``PluginWatcherRegistration``, ``node_parts`` /
  ``serve_until_stopped``).
- On SIGTERM or SIGINT: the sockets stop (each removes only its own file),
  then the process and the components; the MPS daemons keep running (the
  pods of prepared claims use them; the next start takes them over); the
  slice stays (a restarted
  driver takes it over); it returns normally (exit 0).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import msgspec

from actors.flags import Flags

from ...cdi import read_node_facts
from ...credential import BearerCredential
from .._run import DEFAULT_CDI_SPEC_DIR, mps_daemons, node_parts, serve_until_stopped
from ._names import DEFAULT_DRIVER_NAME, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, dra_socket, registration_socket

__all__ = ["DraOptions", "DraSummary", "run_dra_plugin"]

logger = logging.getLogger(__name__)


class DraOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The driver's own options (see module rules)."""

    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    plugins_registry_dir: str = DEFAULT_REGISTRY_DIR
    plugins_dir: str = DEFAULT_PLUGINS_DIR
    kubeconfig: str | None = None
    listen: str | None = None
    credential: str | None = None
    api_timeout_s: float = 10.0
    poll_interval: float = 1.0
    """Seconds between checks that the sockets are still there."""
    sharing: str = "none"
    """``--sharing``: ``none`` or ``mps`` (SPEC R-MP-5)."""
    mps_replicas: int = 1
    """``--mps_replicas``: equal MPS shares per unit (1: any size a claim asks)."""
    mps_control: str | None = None
    """``--mps_control``: the control daemon to run for shared units (None: where the driver's binaries are)."""
    mps_cgroup: str = "none"
    """``--mps_cgroup``: where the daemons are started (``none``: the front door's own cgroup)."""


class DraSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the driver serves, once it runs (for the command's first line)."""

    driver: str
    node: str
    devices: list[str]
    registration_socket: str
    dra_socket: str
    address: str | None = None


async def run_dra_plugin(flags: Flags, options: DraOptions, ready: Callable[[DraSummary], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT (see module rules)."""
    from runtime import dispatch

    from actors.ledger import dra_plugin_owner

    from .._api import DRA_VERSIONS, HEALTH_VERSIONS, registration_rpc
    from .._ledger_watch import refresh_ledger_every
    from .._registration import PluginWatcherRegistration
    from .._sockets import SocketServer, check_socket_path
    from ._devices import DraCatalog
    from ._kube import kube_client
    from ._names import PLUGIN_TYPE, SUPPORTED_VERSIONS
    from ._plugin import DraPluginProcess
    from ._prepared import checkpoint_path
    from ._servicer import dra_servicer, health_servicer
    from ._slices import SlicePublisher, keep_published

    credential = BearerCredential.load(options.credential) if options.credential else None
    client = kube_client(options.kubeconfig, options.api_timeout_s)
    driver, node = options.driver_name, options.node_name
    spec_dir = flags.cdi_spec_dir or DEFAULT_CDI_SPEC_DIR
    dra_path = check_socket_path(dra_socket(options.plugins_dir, driver), "--plugins_dir")
    reg_path = check_socket_path(registration_socket(options.plugins_registry_dir, driver), "--plugins_registry_dir")
    try:
        async with node_parts(flags, options.listen, "dra") as parts:
            components = parts.components
            ledger = await components.join_ledger(dra_plugin_owner(driver))
            catalog = DraCatalog.build(components.allocator.pools(), components.inventory, options.sharing,
                                       options.mps_replicas)
            facts = await read_node_facts(flags, components.inventory, components.volume)
            mps = mps_daemons(components.nvml, flags.runtime_dir, options.mps_control, options.mps_cgroup) \
                if options.sharing == "mps" else None
            plugin = await DraPluginProcess.create(
                catalog, components.allocator, facts, client, driver=driver, node=node, spec_dir=spec_dir,
                dev_dir=flags.dev_dir, checkpoint=checkpoint_path(flags.work_dir, driver), credential=credential,
                ledger=ledger is not None, mps=mps)

            def add_dra(server: object) -> None:
                for version, (_, rpc) in DRA_VERSIONS.items():
                    rpc.add_DRAPluginServicer_to_server(dra_servicer(version, plugin.pid), server)
                for version, (_, rpc) in HEALTH_VERSIONS.items():
                    rpc.add_DRAResourceHealthServicer_to_server(
                        health_servicer(version, catalog, node, components.allocator), server)

            def add_registration(server: object) -> None:
                registration_rpc.add_RegistrationServicer_to_server(PluginWatcherRegistration(
                    PLUGIN_TYPE, driver, dra_path, SUPPORTED_VERSIONS,
                    functools.partial(dispatch, plugin.pid, DraPluginProcess.registered), what=f"driver {driver}",
                ), server)

            dra = SocketServer(dra_path, f"DRA driver {driver}", add_dra, parts.sockets, poll_s=options.poll_interval)
            reg = SocketServer(reg_path, f"registration of {driver}", add_registration, parts.sockets,
                               poll_s=options.poll_interval)
            publisher = SlicePublisher(client, catalog, driver=driver, node=node,
                                       shares=plugin.live if mps is not None else None)

            def summary() -> None:
                if ready is not None:
                    ready(DraSummary(driver=driver, node=node, devices=[d.name for d in catalog.devices],
                                     registration_socket=reg_path, dra_socket=dra_path,
                                     address=parts.runtime.address if options.listen else None))

            await serve_until_stopped(parts, plugin.pid, started=[dra.run, reg.run],
                                      tasks=[functools.partial(keep_published, publisher, components.allocator),
                                             functools.partial(refresh_ledger_every, components.allocator,
                                                               options.poll_interval)],
                                      ready=summary, removing="this driver's sockets")
    finally:
        await client.close()
