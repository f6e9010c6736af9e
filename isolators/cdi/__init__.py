"""CDI specs and OCI fragments: the grant in the container engines' language.

Container engines (podman, containerd, CRI-O, Docker) inject devices
described by CDI specs read from ``/etc/cdi`` and ``/var/run/cdi``; runc and
crun read an OCI ``config.json``. This package models CDI specs
(``CdiSpec`` ...), checks them against the CDI spec's rules
(``validate_spec``, ``required_version``), encodes them (JSON / YAML),
writes spec files atomically, names and renders a container's transient
spec (kind ``gpu-isolator/container``) and the node's static spec (kind
``nvidia.com/gpu``), injects the driver volume without touching a
container's PATH or LD_LIBRARY_PATH (``DriverInjection``: mounts and the
``update-ldcache`` hook, ``cdi_hook_main``), adds an MPS share's pipe
directory and shared memory (``add_mps``, R-MP-3), and merges
``ContainerLaunchInfo.to_oci()`` fragments into a ``config.json``.
"""

from ._container import CONTAINER_KIND, CONTAINER_SPEC_PREFIX, bind_mount, container_device_name
from ._container import container_qualified_name, container_spec, container_spec_file_name, device_node
from ._container import spec_extras
from ._driver import BINARY_DIR, LIBRARY_FOLDERS, DriverInjection, hook_program, volume_binaries
from ._hook import HOOK_FILE, UPDATE_LDCACHE, HookError, container_root, hook_args
from ._hook import main as cdi_hook_main
from ._document import SpecFormat, decode_spec, encode_spec, spec_format
from ._files import CdiWriteError, apply_spec_changes, ensure_spec_file, is_temporary_name, list_spec_files
from ._files import read_spec_files, remove_spec_file, write_spec_file
from ._grant import VISIBLE_DEVICES, container_grant, control_device
from ._mps import MPS_PIPE_DIRECTORY, MPS_PIPE_ENV, MPS_SHM, add_mps, mps_edits
from ._model import CdiContainerEdits, CdiDevice, CdiDeviceNode, CdiHook, CdiMount, CdiSpec
from ._node import NODE_KIND, NodeFacts, generate_node_spec, node_spec, read_node_facts
from ._oci import merge_oci
from ._rules import SUPPORTED_VERSIONS, CdiSpecError, is_valid_device_name, required_version
from ._rules import validate_device_name, validate_kind, validate_spec

__all__ = [
    "CONTAINER_KIND", "CONTAINER_SPEC_PREFIX", "bind_mount", "container_device_name",
    "container_qualified_name", "container_spec", "container_spec_file_name", "device_node", "spec_extras",
    "BINARY_DIR", "LIBRARY_FOLDERS", "DriverInjection", "hook_program", "volume_binaries",
    "HOOK_FILE", "UPDATE_LDCACHE", "HookError", "container_root", "hook_args", "cdi_hook_main",
    "SpecFormat", "decode_spec", "encode_spec", "spec_format",
    "CdiWriteError", "apply_spec_changes", "ensure_spec_file", "is_temporary_name", "list_spec_files",
    "read_spec_files", "remove_spec_file", "write_spec_file", "VISIBLE_DEVICES", "container_grant", "control_device",
    "CdiContainerEdits", "CdiDevice", "CdiDeviceNode", "CdiHook", "CdiMount", "CdiSpec",
    "NODE_KIND", "NodeFacts", "generate_node_spec", "node_spec", "read_node_facts", "merge_oci",
    "SUPPORTED_VERSIONS", "CdiSpecError", "is_valid_device_name", "required_version",
    "validate_device_name", "validate_kind", "validate_spec",
    "MPS_PIPE_DIRECTORY", "MPS_PIPE_ENV", "MPS_SHM", "add_mps", "mps_edits",
]
