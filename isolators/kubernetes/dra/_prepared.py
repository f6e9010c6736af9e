"""PreparedClaims: the claims this node prepared, and the checkpoint that keeps them.

Rules (issue 37 item 3):
- A ``PreparedClaim`` is what the kubelet was answered for one claim uid:
  its devices (request, pool, device, CDI device ids, shared or not). The
  table answers a second prepare of the same uid with the same devices
  (idempotent, and without the API server: it survives a deleted claim)
  and forgets a claim at unprepare.
- No double grant: ``conflicts(plan)`` names each planned device already
  prepared for another claim where that cannot be shared. A result with
  ``adminAccess`` shares with anyone (it watches, it does not own); a
  ``shareID`` result shares with other ``shareID`` and admin results; an
  exclusive result shares with admin results only. Claims still being
  prepared (``reserve`` before their files are written, ``release`` on
  failure) count, so two concurrent prepares cannot both take one device.
- The checkpoint is a JSON document (``{"version": 1, "claims": [...]}``)
  at ``<work_dir>/dra/<driver>/prepared-claims.json``, written atomically
  (temporary file, fsync, rename, directory fsync) by ``write_checkpoint``
  before the kubelet is answered. Its format version (SPEC R-SH-3) is
  ``CHECKPOINT_VERSION``, 1, as release 0.1.0 already wrote it; a file with
  no version is read as that same shape (0.1.0's reader did so too). It is
  read through ``decode_versioned``: ``read_checkpoint`` of a missing file
  is an empty table; of one that is truncated, garbage, the wrong shape or
  of a version this release does not know, ``UnreadableFile`` naming the
  file and what is wrong (the driver sets it aside and rebuilds its claims
  from the API server: ``_rebuild``); of one it cannot open (permissions,
  I/O), a ``CheckpointError`` naming the file.
- ``prepared_claim(driver, plan)`` is a plan as prepared: each device with
  its CDI device id (``claim_device_id``).
"""

from __future__ import annotations

import logging
import os
import secrets

import msgspec

from runtime import Failure

from actors.file_format import decode_versioned

from ..._durable import discard, write_all
from ._claim_spec import claim_device_id
from ._claims import ClaimPlan, ClaimRef, PlannedDevice

__all__ = ["CHECKPOINT_VERSION", "PreparedClaim", "PreparedDevice", "PreparedClaims", "CheckpointError",
           "read_checkpoint", "write_checkpoint", "checkpoint_path", "prepared_claim"]

logger = logging.getLogger(__name__)


CHECKPOINT_VERSION = 1
"""The checkpoint's format version (see module rules)."""
READS = (0, CHECKPOINT_VERSION)
"""The versions this release reads: none written (0.1.0 read it as 1's shape) and 1."""


class CheckpointError(Failure):
    """The checkpoint of prepared claims cannot be read or written; the message names the file."""


class PreparedDevice(PlannedDevice, frozen=True, kw_only=True):
    cdi_device_ids: list[str]


class PreparedClaim(msgspec.Struct, frozen=True, kw_only=True):
    ref: ClaimRef
    devices: list[PreparedDevice]


class _Document(msgspec.Struct, kw_only=True):
    version: int = CHECKPOINT_VERSION
    claims: list[PreparedClaim] = []


def checkpoint_path(work_dir: str, driver: str) -> str:
    return os.path.join(work_dir, "dra", driver, "prepared-claims.json")


def prepared_claim(driver: str, plan: ClaimPlan) -> PreparedClaim:
    """``plan`` as prepared: each device with its CDI device id."""
    return PreparedClaim(ref=plan.ref, devices=[
        PreparedDevice(request=d.request, pool=d.pool, device=d.device, admin_access=d.admin_access,
                       share_id=d.share_id, share=d.share,
                       cdi_device_ids=[claim_device_id(driver, plan.ref.uid, d.device)])
        for d in plan.devices])


def _holders_allow(new: PlannedDevice, held: PlannedDevice) -> bool:
    if new.admin_access or held.admin_access:
        return True
    return new.share_id is not None and held.share_id is not None


class PreparedClaims:
    """The prepared (and reserved) claims by uid (see module rules)."""

    def __init__(self, claims: list[PreparedClaim] | None = None) -> None:
        self.claims: dict[str, PreparedClaim] = {claim.ref.uid: claim for claim in claims or []}
        self.reserved: dict[str, ClaimPlan] = {}

    def conflicts(self, plan: ClaimPlan) -> list[str]:
        """``"<device> (prepared for claim ns/name, uid U)"`` per device this plan may not take."""
        found = []
        others = [(c.ref, c.devices) for uid, c in self.claims.items() if uid != plan.ref.uid]
        others += [(p.ref, p.devices) for uid, p in self.reserved.items() if uid != plan.ref.uid]
        for device in plan.devices:
            for ref, devices in others:
                for held in devices:
                    if held.device == device.device and not _holders_allow(device, held):
                        found.append(f"{device.device} (prepared for claim {ref.namespace}/{ref.name}, uid {ref.uid})")
        return found

    def reserve(self, plan: ClaimPlan) -> None:
        self.reserved[plan.ref.uid] = plan

    def release(self, uid: str) -> None:
        self.reserved.pop(uid, None)

    def add(self, claim: PreparedClaim) -> None:
        self.reserved.pop(claim.ref.uid, None)
        self.claims[claim.ref.uid] = claim

    def remove(self, uid: str) -> PreparedClaim | None:
        return self.claims.pop(uid, None)

    def encode(self, extra: list[PreparedClaim] = ()) -> bytes:
        """The checkpoint of the prepared claims plus ``extra`` (being prepared)."""
        claims = {**self.claims, **{claim.ref.uid: claim for claim in extra}}
        return msgspec.json.encode(_Document(claims=sorted(claims.values(), key=lambda c: c.ref.uid)))


def read_checkpoint(path: str) -> list[PreparedClaim]:
    """The claims a checkpoint holds (see module rules; blocking): ``UnreadableFile`` when it cannot be decoded."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise CheckpointError(f"Cannot read the prepared-claims checkpoint {path}: {error.strerror}") from error
    return decode_versioned(data, _Document, path, READS).claims


def write_checkpoint(path: str, data: bytes) -> None:
    """Atomically replace the checkpoint with ``data`` (blocking); raises
    ``CheckpointError`` only when the old one is still in place."""
    directory = os.path.dirname(path)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except OSError as error:
        discard(temporary)
        raise CheckpointError(f"Cannot write the prepared-claims checkpoint {path}: {error.strerror}; check that"
                              f" {directory} (under --work_dir) is writable by the plugin and has space") from error
    try:  # the rename landed: the checkpoint is the new one; the entry's durability is best effort
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        logger.warning("The checkpoint %s is written, but syncing %s failed: %s", path, directory, error.strerror)
