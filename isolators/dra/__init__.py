"""Kubernetes Dynamic Resource Allocation: the node side of resource.k8s.io/v1 (SPEC section 21).

``gpu-isolator dra-plugin`` is a DRA driver built on this project's parts:
it publishes the node's GPUs (and MIG devices) as ResourceSlices, registers
with the kubelet's plugin watcher, and prepares the devices the scheduler
allocated to a ResourceClaim (a CDI spec per claim). The kubelet's gRPC
APIs are the committed modules generated from ``_proto/*.proto``
(``_api``). Rules of each piece are at the top of its module.

Names are imported when first used, so the CLI does not load gRPC or the
Kubernetes client for other commands.
"""

from __future__ import annotations

from runtime._lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
