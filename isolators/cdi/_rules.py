"""The CDI spec's rules: what a valid spec is, and the lowest version it needs.

Rules (the CDI spec and its reference parser, tags.cncf.io/container-device-interface):
- ``kind`` is ``vendor/class``. The vendor is a DNS subdomain (lowercase
  labels of letters, digits and ``-``, dot-separated, at most 253
  characters) that starts with a letter, as the reference parser also
  demands. The class starts with a letter, ends with a letter or digit and
  holds letters, digits, ``-`` and ``_`` in between, at most 63 characters
  (a ``.`` in the class needs CDI 0.6.0, newer than podman 4.3.1 reads, so
  it is refused).
- A device name starts and ends with a letter or digit and holds letters,
  digits, ``-``, ``_``, ``.`` and ``:`` in between; names are unique in a
  spec, a spec has at least one device and each device's edits are
  non-empty.
- Paths (device nodes, mounts, hooks) are absolute, without NUL or ``..``
  components; env entries are ``KEY=VALUE`` with a non-empty key; a device
  node's type is ``c``, ``b``, ``u`` or ``p``, its numbers are not
  negative, its permissions are letters of ``rwm`` (each at most once) and
  a node path appears once per edit list; hook names are the OCI hooks'.
- ``required_version(spec)`` is the lowest ``cdiVersion`` the spec's
  fields need, as NVIDIA's generator declares it: 0.3.0, or 0.4.0 for a
  mount ``type``, or 0.5.0 for a device node ``hostPath`` or a device name
  that starts with a digit. ``validate_spec`` also refuses a declared
  version outside 0.3.0-0.5.0 (what podman 4.3.1 accepts) or below the
  required one.
- Every failure is one ``CdiSpecError`` naming the offending value.
"""

from __future__ import annotations

import re
from typing import Iterable

from runtime import Failure

from ._model import CdiContainerEdits, CdiDeviceNode, CdiSpec

__all__ = [
    "CdiSpecError", "SUPPORTED_VERSIONS", "required_version", "validate_spec", "validate_kind",
    "validate_device_name", "is_valid_device_name",
]

SUPPORTED_VERSIONS = ("0.3.0", "0.4.0", "0.5.0")
"""The CDI versions written here: the range podman 4.3.1 accepts."""

HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
DEVICE_TYPES = ("c", "b", "u", "p")

_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


class CdiSpecError(Failure, ValueError):
    """A CDI spec (or a part of one) breaks the CDI spec's rules; the message names it."""


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def validate_kind(kind: str) -> tuple[str, str]:
    """Split a valid ``vendor/class`` kind, else raise CdiSpecError."""
    if not isinstance(kind, str) or kind.count("/") != 1:
        raise CdiSpecError(f"Invalid CDI kind {kind!r}: expected 'vendor/class', e.g. 'nvidia.com/gpu'")
    vendor, klass = kind.split("/")
    if not vendor or len(vendor) > 253 or not vendor[0].isalpha() or not all(
            _DNS_LABEL.fullmatch(label) for label in vendor.split(".")):
        raise CdiSpecError(
            f"Invalid CDI kind {kind!r}: the vendor {vendor!r} must be a DNS subdomain (lowercase letters,"
            " digits, '-' and '.', at most 253 characters) starting with a letter"
        )
    if "." in klass:
        raise CdiSpecError(
            f"Invalid CDI kind {kind!r}: a '.' in the class {klass!r} needs CDI 0.6.0, newer than engines"
            f" such as podman 4.3.1 accept ({SUPPORTED_VERSIONS[0]}-{SUPPORTED_VERSIONS[-1]})"
        )
    if len(klass) > 63 or not _CLASS.fullmatch(klass):
        raise CdiSpecError(
            f"Invalid CDI kind {kind!r}: the class {klass!r} must start with a letter, end with a letter or"
            " digit and hold only letters, digits, '-' and '_' (at most 63 characters)"
        )
    return vendor, klass


def is_valid_device_name(name: str) -> bool:
    """Whether ``name`` is a valid CDI device name (any version)."""
    return isinstance(name, str) and name.isascii() and _DEVICE_NAME.fullmatch(name) is not None


def validate_device_name(name: str) -> str:
    """Return ``name`` if it is a valid CDI device name, else raise CdiSpecError."""
    if not is_valid_device_name(name):
        raise CdiSpecError(
            f"Invalid CDI device name {name!r}: it must start and end with a letter or digit and hold only"
            " letters, digits, '-', '_', '.' and ':'"
        )
    return name


def _check_path(path: object, what: str) -> None:
    if not isinstance(path, str) or not path.startswith("/"):
        raise CdiSpecError(f"Invalid CDI spec: {what} {path!r} must be an absolute path")
    if "\x00" in path or ".." in path.split("/"):
        raise CdiSpecError(f"Invalid CDI spec: {what} {path!r} must not contain NUL or '..' components")


def _check_env(entries: Iterable[str], where: str) -> None:
    for entry in entries:
        if not isinstance(entry, str) or entry.find("=") <= 0 or "\x00" in entry:
            raise CdiSpecError(f"Invalid CDI spec: {where} env entry {entry!r} must be 'KEY=VALUE'"
                               " with a non-empty key and no NUL")


def _check_node(node: CdiDeviceNode) -> None:
    _check_path(node.path, "device node path")
    if node.host_path is not None:
        _check_path(node.host_path, f"hostPath of device node {node.path!r}")
    if node.type is not None and node.type not in DEVICE_TYPES:
        raise CdiSpecError(f"Invalid CDI spec: device node {node.path!r} has type {node.type!r};"
                           f" expected one of {', '.join(DEVICE_TYPES)}")
    for field in ("major", "minor", "uid", "gid"):
        value = getattr(node, field)
        if value is not None and (isinstance(value, bool) or value < 0):
            raise CdiSpecError(f"Invalid CDI spec: device node {node.path!r} has a negative {field} {value!r}")
    if node.file_mode is not None and not 0 <= node.file_mode <= 0o7777:
        raise CdiSpecError(f"Invalid CDI spec: device node {node.path!r} has fileMode {node.file_mode!r};"
                           " expected permission bits (0 to 0o7777)")
    permissions = node.permissions
    if permissions is not None and (not permissions or set(permissions) - set("rwm")
                                    or len(set(permissions)) != len(permissions)):
        raise CdiSpecError(f"Invalid CDI spec: device node {node.path!r} has permissions {permissions!r};"
                           " expected letters of 'rwm', each at most once")


def _check_edits(edits: CdiContainerEdits, where: str) -> None:
    _check_env(edits.env, where)
    seen: set[str] = set()
    for node in edits.device_nodes:
        _check_node(node)
        if node.path in seen:
            raise CdiSpecError(f"Invalid CDI spec: {where} lists device node {node.path!r} twice")
        seen.add(node.path)
    for mount in edits.mounts:
        _check_path(mount.host_path, "mount hostPath")
        _check_path(mount.container_path, "mount containerPath")
        for option in mount.options:
            if not isinstance(option, str) or not option or "\x00" in option:
                raise CdiSpecError(f"Invalid CDI spec: mount {mount.container_path!r} has option {option!r}")
    for hook in edits.hooks:
        if hook.hook_name not in HOOK_NAMES:
            raise CdiSpecError(f"Invalid CDI spec: hook name {hook.hook_name!r}; expected one of"
                               f" {', '.join(HOOK_NAMES)}")
        _check_path(hook.path, f"{hook.hook_name} hook path")
        _check_env(hook.env, f"{hook.hook_name} hook")
        if hook.timeout is not None and hook.timeout <= 0:
            raise CdiSpecError(f"Invalid CDI spec: {hook.hook_name} hook timeout {hook.timeout!r} must be"
                               " greater than zero")


def _all_edits(spec: CdiSpec) -> list[CdiContainerEdits]:
    edits = [device.container_edits for device in spec.devices]
    if spec.container_edits is not None:
        edits.append(spec.container_edits)
    return edits


def required_version(spec: CdiSpec) -> str:
    """The lowest ``cdiVersion`` whose fields ``spec`` uses (see the module rules)."""
    edits = _all_edits(spec)
    if any(device.name[:1] and not device.name[0].isalpha() for device in spec.devices):
        return "0.5.0"
    if any(node.host_path is not None for e in edits for node in e.device_nodes):
        return "0.5.0"
    if any(mount.type is not None for e in edits for mount in e.mounts):
        return "0.4.0"
    return "0.3.0"


def validate_spec(spec: CdiSpec) -> CdiSpec:
    """Return ``spec`` if it obeys every rule above, else raise CdiSpecError."""
    if spec.cdi_version not in SUPPORTED_VERSIONS:
        raise CdiSpecError(f"Invalid CDI spec: cdiVersion {spec.cdi_version!r}; this writes"
                           f" {', '.join(SUPPORTED_VERSIONS)} (what podman 4.3.1 accepts)")
    validate_kind(spec.kind)
    if not spec.devices:
        raise CdiSpecError(f"Invalid CDI spec of kind {spec.kind!r}: it has no devices")
    names: set[str] = set()
    for device in spec.devices:
        validate_device_name(device.name)
        if device.name in names:
            raise CdiSpecError(f"Invalid CDI spec of kind {spec.kind!r}: device {device.name!r} appears twice")
        names.add(device.name)
        if device.container_edits.is_empty():
            raise CdiSpecError(f"Invalid CDI spec of kind {spec.kind!r}: device {device.name!r} has no edits")
        _check_edits(device.container_edits, f"device {device.name!r}")
    if spec.container_edits is not None:
        _check_edits(spec.container_edits, "the spec's shared edits")
    needed = required_version(spec)
    if _version_key(spec.cdi_version) < _version_key(needed):
        raise CdiSpecError(f"Invalid CDI spec of kind {spec.kind!r}: cdiVersion {spec.cdi_version} is below"
                           f" {needed}, which its fields need")
    return spec

