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
  container gets) hold the control devices, the driver volume's bind mount
  and environment, and ``NVIDIA_VISIBLE_DEVICES`` = the claim's UUIDs.
- ``cdiVersion`` is the lowest its fields need (a uid may start with a
  digit: 0.5.0). Pure: no I/O (``isolators.cdi`` writes the file).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from actors.mig import Unit

from ...cdi import CdiContainerEdits, CdiDevice, CdiSpec, NodeFacts, bind_mount, container_grant, control_device
from ...cdi import device_node, encode_spec, required_version, validate_spec

__all__ = ["claim_kind", "claim_spec_prefix", "claim_spec_file", "claim_device_id", "render_claim_spec"]


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
                      facts: NodeFacts, dev_dir: str) -> bytes:
    """The claim's spec as JSON bytes (``devices``: (device name, unit) pairs; see module rules)."""
    devices = list(devices)
    cdi_devices = []
    for name, unit in devices:
        grant = container_grant([unit], uuids, {}, dev_dir, caps=facts.caps)
        cdi_devices.append(CdiDevice(name=f"{uid}-{name}", container_edits=CdiContainerEdits(
            device_nodes=[device_node(node) for node in grant.devices])))
    whole = container_grant([unit for _, unit in devices], uuids, {}, dev_dir, volume=facts.volume,
                            volume_env=facts.volume_env, caps=facts.caps)
    shared = CdiContainerEdits(
        env=[f"{key}={value}" for key, value in whole.environment.items()],
        device_nodes=[device_node(control_device(path, rule)) for path, rule in facts.control_devices.items()],
        mounts=[bind_mount(mount) for mount in whole.mounts],
    )
    spec = CdiSpec(cdi_version="0.3.0", kind=claim_kind(driver), devices=cdi_devices, container_edits=shared)
    spec = validate_spec(msgspec.structs.replace(spec, cdi_version=required_version(spec)))
    return encode_spec(spec, "json")
