"""SPEC R-SH-3 for the DRA driver: this release carries on from what release 0.1.0's driver kept, and
rebuilds what it holds from the API server when its checkpoint cannot be read.

The fixture (``writers/dra_driver.py``, written by 0.1.0's own code) is a node whose 0.1.0 driver prepared
claim ``one`` (gpu-0) and ``two`` (gpu-1, gpu-2), unprepared ``gone`` (gpu-3), and stopped on SIGTERM: its
checkpoint, the claims' CDI specs, the node ledger and the API server's ResourceClaims. This release's
``dra-plugin`` (beside its device plugin, as in a node running both) starts on copies of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from actors.ledger import dra_plugin_owner
from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.support.kube_node import DRIVER, NAMESPACE, KubeNode
from tests.support.ledger import leases
from tests.upgrades.kube_fixtures import CORRUPTIONS, corrupt, fixture_dir, running_from, wait_leases

FIXTURE = Path(fixture_dir("0.1.0", "dra_driver"))
DRA_OWNER = dra_plugin_owner(DRIVER)
ONE = (NAMESPACE, "one", "00000001-0100-4000-8000-000000000001")
TWO = (NAMESPACE, "two", "00000002-0100-4000-8000-000000000002")
HELD = {"195:0": (DRA_OWNER, (ONE[2],)), "195:1": (DRA_OWNER, (TWO[2],)), "195:2": (DRA_OWNER, (TWO[2],))}
ALL = [f"gpu-{minor}" for minor in range(8)]


@pytest.fixture
def old_node(tmp_path: Path) -> Iterator[KubeNode]:
    with running_from(FIXTURE, tmp_path) as kube:
        yield kube


def checkpoint_of(kube: KubeNode) -> Path:
    return Path(kube.node.work_dir) / "dra" / DRIVER / "prepared-claims.json"


def spec_files(kube: KubeNode) -> list[str]:
    return sorted(p.name for p in kube.cdi.glob(f"{DRIVER}-claim_*.json"))


def carries_on(kube: KubeNode) -> None:
    """Claims one and two stay prepared and held, their specs there; nothing else is handed out; both
    unprepare, and their units go back."""
    uuid = kube.uuids
    assert kube.prepared() == {ONE[2]: ["gpu-0"], TWO[2]: ["gpu-1", "gpu-2"]}
    assert json.loads(checkpoint_of(kube).read_text())["version"] == 1
    assert spec_files(kube) == [f"{DRIVER}-claim_{ONE[2]}.json", f"{DRIVER}-claim_{TWO[2]}.json"]
    spec = json.loads((kube.cdi / f"{DRIVER}-claim_{TWO[2]}.json").read_text())
    assert [d["name"] for d in spec["devices"]] == [f"{TWO[2]}-gpu-1", f"{TWO[2]}-gpu-2"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"] == f"{kube.node.dev_dir}/nvidia1"
    assert leases(kube.ledger) == HELD
    # the kubelet asking again (a pod's container restarting) gets the same devices
    assert [d["device_name"] for d in kube.prepare(TWO)["devices"]] == ["gpu-1", "gpu-2"]
    # nothing held is handed out: not to a new claim, not to a pod, and the device plugin withholds it
    late = kube.claim(["gpu-1"])
    assert kube.prepare(late) == {"error": (
        f"claim ns/{late[1]} (uid {late[2]}): device gpu-1 (prepared for claim ns/two, uid {TWO[2]}) is not shared"
        " (no adminAccess or shareID), so it cannot be prepared twice; nothing was prepared")}
    with pytest.raises(grpc.RpcError) as refused:
        kube.allocate("p0", [uuid["gpu-0"]])
    assert refused.value.details() == (f"Held by another front door of this node: {uuid['gpu-0']} (195:0) is held by"
                                       f" {DRA_OWNER} (running) for {ONE[2]}; nothing was allocated")
    kube.wait_listed(lambda listed: [listed[uuid[d]] for d in ALL] == ["Unhealthy"] * 3 + ["Healthy"] * 5,
                     "the claims' GPUs withheld by the device plugin")
    kube.wait_slice(lambda devices: devices == ALL, "the slice published (the driver's own claims in it)")
    # and they unprepare
    assert kube.unprepare(ONE) == {} and kube.unprepare(TWO) == {}
    assert kube.prepared() == {} and spec_files(kube) == []
    kube.wait_listed(lambda listed: set(listed.values()) == {"Healthy"}, "every GPU back")
    assert leases(kube.ledger) == {}


def test_prepared_claims_stay_prepared_keep_their_specs_and_units_and_unprepare(old_node: KubeNode) -> None:
    old_node.start()
    assert "ERROR" not in old_node.dra_plugin.log()
    carries_on(old_node)


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_an_unreadable_checkpoint_is_set_aside_and_the_claims_rebuilt_from_the_api_server(
        old_node: KubeNode, how: str) -> None:
    kube = old_node
    checkpoint = checkpoint_of(kube)
    damaged = corrupt(checkpoint, how)
    kube.start(dra=False)
    uuid = kube.uuids
    # meanwhile: pod p5 got gpu-5 from the device plugin, and a claim the API server allocated gpu-5 and gpu-7 (a
    # scheduler that had not heard) was never prepared: the rebuild must not answer it prepared (it keeps gpu-7
    # from others until the kubelet unprepares it: whether a pod uses it, the lost checkpoint knew)
    kube.allocate("p5", [uuid["gpu-5"]])
    stale = kube.claim(["gpu-5", "gpu-7"])
    kube.restart_dra_plugin()  # starts: no crash loop
    log = kube.dra_plugin.log()
    aside = [p for p in checkpoint.parent.iterdir() if p.name.startswith("prepared-claims.json.unreadable-")]
    assert len(aside) == 1 and aside[0].read_bytes() == damaged
    reason = {"truncated": "it is not a JSON object: truncated or not this project's file",
              "garbage": "it is not a JSON object: truncated or not this project's file",
              "unknown-version": "it is in format version 99, and this release reads versions 0, 1"}[how]
    line = next(line for line in log.splitlines() if "Moved it aside" in line)
    assert line.startswith(f"ERROR isolators.kubernetes.dra._rebuild: The prepared-claims checkpoint {checkpoint}:"
                           f" {reason}"), line
    assert line.endswith(f"Moved it aside to {aside[0]} and rebuilt the prepared claims from the ResourceClaims the"
                         " API server allocated to this node: 2 claims"), line
    assert (f"ERROR isolators.kubernetes.dra._plugin: Not prepared again from the API server: claim ns/{stale[1]} (uid"
            f" {stale[2]}): Held by another front door of this node: {uuid['gpu-5']} (195:5) is held by {PLUGIN_OWNER}"
            " (running) for ns/p5/gpu; the kubelet's prepare of it is refused while that holds") in log
    assert kube.prepare(stale)["error"].endswith(
        f"{uuid['gpu-5']} (195:5) is held by {PLUGIN_OWNER} (running) for ns/p5/gpu; nothing was prepared")
    assert leases(kube.ledger)["195:7"] == (DRA_OWNER, (stale[2],))
    assert kube.unprepare(stale) == {}
    kube.remove_pod("p5")
    kube.api.remove_claim(NAMESPACE, stale[1])
    wait_leases(kube, HELD, "gpu-5 back once pod p5 is gone")
    carries_on(kube)


def test_a_claim_keeps_its_other_units_when_the_ledger_refuses_one_of_them(old_node: KubeNode) -> None:
    """SPEC R-SH-3: a lease nobody can read keeps gpu-1 from the driver; claim two stays prepared and keeps
    gpu-2 (before, the start returned it to be handed out again while the claim's pod used it)."""
    kube = old_node
    uuid = kube.uuids
    (Path(kube.ledger) / "units" / f"{uuid['gpu-1']}.lease").write_bytes(b"\x00 not a lease")
    kube.start()
    assert "holds units the node ledger refuses to this driver" in kube.dra_plugin.log()
    assert kube.prepared() == {ONE[2]: ["gpu-0"], TWO[2]: ["gpu-1", "gpu-2"]}
    held = leases(kube.ledger)
    assert held["195:0"] == HELD["195:0"] and held["195:2"] == HELD["195:2"], held
    for gpu in ("gpu-1", "gpu-2"):
        with pytest.raises(grpc.RpcError) as refused:
            kube.allocate(f"pod-{gpu}", [uuid[gpu]])
        assert f"{uuid[gpu]} (195:{gpu[-1]}) is held by" in refused.value.details(), refused.value.details()
    assert kube.unprepare(TWO) == {}
    kube.wait_listed(lambda listed: listed[uuid["gpu-2"]] == "Healthy", "gpu-2 back once claim two is unprepared")
    assert "195:2" not in leases(kube.ledger)
