"""Kubernetes Dynamic Resource Allocation: the node side of resource.k8s.io/v1 (SPEC section 21).

``gpu-isolator dra-plugin`` is a DRA driver built on this project's parts:
it publishes the node's GPUs (and MIG devices) as a ResourceSlice
(``DraCatalog`` what, ``render_slice`` / ``SlicePublisher`` how), registers
with the kubelet's plugin watcher, and prepares the devices the scheduler
allocated to a ResourceClaim (``plan_claim`` checks it, ``PreparedClaims``
never grants a device twice and is checkpointed (a format version; an
unreadable checkpoint is rebuilt from the API server's claims:
``claims_of_node``), ``render_claim_spec``
writes a CDI spec per claim); ``DraPluginProcess`` is the actor that
decides, ``_servicer`` the gRPC translation, ``run_dra_plugin`` the
command. The kubelet's gRPC APIs are the committed modules generated from
``isolators/kubernetes/_proto``; sockets, registration with the plugin
watcher, the operator's routes and the run loop are the Kubernetes home's
shared parts; the Kubernetes client is lightkube's (``kube_client``).
Rules of each piece are at the top of its module.

Names are imported when first used, so the CLI does not load gRPC or the
Kubernetes client for other commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "._names": ("DEFAULT_DRIVER_NAME", "DEFAULT_PLUGINS_DIR", "DEFAULT_REGISTRY_DIR", "PLUGIN_TYPE",
                "SUPPORTED_VERSIONS", "check_driver_name", "check_node_name", "dra_socket", "registration_socket"),
    "._claims": ("ClaimPlan", "ClaimRef", "ClaimRefused", "PlannedDevice", "check_uid", "plan_claim"),
    "._claim_spec": ("claim_device_id", "claim_kind", "claim_spec_file", "render_claim_spec"),
    "._command": ("add_command",),
    "._devices": ("DeviceFacts", "DraCatalog", "nvlink_islands", "product_family", "semver"),
    "._kube": ("DraSetupError", "api_failure", "kube_client"),
    "._plugin": ("ClaimAnswer", "DRA_PLUGIN_ID", "DraPluginProcess"),
    "._prepared": ("CHECKPOINT_VERSION", "CheckpointError", "PreparedClaim", "PreparedClaims", "PreparedDevice",
                   "checkpoint_path", "prepared_claim", "read_checkpoint", "write_checkpoint"),
    "._rebuild": ("RebuildError", "Rebuilt", "claims_of_node"),
    "._run": ("DraOptions", "DraSummary", "run_dra_plugin"),
    "._sharing": ("SHARING_MODES", "ShareLimits", "ShareRefused", "capacity_of", "over_capacity", "share_limits"),
    "._slices": ("SlicePublishError", "SlicePublisher", "keep_published", "render_slice", "slice_name"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._claim_spec import claim_device_id, claim_kind, claim_spec_file, render_claim_spec
    from ._claims import ClaimPlan, ClaimRef, ClaimRefused, PlannedDevice, check_uid, plan_claim
    from ._command import add_command
    from ._devices import DeviceFacts, DraCatalog, nvlink_islands, product_family, semver
    from ._kube import DraSetupError, api_failure, kube_client
    from ._names import (DEFAULT_DRIVER_NAME, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, PLUGIN_TYPE,
                         SUPPORTED_VERSIONS, check_driver_name, check_node_name, dra_socket, registration_socket)
    from ._plugin import DRA_PLUGIN_ID, ClaimAnswer, DraPluginProcess
    from ._prepared import CHECKPOINT_VERSION, CheckpointError, PreparedClaim, PreparedClaims, PreparedDevice
    from ._prepared import checkpoint_path, prepared_claim, read_checkpoint, write_checkpoint
    from ._rebuild import RebuildError, Rebuilt, claims_of_node
    from ._run import DraOptions, DraSummary, run_dra_plugin
    from ._sharing import SHARING_MODES, ShareLimits, ShareRefused, capacity_of, over_capacity, share_limits
    from ._slices import SlicePublishError, SlicePublisher, keep_published, render_slice, slice_name
