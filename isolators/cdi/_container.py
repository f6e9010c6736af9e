"""A container's transient CDI spec: its name, its file, its one device.

Rules:
- Container specs have their own kind, ``gpu-isolator/container``, so a
  container id can never collide with a device of the node's static spec
  (``nvidia.com/gpu=0``, ``=all``): engines drop a device two specs define.
- The device name is the top-level container id when that id is a valid
  CDI device name of at most 180 characters; any other id (one starting
  with ``-`` or ``_``, holding ``@``, ``+`` or non-ASCII text, or too long)
  is named ``id.<32 hex digits of its SHA-256>``. A ``.`` never occurs in
  a container id, so the two forms cannot collide. Nested containers share
  their top-level container's device. Ids are checked
  (``check_container_id``) before a name is made from them.
- The spec file is ``gpu-isolator-container_<name>.json`` (CDI's transient
  spec naming: ``<vendor>-<class>_<id>``); only files with that prefix are
  ever written, rewritten or removed in a spec directory, so other
  vendors' specs there are never touched.
- ``spec_extras(spec)`` reads back what a spec holds beyond the device
  nodes -- the driver volume's mount (at its container path) -- so a
  recovered container keeps its driver volume in later rewrites. The
  volume's PATH / LD_LIBRARY_PATH are not in a spec (R-DR-2): a recovered
  container's grant has no ``loader_environment``.
- ``container_spec(name, grant, injection)`` renders a grant as a spec with
  exactly one device: its device nodes (``hostPath`` only when it differs
  from the container path), the environment (``NVIDIA_VISIBLE_DEVICES``,
  never the loader environment), and for the driver volume
  ``injection.edits`` (its mount, its binaries, the loader-cache hook);
  the version is the lowest the fields need (``required_version``).
"""

from __future__ import annotations

import hashlib

import msgspec

from actors.volume import CONTAINER_PATH

from .._types import ContainerBindMount, ContainerDevice, ContainerGrant, ContainerID, check_container_id
from ._driver import DriverInjection
from ._model import CdiContainerEdits, CdiDevice, CdiDeviceNode, CdiMount, CdiSpec
from ._rules import is_valid_device_name, required_version

__all__ = [
    "CONTAINER_KIND", "CONTAINER_SPEC_PREFIX", "container_device_name", "container_spec_file_name",
    "container_qualified_name", "container_spec", "device_node", "bind_mount", "spec_extras",
]

CONTAINER_KIND = "gpu-isolator/container"
CONTAINER_SPEC_PREFIX = "gpu-isolator-container_"
MAX_PLAIN_NAME = 180
"""Longer ids are hashed, so the spec file name (and its temporary) fits in 255 bytes."""


def container_device_name(container_id: ContainerID) -> str:
    """The CDI device name of a container's grant (its top-level container's)."""
    root = check_container_id(container_id).root()
    value = root.value
    if len(value) <= MAX_PLAIN_NAME and is_valid_device_name(value):
        return value
    return "id." + hashlib.sha256(value.encode("utf-8")).hexdigest()[:32]


def container_spec_file_name(container_id: ContainerID) -> str:
    """``gpu-isolator-container_<device name>.json``."""
    return f"{CONTAINER_SPEC_PREFIX}{container_device_name(container_id)}.json"


def container_qualified_name(container_id: ContainerID) -> str:
    """``gpu-isolator/container=<device name>``: what to pass to ``--device``."""
    return f"{CONTAINER_KIND}={container_device_name(container_id)}"


def device_node(device: ContainerDevice) -> CdiDeviceNode:
    """A granted node as a CDI device node (``hostPath`` only where it differs)."""
    return CdiDeviceNode(
        path=device.path,
        host_path=device.host_path if device.host_path != device.path else None,
        type=device.type, major=device.major, minor=device.minor,
        file_mode=device.file_mode, permissions=device.permissions,
    )


def bind_mount(mount: ContainerBindMount) -> CdiMount:
    """A granted bind mount as a CDI mount (no ``type``: options say bind)."""
    return CdiMount(host_path=mount.host_path, container_path=mount.container_path, options=mount.oci_options())


def container_spec(name: str, grant: ContainerGrant, injection: DriverInjection | None = None) -> CdiSpec:
    """The one-device spec of a grant (see the module rules); ``injection`` is needed when the grant
    holds the driver volume."""
    if grant.mounts and injection is None:
        raise ValueError("A grant with the driver volume needs its DriverInjection (mounts, binaries, hook)")
    driver = injection.edits(grant.mounts) if injection is not None else CdiContainerEdits()
    edits = CdiContainerEdits(
        env=[f"{key}={value}" for key, value in grant.environment.items()],
        device_nodes=[device_node(device) for device in grant.devices],
        mounts=driver.mounts,
        hooks=driver.hooks,
    )
    spec = CdiSpec(cdi_version="0.3.0", kind=CONTAINER_KIND, devices=[CdiDevice(name=name, container_edits=edits)])
    return msgspec.structs.replace(spec, cdi_version=required_version(spec))


def spec_extras(spec: CdiSpec) -> tuple[tuple[ContainerBindMount, ...], dict[str, str]]:
    """The driver volume's mount of a container spec, and the loader environment (none: see module rules)."""
    mounts = [ContainerBindMount(host_path=mount.host_path, container_path=mount.container_path,
                                 read_only="ro" in mount.options)
              for device in spec.devices for mount in device.container_edits.mounts
              if mount.container_path == CONTAINER_PATH]
    return tuple(mounts), {}
