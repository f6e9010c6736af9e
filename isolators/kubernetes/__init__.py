"""Kubernetes: three front doors on one node's parts (SPEC sections 18, 20, 21, 23).

The front doors, each a subpackage with its own public surface:
``device_plugin`` (``gpu-isolator kubelet-plugin``: deviceplugin v1beta1),
``pod_repair`` (pods keep their GPUs through systemd reloads; run by the
device plugin today, usable by any front door that hands out these
units) and ``dra`` (``gpu-isolator dra-plugin``: a DRA driver for
resource.k8s.io/v1). What they share lives here, once, the way
kubernetes/dynamic-resource-allocation's ``kubeletplugin`` helper is shared
by every DRA driver:

- ``_catalog``: the node's units by UUID (``node_units``, ``UnitCatalog``:
  the base of every front door's catalog, and what pod repair reads);
- ``_sockets``: unix sockets told apart by the file's identity
  (``GrpcSocket``, ``SocketServer``, ``check_socket_path``,
  ``unix_target``);
- ``_registration``: registration with the kubelet, on ``kubelet.sock``
  (``KubeletRegistration``) and through the plugin watcher
  (``PluginWatcherRegistration``);
- ``_operator``: the operator's HTTP routes and their credential
  (``OperatorRoutes``: ``mark_healthy``);
- ``_run``: the node's parts and the run loop until SIGTERM/SIGINT
  (``node_parts``, ``serve_until_stopped``);
- ``_command``: the commands' shared options and errors; ``add_commands``
  adds ``kubelet-plugin`` and ``dra-plugin`` to the CLI;
- ``_health_watch``: the allocator's health as an async iterator
  (``health_snapshots``: ``NodeWatchResources``);
- ``_ledger_watch``: what a front door may offer, health and the node
  ledger together (``offer_views``: ``ListAndWatch``, the slice) and the
  ledger re-read each pass (``refresh_ledger_every``);
- ``_errors``: ``PluginRequestError`` (a refused request, with its gRPC
  status) and ``PluginSetupError`` (a start that cannot be);
- ``_proto`` / ``_api``: every .proto the kubelet speaks, the committed
  modules generated from them and the one regeneration command
  (``python -m isolators.kubernetes._proto.generate``).

A new front door is a subpackage here that builds its catalog on
``UnitCatalog``, serves on ``GrpcSocket`` / ``SocketServer``, registers
through ``_registration``, mixes in ``OperatorRoutes`` and runs in
``node_parts`` / ``serve_until_stopped``; its command adds itself in
``add_commands``. Rules of each piece are at the top of its module.

Names are imported when first used, so the CLI does not load gRPC for
other commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "._catalog": ("NodeUnit", "UnitCatalog", "node_units"),
    "._command": ("front_door_flags", "front_door_parser", "usage_error"),
    "._errors": ("FAILED_PRECONDITION", "INVALID_ARGUMENT", "PluginRequestError", "PluginSetupError"),
    "._health_watch": ("health_snapshots",),
    "._ledger_watch": ("OfferView", "offer_views", "refresh_ledger_every"),
    "._operator": ("MarkHealthy", "OperatorRoutes"),
    "._registration": ("KubeletRegistration", "PluginWatcherRegistration"),
    "._run": ("DEFAULT_CDI_SPEC_DIR", "STOP_SIGNALS", "NodeParts", "node_parts", "serve_until_stopped",
              "stop_on_signal"),
    "._sockets": ("MAX_SOCKET_PATH", "GrpcSocket", "SocketServer", "check_socket_path", "unix_target"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
__all__ = [*__all__, "add_commands"]


def add_commands(sub: object) -> None:
    """Add ``kubelet-plugin`` and ``dra-plugin`` to the CLI's subparsers (no gRPC is loaded)."""
    from .device_plugin import add_command as add_device_plugin
    from .dra import add_command as add_dra

    add_device_plugin(sub)
    add_dra(sub)


if TYPE_CHECKING:
    from ._catalog import NodeUnit, UnitCatalog, node_units
    from ._command import front_door_flags, front_door_parser, usage_error
    from ._errors import FAILED_PRECONDITION, INVALID_ARGUMENT, PluginRequestError, PluginSetupError
    from ._health_watch import health_snapshots
    from ._ledger_watch import OfferView, offer_views, refresh_ledger_every
    from ._operator import MarkHealthy, OperatorRoutes
    from ._registration import KubeletRegistration, PluginWatcherRegistration
    from ._run import DEFAULT_CDI_SPEC_DIR, STOP_SIGNALS, NodeParts, node_parts, serve_until_stopped, stop_on_signal
    from ._sockets import MAX_SOCKET_PATH, GrpcSocket, SocketServer, check_socket_path, unix_target
