"""The CDI spec document (Container Device Interface), as msgspec Structs.

Rules:
- Field names are snake_case here and camelCase on the wire (``cdiVersion``,
  ``containerEdits``, ``deviceNodes``, ``hostPath``, ``fileMode``,
  ``hookName``), exactly the CDI spec's names; unset optional fields are
  left out of the document (``omit_defaults``), so a field appears only
  when it says something, and the lowest ``cdiVersion`` can be declared.
- Only the fields of CDI 0.3.0-0.5.0 are modelled (the range podman 4.3.1
  accepts): env, deviceNodes, mounts and hooks. Decoding refuses unknown
  fields (annotations, intelRdt, ... would need a later version).
- These are plain values: validation is ``validate_spec`` and the version
  ``required_version`` (``_rules.py``); encoding is ``encode_spec``.
"""

from __future__ import annotations

import msgspec

__all__ = ["CdiDeviceNode", "CdiMount", "CdiHook", "CdiContainerEdits", "CdiDevice", "CdiSpec"]


class CdiDeviceNode(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True,
                    forbid_unknown_fields=True):
    """A device node the engine creates in the container (and allows in its cgroup)."""

    path: str
    """The node's path in the container (``/dev/nvidia0``)."""
    host_path: str | None = None
    """The node on the host, when it differs from ``path`` (CDI 0.5.0)."""
    type: str | None = None
    """``c``, ``b``, ``u`` or ``p``."""
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    """The node's permission bits in the container (``0o666``)."""
    permissions: str | None = None
    """The cgroup access the container gets: letters of ``rwm``."""
    uid: int | None = None
    gid: int | None = None


class CdiMount(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True,
               forbid_unknown_fields=True):
    """A mount the engine adds (a bind mount for the driver volume)."""

    host_path: str
    container_path: str
    type: str | None = None
    """The filesystem type (CDI 0.4.0); bind mounts say ``bind``/``rbind`` in options instead."""
    options: list[str] = []


class CdiHook(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True,
              forbid_unknown_fields=True):
    """An OCI hook the engine runs."""

    hook_name: str
    path: str
    args: list[str] = []
    env: list[str] = []
    timeout: int | None = None


class CdiContainerEdits(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True,
                        forbid_unknown_fields=True):
    """Edits to the container's OCI spec."""

    env: list[str] = []
    """``KEY=VALUE`` entries."""
    device_nodes: list[CdiDeviceNode] = []
    mounts: list[CdiMount] = []
    hooks: list[CdiHook] = []

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks)


class CdiDevice(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True,
                forbid_unknown_fields=True):
    """One device an engine can be asked for (``--device <kind>=<name>``)."""

    name: str
    container_edits: CdiContainerEdits


class CdiSpec(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True,
              forbid_unknown_fields=True):
    """A CDI spec file: a kind (``vendor/class``), its devices and shared edits."""

    cdi_version: str
    kind: str
    devices: list[CdiDevice]
    container_edits: CdiContainerEdits | None = None
    """Edits applied when any device of this spec is injected."""

    def qualified_names(self) -> list[str]:
        """``vendor/class=name`` of every device, as engines take them."""
        return [f"{self.kind}={device.name}" for device in self.devices]
