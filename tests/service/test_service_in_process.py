"""The service process in this test's own runtime (no OS process, no
network): the metrics it publishes and gives back."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from isolators.service import GpuIsolatorService
from isolators.simulated_node import SimulatedNode
from runtime import Runtime, current_runtime, dispatch, terminate, wait

pytestmark = pytest.mark.anyio

SERVICE_METRICS = {"service_containers": "gauge", "service_waiting": "gauge", "service_releasing": "gauge",
                   "service_exec_started": "counter", "service_released_when_empty": "counter",
                   "service_refused_by_owner": "counter", "service_refused_by_limit": "counter",
                   "service_unauthorized": "counter"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def service_families() -> dict[str, str]:
    """The service's metric families in the runtime's Prometheus text: {name: type}."""
    text = current_runtime().metrics.prometheus()
    return {family.name: family.type for family in text_string_to_metric_families(text)
            if family.name.startswith("service_")}


async def test_the_service_metrics_are_counters_where_they_count_and_go_with_the_service(tmp_path: Path) -> None:
    node = SimulatedNode(tmp_path / "node", "memory", gpus=2)
    async with Runtime():
        await node.setup()
        components, isolator = await node.start()
        try:
            service = await GpuIsolatorService.create(node.flags(), components, isolator, poll_interval=60.0)
            await dispatch(service.pid, GpuIsolatorService.state)  # it has initialized
            assert service_families() == SERVICE_METRICS
            service.started, service.released_when_empty = 3, 2  # what start and a release count
            snapshot = current_runtime().metrics.snapshot()
            assert (snapshot["service/exec_started"], snapshot["service/released_when_empty"]) == (3, 2)
            terminate(service.pid)
            await wait(service.pid)
            assert service_families() == {}
            assert not [name for name in current_runtime().metrics.names() if name.startswith("service/")]
        finally:
            await node.close()
