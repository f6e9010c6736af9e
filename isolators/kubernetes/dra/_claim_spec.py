"""A claim's CDI spec: the devices prepared for one ResourceClaim, in the engines' language.

Rules (SPEC sections 13 and 21):
- One spec per claim, kind ``<driver>/claim`` (e.g. ``gpu.isolator.dev/claim``),
  file ``<driver>-claim_<uid>.json`` in ``--cdi_spec_dir`` (CDI's transient
  spec naming); only files with the prefix ``<driver>-claim_`` are ever
  written or removed there, so other specs are never touched.
- One CDI device per prepared device, named ``<uid>-<device name>``
  (``<uid>-gpu-3``), holding that device's nodes: ``/dev/nvidia<minor>``,
  and for a MIG device its parent's node and its two capability nodes;
  its CDI id (``claim_device_id``) is what the kubelet hands the runtime
  (``cdi_device_ids``).
- The spec's shared edits (applied once whichever of its devices a
  container gets) hold the control devices, the driver volume
  (``NodeFacts.injection``: its mount, its binaries at ``/usr/bin``, the
  hook that updates the container's loader cache; no PATH or
  LD_LIBRARY_PATH, R-DR-2), and ``NVIDIA_VISIBLE_DEVICES=void`` (R-DR-3). A
  container of a claim may get only some of its devices (those of its own
  requests): engines merge CDI ``env`` by key, the last device's value
  winning, so no per-device value can list a container's devices when it
  has more than one, and a claim-wide list would name devices the
  container was not given -- which a node whose runtime is NVIDIA's
  (legacy mode injects every GPU ``NVIDIA_VISIBLE_DEVICES`` names) would
  then hand it. ``void`` is NVIDIA's own value for "the devices come
  from CDI, inject none"; the container sees its devices by their nodes.
- An MPS share (``mps``: device name -> the unit daemon's pipe and
  shared-memory directories, SPEC R-MP-3) adds to that device's edits the
  pipe directory at ``/tmp/nvidia-mps`` with ``CUDA_MPS_PIPE_DIRECTORY``
  and the unit's ``/dev/shm`` (``isolators.cdi.mps_edits``).
- ``cdiVersion`` is the lowest its fields need (a uid may start with a
  digit: 0.5.0). Pure: no I/O (``isolators.cdi`` writes the file).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from actors.mig import Unit

from ...cdi import CdiContainerEdits, CdiDevice, CdiSpec, NodeFacts, container_grant, control_device
from ...cdi import VISIBLE_DEVICES, device_node, encode_spec, mps_edits, required_version, validate_spec

__all__ = ["VISIBLE_NONE_FROM_CDI", "claim_kind", "claim_spec_prefix", "claim_spec_file", "claim_device_id", "render_claim_spec"]

VISIBLE_NONE_FROM_CDI = "void"
"""``NVIDIA_VISIBLE_DEVICES`` of every claim container (see module rules)."""


def claim_kind(driver: str) -> str:
    return f"{driver}/claim"


def claim_spec_prefix(driver: str) -> str:
    return f"{driver}-claim_"


def claim_spec_file(driver: str, uid: str) -> str:
    return f"{claim_spec_prefix(driver)}{uid}.json"


def claim_device_id(driver: str, uid: str, device: str) -> str:
    """``<driver>/claim=<uid>-<device>``."""
    return f"{claim_kind(driver)}={uid}-{device}"


def render_claim_spec(driver: str, uid: str, devices: Iterable[tuple[str, Unit]], uuids: dict[Unit, str],
                      facts: NodeFacts, dev_dir: str, mps: Mapping[str, tuple[str, str]] | None = None) -> bytes:
    """The claim's spec as JSON bytes (``devices``: (device name, unit) pairs; see module rules)."""
    devices = list(devices)
    cdi_devices = []
    for name, unit in devices:
        grant = container_grant([unit], uuids, {}, dev_dir, caps=facts.caps)
        edits = CdiContainerEdits(device_nodes=[device_node(node) for node in grant.devices])
        if mps and name in mps:
            share = mps_edits(*mps[name])
            edits = msgspec.structs.replace(edits, env=share.env, mounts=share.mounts)
        cdi_devices.append(CdiDevice(name=f"{uid}-{name}", container_edits=edits))
    volume_edits = facts.injection.edits([facts.volume] if facts.volume is not None else [])
    shared = CdiContainerEdits(
        env=[f"{VISIBLE_DEVICES}={VISIBLE_NONE_FROM_CDI}"],
        device_nodes=[device_node(control_device(path, rule)) for path, rule in facts.control_devices.items()],
        mounts=volume_edits.mounts,
        hooks=volume_edits.hooks,
    )
    spec = CdiSpec(cdi_version="0.3.0", kind=claim_kind(driver), devices=cdi_devices, container_edits=shared)
    spec = validate_spec(msgspec.structs.replace(spec, cdi_version=required_version(spec)))
    return encode_spec(spec, "json")
