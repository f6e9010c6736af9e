"""OperatorRoutes: a Kubernetes front door's actor, as far as the operator and ``/metrics`` see it.

Rules (R-K8-9; the device plugin and the DRA driver are both one):
- ``OperatorRoutes`` is the base of every front door's process: its
  ``initialize`` routes ``/mark_healthy``, makes the process's
  ``MetricSet`` (``metrics``) and hands it to ``publish(metrics)``, where
  the front door adds its own counters and routes; ``finalize`` closes
  the metrics and shuts the process's ``executor`` down.
- Every route asks for the bearer credential (``--credential``): without
  it 401 and nothing changes; a plugin started without ``--credential``
  answers 403 to everyone; then only POST (405) (``_operator_refusal``).
- ``_mark_healthy_route``: a JSON body ``{"uuid": "<GPU or MIG UUID>"}``
  (400), a UUID this plugin offers (404); then the allocator's
  ``mark_healthy``: 200 with ``{"uuid", "unit", "healthy": true,
  "was_unhealthy"}``.
- A front door's process has ``credential`` (a ``BearerCredential`` or
  None), ``catalog`` (a ``UnitCatalog``: ``unit_of_uuid``), ``allocator``
  and ``executor`` (its blocking file work).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from runtime import Executor, MetricSet, Process, Response, current_runtime

from ..credential import BearerCredential

__all__ = ["OperatorRoutes", "MarkHealthy"]

logger = logging.getLogger(__name__)


class MarkHealthy(msgspec.Struct, forbid_unknown_fields=True):
    uuid: str


class OperatorRoutes(Process):
    """A Kubernetes front door's process: the operator's routes and its metrics (see module rules)."""

    credential: BearerCredential | None
    catalog: Any
    allocator: Any
    executor: Executor
    metrics: MetricSet | None = None

    def initialize(self) -> None:
        self.route("/mark_healthy", OperatorRoutes._mark_healthy_route,
                   help="POST {\"uuid\": ...} with the bearer credential: mark a GPU or MIG device healthy again")
        self.metrics = MetricSet(current_runtime().metrics)
        self.publish(self.metrics)

    def publish(self, metrics: MetricSet) -> None:
        """Add the front door's own counters and routes (at ``initialize``)."""

    def finalize(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.executor.shutdown(wait=False)

    def _operator_refusal(self, request: Any, verb: str, usage: str) -> Response | None:
        """The answer to a request that may not run (see module rules), None when it may."""
        if self.credential is None:
            return Response.error(403, f"this plugin was started without --credential FILE, so no one may {verb};"
                                       " restart it with --listen and --credential")
        if not self.credential.accepts(request.headers):
            logger.warning("%s from %s refused: no valid bearer credential", request.path.rsplit("/", 1)[-1],
                           request.client)
            return BearerCredential.unauthorized()
        if request.method != "POST":
            return Response(f"405 Method Not Allowed: use POST{usage}\n", 405, headers={"Allow": "POST"})
        return None

    async def _mark_healthy_route(self, request: Any) -> Response:
        refused = self._operator_refusal(request, "mark devices healthy", " with {\"uuid\": \"GPU-...\"}")
        if refused is not None:
            return refused
        try:
            body = msgspec.json.decode(request.body, type=MarkHealthy)
        except msgspec.DecodeError as error:
            return Response.error(400, f"expected a JSON body {{\"uuid\": \"<GPU or MIG UUID>\"}}: {error}")
        unit = self.catalog.unit_of_uuid(body.uuid)
        if unit is None:
            return Response.error(404, f"no GPU or MIG device with UUID {body.uuid!r} is offered by this plugin")
        before = (await self.allocator.health_since(None)).unhealthy.get(unit)
        await self.allocator.mark_healthy(unit)
        logger.warning("Operator at %s marked %s (%s) healthy%s", request.client, body.uuid, unit,
                       f" (it was unhealthy: {before})" if before else " (it was healthy)")
        return Response.json({"uuid": body.uuid, "unit": str(unit), "healthy": True, "was_unhealthy": before})
