"""Names in the node ledger: owners, holders, and the file of a unit's lease.

Rules (SPEC R-NL-1):
- An *owner* is one front door instance on the node, named ``<kind>:<name>``
  with a kind of ``OWNER_KINDS``: ``isolator:<work_dir>``,
  ``serve:<socket>``, ``kubelet-plugin:<resource>``,
  ``dra-plugin:<driver>``. ``isolator_owner``, ``serve_owner``,
  ``kubelet_plugin_owner`` and ``dra_plugin_owner`` build them (paths
  made absolute, so two spellings of one directory are one owner).
- ``check_owner`` and ``check_holder`` accept printable ASCII only (no
  control or bidirectional characters: the names are shown to operators),
  an owner and a holder of at most 1024 characters each (a pod's
  ``namespace/name/container`` fits); anything
  else is a ``LedgerError`` naming the value. Names are checked before any
  path is built from them.
- A unit is named by its UUID as NVML reports it (``GPU-…``, ``MIG-…``;
  older drivers wrote ``MIG-GPU-…/1/0``). ``lease_file_name`` turns a UUID
  into a file name that is always one plain component: letters, digits and
  ``-`` stay, every other byte is ``%XX``; ``.lease`` is appended. A UUID
  that is empty, longer than 128 characters or not printable ASCII is
  refused, and so is one whose file name (with the ``.<name>.tmp`` it is
  written through) would pass the filesystem's 255 bytes.
- An owner's lock file is named by the SHA-256 of its name
  (``owner_file_name``): any owner name maps to one short plain component.
"""

from __future__ import annotations

import hashlib
import os
import re

from ._errors import LedgerError

__all__ = [
    "OWNER_KINDS", "check_owner", "check_holder", "check_unit_uuid", "lease_file_name", "owner_file_name",
    "isolator_owner", "serve_owner", "kubelet_plugin_owner", "dra_plugin_owner",
]

OWNER_KINDS = ("isolator", "serve", "kubelet-plugin", "dra-plugin")
"""The front doors that hold units (SPEC R-NL-1)."""

LEASE_SUFFIX = ".lease"
OWNER_SUFFIX = ".owner"
_PRINTABLE = re.compile(r"[\x20-\x7e]+")
_KEEP = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
MAX_OWNER = 1024
MAX_HOLDER = 1024
MAX_UUID = 128
MAX_NAME = 255
"""A file name's bytes at most (Linux's NAME_MAX)."""


def check_owner(owner: object) -> str:
    """``owner`` if it is ``<kind>:<name>`` of a known kind (see module rules)."""
    if not isinstance(owner, str) or len(owner) > MAX_OWNER or not _PRINTABLE.fullmatch(owner):
        raise LedgerError(f"Invalid node ledger owner {owner!r}: expected printable ASCII '<kind>:<name>'"
                          f" of at most {MAX_OWNER} characters")
    kind, _, name = owner.partition(":")
    if kind not in OWNER_KINDS or not name:
        raise LedgerError(f"Invalid node ledger owner {owner!r}: expected '<kind>:<name>' with a kind of"
                          f" {', '.join(OWNER_KINDS)}")
    return owner


def check_holder(holder: object) -> str:
    """``holder`` if it is printable ASCII of at most 1024 characters."""
    if not isinstance(holder, str) or len(holder) > MAX_HOLDER or not _PRINTABLE.fullmatch(holder):
        raise LedgerError(f"Invalid node ledger holder {holder!r}: expected printable ASCII of at most"
                          f" {MAX_HOLDER} characters")
    return holder


def check_unit_uuid(uuid: object) -> str:
    """``uuid`` if it can name a unit (see module rules)."""
    _lease_name(uuid)
    return uuid  # type: ignore[return-value]


def lease_file_name(uuid: str) -> str:
    """The lease file of the unit ``uuid``: one plain component (see module rules)."""
    return _lease_name(uuid)


def _lease_name(uuid: object) -> str:
    if not isinstance(uuid, str) or len(uuid) > MAX_UUID or not _PRINTABLE.fullmatch(uuid):
        raise LedgerError(f"Invalid unit UUID {uuid!r} for the node ledger: expected printable ASCII of at most"
                          f" {MAX_UUID} characters (NVML's GPU-… or MIG-…)")
    name = "".join(chr(b) if b in _KEEP else f"%{b:02X}" for b in uuid.encode("ascii")) + LEASE_SUFFIX
    if len(name) + len("..tmp") > MAX_NAME:
        raise LedgerError(f"Invalid unit UUID {uuid!r} for the node ledger: its lease file name would be"
                          f" {len(name)} bytes ({len(uuid)} characters, each but letters, digits and '-' written as"
                          f" three), beyond what a file name may be ({MAX_NAME} bytes with its '.<name>.tmp')")
    return name


def owner_file_name(owner: str) -> str:
    """The lock file of ``owner``: the SHA-256 of its name."""
    return hashlib.sha256(check_owner(owner).encode("ascii")).hexdigest()[:40] + OWNER_SUFFIX


def isolator_owner(work_dir: str) -> str:
    """``isolator:<work_dir>`` (absolute)."""
    return check_owner(f"isolator:{os.path.abspath(work_dir)}")


def serve_owner(socket: str) -> str:
    """``serve:<socket>`` (absolute)."""
    return check_owner(f"serve:{os.path.abspath(socket)}")


def kubelet_plugin_owner(resource: str) -> str:
    """``kubelet-plugin:<resource>`` (e.g. ``nvidia.com/gpu``)."""
    return check_owner(f"kubelet-plugin:{resource}")


def dra_plugin_owner(driver: str) -> str:
    """``dra-plugin:<driver>`` (e.g. ``gpu.nvidia.com``)."""
    return check_owner(f"dra-plugin:{driver}")
