"""Building a container's grant in engine terms (``ContainerGrant``).

Rules:
- The devices are the container's GPUs by minor (``/dev/nvidia<minor>`` in
  the container, ``<dev_dir>/nvidia<minor>`` on the host, ``c 195:<minor>
  rwm``), then the control devices in the order the isolator recorded them
  (``/dev/<name>`` in the container, the node under ``dev_dir`` on the
  host, with their own numbers). Nothing else: a container never sees
  another container's GPU.
- A MIG device (R-MG-3) brings its parent's node (once, right before its
  first MIG device) and its two capability nodes
  (``/dev/nvidia-caps/nvidia-cap<minor>``, read-only, mode 0444); units
  are in their order (a MIG device after its parent's minor).
- The environment starts with ``NVIDIA_VISIBLE_DEVICES``: the GPUs' UUIDs
  (``MIG-…`` for a MIG device) by minor, comma-separated, or ``none`` for a container without GPUs
  (NVIDIA's value for "no GPU, driver present"). The driver volume's PATH
  and LD_LIBRARY_PATH, when the volume is injected, are the grant's
  ``loader_environment`` (for ``to_oci()``; CDI specs never set them).
- The driver volume, when injected, is one read-only recursive bind mount
  of its host directory at its container path (``/usr/local/nvidia``).
- Pure: no I/O; the same inputs give an equal grant.
"""

from __future__ import annotations

import os
import posixpath
from typing import Iterable, Mapping

from actors import Gpu
from actors.devices import DeviceRule
from actors.mig import CAPS_DEV_SUBDIR, MigCapabilities, MigDevice

from .._types import ContainerBindMount, ContainerDevice, ContainerGrant

__all__ = ["VISIBLE_DEVICES", "container_grant", "gpu_device", "control_device", "capability_devices"]

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


def gpu_device(gpu: Gpu, dev_dir: str) -> ContainerDevice:
    """The node of one GPU: ``/dev/nvidia<minor>``, from ``<dev_dir>/nvidia<minor>``."""
    name = f"nvidia{gpu.minor}"
    return ContainerDevice(path=posixpath.join("/dev", name), host_path=os.path.join(dev_dir, name),
                           major=gpu.major, minor=gpu.minor)


def capability_devices(device: MigDevice, caps: MigCapabilities, dev_dir: str) -> list[ContainerDevice]:
    """The GPU- and compute-instance capability nodes of a MIG device
    (``/dev/nvidia-caps/nvidia-cap<minor>``), read-only as real ones are (0444, ``r``)."""
    nodes = []
    for host_path, minor in zip(caps.cap_node_paths(device, dev_dir), caps.cap_minors(device)):
        name = f"nvidia-cap{minor}"
        nodes.append(ContainerDevice(path=posixpath.join("/dev", CAPS_DEV_SUBDIR, name), host_path=host_path,
                                     major=caps.major, minor=minor, permissions="r", file_mode=0o444))
    return nodes


def control_device(host_path: str, rule: DeviceRule) -> ContainerDevice:
    """A control device (``nvidiactl``, ``nvidia-uvm``, ...) at ``/dev/<name>``."""
    if rule.major is None or rule.minor is None:
        raise ValueError(f"Control device '{host_path}' needs exact numbers, got {rule}")
    return ContainerDevice(path=posixpath.join("/dev", os.path.basename(host_path)), host_path=host_path,
                           type=rule.type, major=rule.major, minor=rule.minor)


def container_grant(
    gpus: Iterable[Gpu],
    uuids: Mapping[Gpu, str],
    control_devices: Mapping[str, DeviceRule],
    dev_dir: str,
    *,
    volume: ContainerBindMount | None = None,
    volume_env: Mapping[str, str] | None = None,
    caps: MigCapabilities | None = None,
) -> ContainerGrant:
    """The grant of a container holding ``gpus`` (see the module rules); MIG
    devices among them need the node's capability facts (``caps``)."""
    ordered = sorted(gpus)
    missing = [str(gpu) for gpu in ordered if gpu not in uuids]
    if missing:
        raise ValueError(f"No UUID known for GPUs {missing}: they are not in the node's inventory")
    devices: list[ContainerDevice] = []
    parents: set[Gpu] = set()
    for unit in ordered:
        if not isinstance(unit, MigDevice):
            devices.append(gpu_device(unit, dev_dir))
            continue
        if caps is None:
            raise ValueError(f"MIG device {unit} needs the node's capability facts")
        if unit.parent not in parents and unit.parent not in ordered:
            parents.add(unit.parent)
            devices.append(gpu_device(unit.parent, dev_dir))
        devices += capability_devices(unit, caps, dev_dir)
    devices += [control_device(path, rule) for path, rule in control_devices.items()]
    environment = {VISIBLE_DEVICES: ",".join(uuids[gpu] for gpu in ordered) or "none"}
    return ContainerGrant(
        devices=tuple(devices),
        mounts=(volume,) if volume is not None else (),
        environment=environment,
        loader_environment=dict(volume_env or {}) if volume is not None else {},
    )
