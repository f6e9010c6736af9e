"""Rebuilding the prepared claims from the API server, when the checkpoint cannot be read.

Rules (SPEC R-SH-3):
- The checkpoint is this driver's record of what the kubelet was answered;
  the truth outside it is the API server: the ResourceClaims allocated a
  device of this driver in this node's pool (the pool is the node's name).
  Pods on this node run with exactly those.
- ``claims_of_node(client, driver=, node=, catalog=)`` lists every
  ResourceClaim (all namespaces: one list, bounded by the client's
  timeout) and keeps those with at least one result of this driver in
  this node's pool. Each is planned as a prepare plans it (``plan_claim``:
  a device this node does not publish, opaque configuration for this
  driver, a result of another node's pool refuse it) and kept unless a
  claim kept before it holds one of its devices unshared
  (``PreparedClaims.conflicts``): never two exclusive claims on one
  device. Health is not asked: a claim in use stays held however its GPU
  is. Claims are taken in uid order, so two starts rebuild the same table.
- It answers ``Rebuilt``: the claims as prepared (``prepared_claim``) and,
  for each claim left out, one line naming it and why. A list that fails
  raises ``RebuildError`` naming the API server's answer; nothing is
  decided from a partial list.
- ``rebuild_claims(client, unreadable, ...)`` is what a start with an
  unreadable checkpoint does first: ``claims_of_node`` tried
  ``REBUILD_TRIES`` times, each claim left out logged at ERROR; a list that
  never answers is a ``CheckpointError`` naming the file and the answer
  (the file stays: a missing one would read as "nothing prepared").
- ``replace_unreadable(checkpoint, data, unreadable, count)`` (blocking;
  one job) moves the unreadable checkpoint aside and writes the rebuilt one
  in its place, an ERROR naming both; a write that fails puts the
  unreadable one back, so the next start rebuilds again.
- The caller (``DraPluginProcess.create``) holds their units in the node
  ledger (a claim whose unit another front door holds is left out too:
  answering it prepared would hand out a unit in use), writes the
  checkpoint and their CDI specs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from actors.file_format import UnreadableFile, set_aside
from runtime import Failure

from ._claims import ClaimRef, ClaimRefused, plan_claim
from ._devices import DraCatalog
from ._kube import api_failure
from ._prepared import CheckpointError, PreparedClaim, PreparedClaims, prepared_claim, write_checkpoint

__all__ = ["Rebuilt", "RebuildError", "REBUILD_TRIES", "claims_of_node", "rebuild_claims", "replace_unreadable"]

logger = logging.getLogger(__name__)

REBUILD_TRIES = 3
"""Lists of the ResourceClaims tried before a start with an unreadable checkpoint gives up (see module rules)."""


class RebuildError(Failure):
    """The ResourceClaims could not be listed; the message names the API server's answer."""


class Rebuilt(msgspec.Struct, frozen=True, kw_only=True):
    """The claims rebuilt from the API server, and one line per claim left out."""

    claims: list[PreparedClaim]
    left_out: list[str]


def _ours(claim: Any, driver: str, node: str) -> bool:
    allocation = claim.status.allocation if claim.status is not None else None
    results = (allocation.devices.results or []) if allocation is not None and allocation.devices else []
    return any(result.driver == driver and result.pool == node for result in results)


async def claims_of_node(client: Any, *, driver: str, node: str, catalog: DraCatalog) -> Rebuilt:
    """The claims allocated to this node's pool, as prepared (see module rules)."""
    from lightkube import ALL_NS
    from lightkube.resources.resource_v1 import ResourceClaim

    try:
        listed = [claim async for claim in client.list(ResourceClaim, namespace=ALL_NS)]
    except Exception as error:  # noqa: BLE001 - the API server's answer, or the transport's failure
        raise RebuildError(f"cannot list the ResourceClaims: {api_failure(error)}") from error
    mine = sorted((claim for claim in listed if claim.metadata is not None and _ours(claim, driver, node)),
                  key=lambda claim: claim.metadata.uid or "")
    table = PreparedClaims()
    left_out = []
    for claim in mine:
        ref = ClaimRef(claim.metadata.namespace or "", claim.metadata.name or "", claim.metadata.uid or "")
        try:
            plan = plan_claim(ref, claim, driver=driver, node=node, catalog=catalog)
            taken = table.conflicts(plan)
            if taken:
                raise ClaimRefused(f"{ref}: device {', '.join(taken)} is not shared, so it cannot be held twice")
        except ClaimRefused as refused:
            left_out.append(str(refused).replace("; nothing was prepared", ""))
            continue
        table.add(prepared_claim(driver, plan))
    return Rebuilt(claims=sorted(table.claims.values(), key=lambda c: c.ref.uid), left_out=left_out)


async def rebuild_claims(client: Any, unreadable: UnreadableFile, *, driver: str, node: str,
                         catalog: DraCatalog) -> list[PreparedClaim]:
    """The claims of the API server allocated to this node, in place of an unreadable checkpoint."""
    for attempt in range(1, REBUILD_TRIES + 1):
        try:
            rebuilt = await claims_of_node(client, driver=driver, node=node, catalog=catalog)
            break
        except RebuildError as error:
            if attempt == REBUILD_TRIES:
                raise CheckpointError(
                    f"The prepared-claims checkpoint {unreadable}; its claims cannot be rebuilt from the API"
                    f" server ({error}, {REBUILD_TRIES} tries): the file is left in place and the next start"
                    " tries again") from error
            logger.warning("Rebuilding the prepared claims: %s (try %d of %d)", error, attempt, REBUILD_TRIES)
    for line in rebuilt.left_out:
        logger.error("Not prepared again from the API server: %s", line)
    return rebuilt.claims


def replace_unreadable(checkpoint: str, data: bytes, unreadable: UnreadableFile, count: int) -> None:
    """The unreadable checkpoint moved aside, the rebuilt one written in its place (blocking; one job). A
    write that fails puts the unreadable one back: the next start rebuilds again, where a missing checkpoint
    would read as "nothing prepared"."""
    try:
        moved: str | None = set_aside(checkpoint)
    except OSError as error:
        moved = None
        logger.error("The prepared-claims checkpoint %s: it cannot be moved aside (%s), so the rebuilt one replaces"
                     " it", checkpoint, error.strerror)
    try:
        write_checkpoint(checkpoint, data)
    except CheckpointError:
        if moved is not None:
            os.rename(moved, checkpoint)
        raise
    logger.error("The prepared-claims checkpoint %s. Moved it aside to %s and rebuilt the prepared claims from the"
                 " ResourceClaims the API server allocated to this node: %d claims", unreadable,
                 moved or "nowhere", count)
