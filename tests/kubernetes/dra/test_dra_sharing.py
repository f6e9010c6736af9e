"""SPEC R-MP-5's pure parts: the slice of a sharing driver (consumable capacity valid against Kubernetes'
schemas and its API server's validation), the scheduler's arithmetic the fake API server plays (facts from
k8s.io/dynamic-resource-allocation/structured), and the limits a share is prepared with."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

from isolators.kubernetes.dra import (ClaimRef, ClaimRefused, ShareLimits, over_capacity, plan_claim, render_slice,
                                      share_limits)
from isolators.kubernetes.dra._sharing import MEMORY_STEP_MIB, capacity_of

from tests.support.docs import KUBERNETES_VERSION, check_kubernetes
from tests.support.dra_kubelet import catalog_of
from tests.support.dra_scheduler import Unschedulable, capacity_errors, consumed_capacity, format_quantity
from tests.support.kube_api import FakeApiServer

DATA = Path(__file__).resolve().parents[2] / "inventory" / "data"
DRIVER = "gpu.isolator.dev"
GI = 1 << 30


def sharing_slice(node: str = "n1", host: str = "dgx8-nvlink.toml", **flags: object) -> dict:
    catalog = catalog_of(DATA / host, "mps", **flags)
    return render_slice(catalog, driver=DRIVER, node=node, generation=1, unhealthy={}).to_dict()


def test_a_sharing_slice_offers_every_unit_once_for_shares_with_two_consumable_capacities() -> None:
    document = sharing_slice()
    devices = document["spec"]["devices"]
    assert [d["name"] for d in devices] == [f"gpu-{i}" for i in range(8)]  # once each: never also whole
    gpu = devices[0]
    assert gpu["allowMultipleAllocations"] is True
    assert gpu["capacity"] == {
        "memory": {"value": "32768Mi", "requestPolicy": {
            "default": "32768Mi", "validRange": {"min": "256Mi", "max": "32768Mi", "step": "256Mi"}}},
        "compute": {"value": "100", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}},
    }
    check_kubernetes(json.loads(json.dumps(document)), "the sharing slice")  # strict, Kubernetes 1.34.0
    assert KUBERNETES_VERSION == "1.34.0"
    assert capacity_errors(document) == []  # what the API server validates beyond the schema


def test_without_sharing_the_slice_is_as_before() -> None:
    catalog = catalog_of(DATA / "dgx8-nvlink.toml")
    device = render_slice(catalog, driver=DRIVER, node="n1", generation=1, unhealthy={}).to_dict()["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in device and device["capacity"] == {"memory": {"value": "32768Mi"}}


def test_mig_devices_are_shared_too_and_their_memory_range_is_whole_steps() -> None:
    document = sharing_slice(host="h200-mig.toml", nvidia_mig_strategy="mixed", resources="mig-1g.18gb:1")
    mig = next(d for d in document["spec"]["devices"] if d["name"] == "mig-0-3-0")
    assert mig["allowMultipleAllocations"] is True
    assert mig["capacity"]["memory"]["value"] == "16896Mi"
    assert mig["capacity"]["memory"]["requestPolicy"]["validRange"]["max"] == "16896Mi"  # 66 steps of 256Mi
    assert capacity_errors(document) == []
    check_kubernetes(json.loads(json.dumps(document)), "the sharing slice of MIG devices")


def test_a_unit_too_small_for_two_shares_is_published_exclusive() -> None:
    assert capacity_of(2 * MEMORY_STEP_MIB - 1, "mps") == {"memory": {"value": "511Mi"}}
    # an odd size: the range ends on the last whole step below it, which the API server accepts
    odd = {"spec": {"devices": [{"name": "g", "capacity": capacity_of(40537, "mps")}]}}
    assert odd["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] == "40448Mi"
    assert capacity_errors(odd) == []


def test_the_fake_api_server_refuses_request_policies_as_kubernetes_validates_them() -> None:
    bad = {"spec": {"devices": [{"name": "g", "capacity": {
        "memory": {"value": "1Gi", "requestPolicy": {"default": "300Mi",
                                                     "validRange": {"min": "256Mi", "max": "2Gi", "step": "256Mi"}}},
        "compute": {"value": "100", "requestPolicy": {"validValues": ["50", "25"]}}}}]}}
    assert capacity_errors(bad) == [
        'spec.devices[0].capacity[memory].requestPolicy.validRange.max: Invalid value: "2Gi": max is larger than'
        ' capacity value: 1Gi',
        'spec.devices[0].capacity[memory].requestPolicy.validRange.step: Invalid value: "300Mi": value is not a'
        ' multiple of a given step (256Mi) from (256Mi)',
        "spec.devices[0].capacity[compute].requestPolicy.default: Required value: required when validValues is"
        " defined",
    ]


# -- the scheduler's arithmetic (consumable_capacity.go) ------------------------------------------------------
MEMORY = capacity_of(32768, "mps")


@pytest.mark.parametrize("requests, memory, compute", [
    (None, 32 * GI, 0),  # nothing asked: each capacity's default
    ({"memory": "10Gi"}, 10 * GI, 0),
    ({"memory": "1000Mi"}, 1024 << 20, 0),  # rounded up to the next whole step from min
    ({"memory": "100Mi"}, 256 << 20, 0),  # below min: min
    ({"memory": "10Gi", "compute": "30.5"}, 10 * GI, 31),
    ({f"{DRIVER}/memory": "2Gi"}, 2 * GI, 0),  # qualified with the driver: the same capacity
])
def test_consumed_capacity_is_the_request_rounded_by_its_policy_or_the_default(requests, memory, compute) -> None:
    consumed = consumed_capacity(requests, MEMORY, DRIVER)
    assert consumed == {"memory": Decimal(memory), "compute": Decimal(compute)}


@pytest.mark.parametrize("requests", [{"memory": "33Gi"}, {"compute": "101"}, {"bandwidth": "1"},
                                      {"example.com/memory": "1Gi"}])
def test_a_request_past_the_policy_or_of_another_capacity_does_not_fit(requests) -> None:
    assert consumed_capacity(requests, MEMORY, DRIVER) is None


def test_valid_values_round_up_to_the_next_and_nothing_past_the_last() -> None:
    capacity = {"slots": {"value": "8", "requestPolicy": {"default": "1", "validValues": ["1", "2", "4"]}}}
    assert consumed_capacity({"slots": "3"}, capacity, DRIVER) == {"slots": Decimal(4)}
    assert consumed_capacity({"slots": "5"}, capacity, DRIVER) is None
    assert consumed_capacity({}, {"n": {"value": "8"}}, DRIVER) == {"n": Decimal(8)}  # no policy: all of it


def test_quantities_are_written_in_canonical_form() -> None:
    assert [format_quantity(Decimal(v), b) for v, b in ((10 * GI, True), (1536 << 20, True), (30, False),
                                                        (1500 * 10 ** 6, False), (Decimal("0.5"), False), (0, True))
            ] == ["10Gi", "1536Mi", "30", "1500M", "500m", "0"]


def test_the_scheduler_packs_shares_on_a_device_until_its_capacity_and_never_hands_it_out_whole() -> None:
    api = FakeApiServer()
    document = sharing_slice()
    api.resource_slices[document["metadata"]["name"]] = document
    first = api.allocate("ns", "a", driver=DRIVER, node="n1", requests={"memory": "10Gi", "compute": "60"})
    second = api.allocate("ns", "b", driver=DRIVER, node="n1", requests={"memory": "20Gi", "compute": "40"})
    third = api.allocate("ns", "c", driver=DRIVER, node="n1", requests={"memory": "4Gi", "compute": "1"})
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in (first, second, third)]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-0", "gpu-1"]  # compute on gpu-0 is 100 % taken
    assert [r["consumedCapacity"] for r in results] == [
        {"memory": "10Gi", "compute": "60"}, {"memory": "20Gi", "compute": "40"}, {"memory": "4Gi", "compute": "1"}]
    assert len({r["shareID"] for r in results}) == 3
    assert first["spec"]["devices"]["requests"][0]["exactly"]["capacity"] == {
        "requests": {"memory": "10Gi", "compute": "60"}}
    check_kubernetes(json.loads(json.dumps(first)), "the allocated claim")
    # a claim asking nothing takes a whole unit's memory: only a unit without shares fits it
    whole = api.allocate("ns", "d", driver=DRIVER, node="n1")
    assert whole["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-2"
    for name in "efghij":  # gpu-1 (beside its 4Gi share) and gpu-3..7
        api.allocate("ns", name, driver=DRIVER, node="n1", requests={"memory": "28Gi" if name == "e" else "30Gi"})
    with pytest.raises(Unschedulable, match=r"claim ns/z asking \{'memory': '3Gi'\} .* no device fits \(gpu-0"
                                            r" \(memory: 33Gi past 32768Mi\); gpu-1 \(memory: 35Gi past 32768Mi\);"
                                            r" gpu-2 \(memory: 35Gi past"):
        api.allocate("ns", "z", driver=DRIVER, node="n1", requests={"memory": "3Gi"})
    assert ("ns", "z") not in api.claims


# -- what prepare enforces -------------------------------------------------------------------------------------
def result(device: str = "gpu-0", **fields: object) -> SimpleNamespace:
    values = {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": device, "adminAccess": None,
              "shareID": "0b3f1c2e-1111-4222-8333-444455556666", "consumedCapacity": {"memory": "10Gi"}}
    values.update(fields)
    return SimpleNamespace(**values)


def claim(*results: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(uid="u1"), status=SimpleNamespace(allocation=SimpleNamespace(
        devices=SimpleNamespace(results=list(results), config=None))))


REF = ClaimRef("ns", "share", "u1")


def test_a_share_is_limited_to_exactly_its_consumed_capacity() -> None:
    catalog = catalog_of(DATA / "dgx8-nvlink.toml", "mps")
    plan = plan_claim(REF, claim(result(consumedCapacity={"memory": "10Gi", "compute": "25"}),
                                 result("gpu-1", consumedCapacity={f"{DRIVER}/memory": "1536Mi", "compute": "0"})),
                      driver=DRIVER, node="n1", catalog=catalog)
    assert [d.share for d in plan.devices] == [ShareLimits(memory_bytes=10 * GI, thread_percent=25),
                                               ShareLimits(memory_bytes=1536 << 20, thread_percent=None)]
    watcher = plan_claim(REF, claim(result(adminAccess=True, shareID=None, consumedCapacity=None)), driver=DRIVER,
                         node="n1", catalog=catalog)
    assert watcher.devices[0].share is None  # adminAccess watches: no share, no limits


@pytest.mark.parametrize("fields, why", [
    ({"shareID": None, "consumedCapacity": None}, "its allocation has no shareID and consumedCapacity memory: the"
                                                  " cluster allocated it whole. Enable the DRAConsumableCapacity"
                                                  " feature gate on the API server and the scheduler, or run the"
                                                  " driver with --sharing=none"),
    ({"consumedCapacity": {"compute": "10"}}, "its allocation has no consumedCapacity memory"),
    ({"consumedCapacity": {"memory": "33Gi"}}, "consumedCapacity memory 33Gi is not a whole number of bytes between"
                                               " 1 and the device's 32768Mi"),
    ({"consumedCapacity": {"memory": "1Gi", "compute": "150"}}, "consumedCapacity compute 150 is not a whole"
                                                                " percentage from 0 to 100"),
    ({"consumedCapacity": {"memory": "lots"}}, "consumedCapacity memory 'lots' is not a Kubernetes quantity"),
])
def test_a_result_that_is_no_share_is_refused_naming_why(fields: dict, why: str) -> None:
    catalog = catalog_of(DATA / "dgx8-nvlink.toml", "mps")
    with pytest.raises(ClaimRefused) as refused:
        plan_claim(REF, claim(result(**fields)), driver=DRIVER, node="n1", catalog=catalog)
    assert str(refused.value).startswith("claim ns/share (uid u1): device gpu-0")
    assert why in str(refused.value) and str(refused.value).endswith("; nothing was prepared")


def test_the_driver_checks_the_sums_the_scheduler_promises() -> None:
    held = [ShareLimits(memory_bytes=20 * GI, thread_percent=70)]
    assert over_capacity("gpu-0", 32768, ShareLimits(memory_bytes=12 * GI, thread_percent=30), held) is None
    assert over_capacity("gpu-0", 32768, ShareLimits(memory_bytes=13 * GI), held) == (
        "device gpu-0: this share's 13958643712 bytes of memory and the 1 shares prepared there sum to 35433480192"
        " bytes, past the device's 32768Mi")
    assert over_capacity("gpu-0", 32768, ShareLimits(memory_bytes=GI, thread_percent=31), held) == (
        "device gpu-0: this share's 31 % of the threads and the 1 shares prepared there sum to 101 %, past 100 %")


def test_share_limits_accept_a_memory_of_the_device_exactly() -> None:
    assert share_limits("gpu-0", 32768, "id", {"memory": "32Gi"}, DRIVER) == ShareLimits(memory_bytes=32 * GI)


def test_a_unit_with_live_shares_is_offered_only_for_shares_of_their_limits() -> None:
    """MPS holds one set of limits per unit: the slice narrows a shared unit's policies to its live shares'
    limits (valid against the schemas and the API server), and the scheduler then rounds a smaller request up
    to them and does not put a larger one there."""
    catalog = catalog_of(DATA / "dgx8-nvlink.toml", "mps")
    live = {"gpu-0": ShareLimits(memory_bytes=10 * GI, thread_percent=30), "gpu-1": ShareLimits(memory_bytes=GI)}
    document = render_slice(catalog, driver=DRIVER, node="n1", generation=1, unhealthy={}, shares=live).to_dict()
    devices = {d["name"]: d["capacity"] for d in document["spec"]["devices"]}
    assert devices["gpu-0"] == {
        "memory": {"value": "32768Mi", "requestPolicy": {"default": "10240Mi", "validValues": ["10240Mi"]}},
        "compute": {"value": "100", "requestPolicy": {"default": "30", "validValues": ["30"]}}}
    assert devices["gpu-1"]["compute"]["requestPolicy"] == {"default": "0", "validValues": ["0"]}
    assert devices["gpu-2"] == capacity_of(32768, "mps")  # no share: any
    check_kubernetes(json.loads(json.dumps(document)), "a slice with live shares")
    assert capacity_errors(document) == []
    assert consumed_capacity({"memory": "1Gi"}, devices["gpu-0"], DRIVER) == {"memory": Decimal(10 * GI),
                                                                               "compute": Decimal(30)}
    assert consumed_capacity({"memory": "11Gi"}, devices["gpu-0"], DRIVER) is None
    assert consumed_capacity({"compute": "40"}, devices["gpu-0"], DRIVER) is None


def test_live_shares_tell_the_publisher_only_of_a_change() -> None:
    from isolators.kubernetes.dra._sharing import LiveShares

    live, heard = LiveShares(), []
    live.watch(lambda: heard.append(dict(live.limits)))
    share = ShareLimits(memory_bytes=GI)
    device = SimpleNamespace(device="gpu-0", share=share)
    live.update([device, SimpleNamespace(device="gpu-0", share=share), SimpleNamespace(device="gpu-1", share=None)])
    live.update([device])
    live.update([])
    assert heard == [{"gpu-0": share}, {}]


def test_with_mps_replicas_every_unit_is_n_equal_shares_whatever_a_claim_asks() -> None:
    """``--mps_replicas 4``: one size a unit (a quarter of its memory in whole steps, 25 % of its threads), so
    the scheduler rounds every request up to it and claims allocated at once cannot ask one unit for different
    limits; the slice stays valid against Kubernetes' schemas and its API server's checks."""
    document = sharing_slice(mps_replicas=4)
    quarter = {"memory": {"value": "32768Mi", "requestPolicy": {"default": "8192Mi", "validValues": ["8192Mi"]}},
               "compute": {"value": "100", "requestPolicy": {"default": "25", "validValues": ["25"]}}}
    assert all(d["capacity"] == quarter and d["allowMultipleAllocations"] for d in document["spec"]["devices"])
    check_kubernetes(json.loads(json.dumps(document)), "the sharing slice of 4 shares a GPU")
    assert capacity_errors(document) == []
    capacity = document["spec"]["devices"][0]["capacity"]
    for requests in (None, {"memory": "5Gi"}, {"memory": "100Mi", "compute": "10"}, {"memory": "8Gi"}):
        assert consumed_capacity(requests, capacity, DRIVER) == {"memory": Decimal(8 * GI), "compute": Decimal(25)}
    for requests in ({"memory": "9Gi"}, {"compute": "30"}):
        assert consumed_capacity(requests, capacity, DRIVER) is None  # past the one share: not on this unit
    # odd sizes end on a whole step below their share; a share under one step is no share: the unit is exclusive
    assert capacity_of(40537, "mps", replicas=3)["memory"]["requestPolicy"]["validValues"] == ["13312Mi"]
    assert capacity_of(1000, "mps", replicas=4) == {"memory": {"value": "1000Mi"}}
    mig = sharing_slice(host="h200-mig.toml", nvidia_mig_strategy="mixed", resources="mig-1g.18gb:1", mps_replicas=8)
    small = next(d for d in mig["spec"]["devices"] if d["name"] == "mig-0-3-0")
    assert small["capacity"]["memory"]["requestPolicy"] == {"default": "2048Mi", "validValues": ["2048Mi"]}
    assert small["capacity"]["compute"]["requestPolicy"] == {"default": "12", "validValues": ["12"]}
