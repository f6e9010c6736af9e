"""The DRA driver's Kubernetes client (lightkube) through a kubeconfig, against the fake API server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import pytest

from isolators.kubernetes.dra import DraSetupError, api_failure, kube_client

from tests.support.kube_api import FakeApiServer, allocation_result


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("text, why", [
    (None, "Configuration file {path} not found"),
    ("clusters: [\n", "not a valid kubeconfig (ParserError: while parsing a flow node expected the node content"),
    ("- just a list\n", "not a valid kubeconfig"),
    ("clusters: []\ncontexts: []\n", "No current context set"),
    ("current-context: x\nclusters: []\ncontexts: []\n", "Context 'x' not found"),
    ("current-context: x\nclusters: []\ncontexts: [{name: x, context: {cluster: gone}}]\n",
     "not a valid kubeconfig (missing 'gone')"),
])
def test_a_bad_kubeconfig_is_one_error_naming_the_file_and_why(tmp_path: Path, text: str | None, why: str) -> None:
    path = tmp_path / "kubeconfig"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DraSetupError) as raised:
        kube_client(str(path))
    assert f"Cannot use the kubeconfig {str(path)!r}: " in str(raised.value)
    assert why.format(path=path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_without_a_kubeconfig_outside_a_pod_it_says_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(DraSetupError, match="No --kubeconfig given and not running in a pod .* pass --kubeconfig=FILE"):
        kube_client(None)


def test_the_real_client_reads_a_claim_in_v1_json_and_a_slow_server_times_out(api: FakeApiServer,
                                                                             tmp_path: Path) -> None:
    from lightkube.resources.resource_v1 import ResourceClaim

    api.add_claim("ns", "two-gpus", [allocation_result("gpus", "gpu.isolator.dev", "node-a", "gpu-0"),
                                     allocation_result("gpus", "gpu.isolator.dev", "node-a", "gpu-1")], uid="uid-1")

    async def scenario() -> tuple[object, str, str]:
        client = kube_client(str(api.kubeconfig(tmp_path / "kubeconfig")), timeout_s=0.5)
        claim = await client.get(ResourceClaim, "two-gpus", namespace="ns")
        try:
            await client.get(ResourceClaim, "missing", namespace="ns")
        except Exception as error:  # noqa: BLE001
            missing = api_failure(error)
        api.delay_s = 2.0
        try:
            await client.get(ResourceClaim, "two-gpus", namespace="ns")
        except Exception as error:  # noqa: BLE001
            slow = api_failure(error)
        return claim, missing, slow

    claim, missing, slow = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert claim.metadata.uid == "uid-1"
    assert [(r.pool, r.device) for r in claim.status.allocation.devices.results] == [("node-a", "gpu-0"),
                                                                                      ("node-a", "gpu-1")]
    assert missing == 'the API server answered 404 NotFound: resourceclaims.resource.k8s.io "missing" not found'
    assert slow == f"the API server ({api.address}) could not be reached: ReadTimeout: timed out"
