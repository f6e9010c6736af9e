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
- The caller (``DraPluginProcess.create``) holds their units in the node
  ledger (a claim whose unit another front door holds is left out too:
  answering it prepared would hand out a unit in use), writes the
  checkpoint and their CDI specs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime import Failure

from ._claims import ClaimRef, ClaimRefused, plan_claim
from ._devices import DraCatalog
from ._kube import api_failure
from ._prepared import PreparedClaim, PreparedClaims, prepared_claim

__all__ = ["Rebuilt", "RebuildError", "claims_of_node"]


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
