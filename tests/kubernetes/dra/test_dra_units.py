"""The DRA driver's pure parts: published devices and attributes, the slice, claim checks, the no-double-grant table."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from isolators.kubernetes.dra import (ClaimPlan, ClaimRef, DraCatalog, PlannedDevice, PreparedClaims, check_driver_name,
                           render_slice)
from isolators.kubernetes import PluginSetupError
from actors.file_format import UnreadableFile
from isolators.kubernetes.dra import (CHECKPOINT_VERSION, CheckpointError, PreparedClaim, product_family,
                                      read_checkpoint, semver, write_checkpoint)

from tests.support.dra_kubelet import catalog_of

DATA = Path(__file__).resolve().parents[2] / "inventory" / "data"


def catalog(node: str, **flags: object) -> DraCatalog:
    return catalog_of(DATA / node, **flags)


def test_mixed_mig_devices_are_published_by_minor_gpu_and_compute_instance() -> None:
    published = catalog("h200-mig.toml", nvidia_mig_strategy="mixed", resources="mig-1g.18gb:1")
    # Unit order: a MIG device by its parent's minor; GPU 1 is plain, GPU 3 has MIG on and no device yet.
    assert [d.name for d in published.devices] == ["mig-0-1-0", "mig-0-2-0", "mig-0-3-0", "gpu-1", "mig-2-1-0",
                                                   "mig-2-1-1"]
    mig = published.by_name["mig-0-3-0"]
    assert mig.uuid == "MIG-0f8b2f6c-1a11-5b2e-9c21-000000000003" and mig.memory_mib == 16896
    attributes = mig.attributes
    assert attributes["type"] == ("string", "mig") and attributes["profile"] == ("string", "1g.18gb")
    assert attributes["parentUUID"] == ("string", "GPU-5f0c2a4e-0000-4000-8000-000000000000")
    assert attributes["architecture"] == ("string", "Hopper")
    assert attributes["cudaComputeCapability"] == ("version", "9.0.0")
    assert attributes["driverVersion"] == ("version", "550.90.7")
    assert published.unit_of_uuid(mig.uuid) == mig.unit and published.unit_of_uuid("GPU-nope") is None


def test_islands_are_the_nvlink_components_and_gpus_without_links_are_their_own() -> None:
    dgx = catalog("dgx8-nvlink.toml")
    assert [d.attributes["nvlinkIsland"][1] for d in dgx.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    pcie = catalog("pcie4.toml")
    assert [d.attributes["nvlinkIsland"][1] for d in pcie.devices] == [0, 1, 2, 3]
    assert pcie.devices[0].attributes["architecture"] == ("string", "Ampere")  # RTX A6000
    assert pcie.devices[0].attributes["cudaComputeCapability"] == ("version", "8.6.0")


@pytest.mark.parametrize("name, family", [
    ("Tesla V100-SXM2-32GB", ("Volta", (7, 0))), ("NVIDIA A100-SXM4-80GB", ("Ampere", (8, 0))),
    ("NVIDIA H100 80GB HBM3", ("Hopper", (9, 0))), ("NVIDIA L40S", ("Ada Lovelace", (8, 9))),
    ("Tesla T4", ("Turing", (7, 5))), ("NVIDIA B200", ("Blackwell", (10, 0))), ("Mystery GPU", None),
])
def test_the_product_family_names_architecture_and_compute_capability(name: str, family: object) -> None:
    assert product_family(name) == family


def test_driver_versions_become_semver() -> None:
    assert [semver(v) for v in ("535.161.08", "550.54", "570", "r535", "1.2.3.4")] == [
        "535.161.8", "550.54.0", "570.0.0", None, None]


def test_driver_names_are_dns_subdomains() -> None:
    assert check_driver_name("gpu.isolator.dev") == "gpu.isolator.dev"
    for bad in ("", "GPU.dev", "-gpu.dev", "gpu_isolator", "a" * 64, "gpu..dev"):
        with pytest.raises(ValueError, match="expected a DNS subdomain"):
            check_driver_name(bad)


def test_the_slice_taints_an_unhealthy_device_and_is_the_api_json() -> None:
    dgx = catalog("dgx8-nvlink.toml")
    unit = dgx.by_name["gpu-2"].unit
    document = render_slice(dgx, driver="gpu.isolator.dev", node="n1", generation=7,
                            unhealthy={unit: "Xid 79 (fallen off the bus)"}).to_dict()
    assert document["apiVersion"] == "resource.k8s.io/v1" and document["kind"] == "ResourceSlice"
    assert document["metadata"] == {"name": "n1-gpu.isolator.dev"}
    assert document["spec"]["pool"] == {"name": "n1", "generation": 7, "resourceSliceCount": 1}
    tainted = {d["name"]: d.get("taints") for d in document["spec"]["devices"] if d.get("taints")}
    assert tainted == {"gpu-2": [{"key": "gpu.isolator.dev/unhealthy", "value": "Xid-79-fallen-off-the-bus",
                                  "effect": "NoSchedule"}]}
    json.dumps(document)  # plain JSON


def test_a_node_with_nothing_to_publish_is_a_setup_error() -> None:
    inventory = SimpleNamespace(by_gpu=dict, by_mig=dict, gpus=[], driver_version="1", source="empty")
    with pytest.raises(PluginSetupError, match=r"The node \(empty\) has nothing to publish"):
        DraCatalog.build({"gpus": []}, inventory)


def plan(uid: str, *devices: PlannedDevice) -> ClaimPlan:
    return ClaimPlan(ref=ClaimRef("ns", f"claim-{uid}", uid), devices=list(devices))


def d(device: str, **shared: object) -> PlannedDevice:
    return PlannedDevice(request="r", pool="n1", device=device, **shared)


@pytest.mark.parametrize("held, asked, allowed", [
    (d("gpu-0"), d("gpu-0"), False),
    (d("gpu-0"), d("gpu-1"), True),
    (d("gpu-0"), d("gpu-0", admin_access=True), True),
    (d("gpu-0", admin_access=True), d("gpu-0"), True),
    (d("gpu-0", share_id="a"), d("gpu-0", share_id="b"), True),
    (d("gpu-0", share_id="a"), d("gpu-0"), False),
    (d("gpu-0"), d("gpu-0", share_id="b"), False),
])
def test_a_device_is_granted_twice_only_where_sharing_allows(held: PlannedDevice, asked: PlannedDevice,
                                                             allowed: bool) -> None:
    for prepared in (True, False):  # prepared, or still being prepared (reserved)
        table = PreparedClaims()
        if prepared:
            table.add(PreparedClaim(ref=ClaimRef("ns", "first", "u1"), devices=[_prepared(held)]))
        else:
            table.reserve(plan("u1", held))
        conflicts = table.conflicts(plan("u2", asked))
        assert (conflicts == []) == allowed, (prepared, conflicts)
        assert table.conflicts(plan("u1", held)) == []  # a claim never conflicts with itself


def _prepared(device: PlannedDevice):
    from isolators.kubernetes.dra import PreparedDevice

    return PreparedDevice(request=device.request, pool=device.pool, device=device.device,
                          admin_access=device.admin_access, share_id=device.share_id, cdi_device_ids=["x=y"])


def test_the_checkpoint_round_trips_and_a_malformed_one_is_unreadable_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "dra" / "drv" / "prepared-claims.json"
    assert read_checkpoint(str(path)) == []
    table = PreparedClaims()
    claim = PreparedClaim(ref=ClaimRef("ns", "c", "u1"), devices=[_prepared(d("gpu-3", share_id="s"))])
    write_checkpoint(str(path), table.encode([claim]))
    assert read_checkpoint(str(path)) == [claim]
    assert [p.name for p in path.parent.iterdir()] == ["prepared-claims.json"]  # no temporary left
    assert json.loads(path.read_text())["version"] == CHECKPOINT_VERSION == 1  # SPEC R-SH-3
    path.write_text(path.read_text().replace('"version":1,', ""))  # none written: 0.1.0's reader took it as 1
    assert read_checkpoint(str(path)) == [claim]
    path.write_text("{not json")
    with pytest.raises(UnreadableFile) as unreadable:
        read_checkpoint(str(path))
    assert str(unreadable.value).startswith(f"{path}: it is not a JSON object: truncated or not this project's file")
    path.write_text('{"version": 2, "claims": []}')
    with pytest.raises(UnreadableFile, match=r": it is in format version 2, and this release reads versions 0, 1 \(a"):
        read_checkpoint(str(path))
    path.unlink()
    path.mkdir()  # cannot be read at all (root reads through modes): not a format question, nothing set aside
    with pytest.raises(CheckpointError, match=f"Cannot read the prepared-claims checkpoint {path}: Is a directory"):
        read_checkpoint(str(path))


def test_a_mig_claims_spec_holds_its_parent_and_its_two_capability_nodes() -> None:
    import msgspec

    from actors.mig import read_mig_capabilities
    from isolators.cdi import DriverInjection, NodeFacts
    from isolators.kubernetes.dra import render_claim_spec

    published = catalog("h200-mig.toml", nvidia_mig_strategy="mixed")
    proc = Path(__file__).resolve().parents[3] / "examples" / "h200-mig-proc"
    facts = NodeFacts(control_devices={}, volume=None, injection=DriverInjection(program=("/hook",)), caps=read_mig_capabilities(str(proc)))
    units = [(name, published.by_name[name].unit) for name in ("mig-0-3-0", "gpu-1")]
    spec = msgspec.json.decode(render_claim_spec("gpu.isolator.dev", "u-1", units, published.uuids, facts, "/dev"))
    assert [(d["name"], [n["path"] for n in d["containerEdits"]["deviceNodes"]]) for d in spec["devices"]] == [
        ("u-1-mig-0-3-0", ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31"]),
        ("u-1-gpu-1", ["/dev/nvidia1"])]
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]  # R-DR-3: no claim-wide list


def test_a_commit_whose_checkpoint_landed_is_done_even_when_a_gone_claims_spec_cannot_be_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Once the checkpoint is renamed into place the commit has happened (a restart finds the claims it
    holds): a spec of an unprepared claim that cannot be removed is logged and left for the next start's
    orphan cleanup, never reported as a failed commit (whose claims would be answered unprepared)."""
    import logging

    from isolators.kubernetes.dra._plugin import _commit_files

    specs = tmp_path / "cdi"
    specs.mkdir()
    stuck = "gpu.isolator.dev-claim_5b0e8f2c-0000-4000-8000-000000007a11.json"
    (specs / stuck).mkdir()  # unlink(2) refuses a directory: the removal fails
    checkpoint = tmp_path / "work" / "dra-prepared.json"
    with caplog.at_level(logging.WARNING, logger="isolators.kubernetes.dra._plugin"):
        _commit_files(str(specs), [("gpu.isolator.dev-claim_new.json", b"{}")], str(checkpoint), b"new", [stuck])
    assert checkpoint.read_bytes() == b"new" and (specs / "gpu.isolator.dev-claim_new.json").read_bytes() == b"{}"
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"Unprepared claims' CDI specs not all removed (Failed to remove CDI spec"
                              f" '{specs / stuck}': ") and message.endswith("); the next start removes them")


def test_slice_names_are_dns_subdomains_of_at_most_253_characters_for_any_node() -> None:
    import re

    from isolators.kubernetes.dra import slice_name

    subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    assert slice_name("n1", "gpu.isolator.dev") == "n1-gpu.isolator.dev"  # the usual name, unchanged
    long_a = ".".join(["a" * 63] * 3) + "." + "x" * 61
    long_b = long_a[:-1] + "y"
    for node in (long_a, long_b, "a" * 236 + "." + "b" * 16, "a" * 235 + "-b"):
        name = slice_name(node, "gpu.isolator.dev")
        assert len(name) <= 253 and subdomain.fullmatch(name), name
        assert name == slice_name(node, "gpu.isolator.dev")  # stable across restarts
    assert slice_name(long_a, "gpu.isolator.dev") != slice_name(long_b, "gpu.isolator.dev")
    assert slice_name(long_a, "gpu.isolator.dev") != slice_name(long_a, "gpu2.isolator.dev")


class _Claims:
    """A client whose ``list`` yields stored ResourceClaim documents (as lightkube models), or fails."""

    def __init__(self, documents: list[dict], failure: Exception | None = None) -> None:
        self.documents, self.failure, self.asked = documents, failure, []

    async def list(self, resource: type, namespace: str):
        self.asked.append((resource.__name__, namespace))
        if self.failure is not None:
            raise self.failure
        for document in self.documents:
            yield resource.from_dict(document)


def _claim(name: str, uid: str, *results: dict) -> dict:
    from tests.support.kube_api import FakeApiServer

    return FakeApiServer().add_claim("ns", name, list(results) if results else None, uid=uid)


@pytest.mark.asyncio
async def test_the_claims_of_this_node_are_rebuilt_in_uid_order_never_two_exclusive_on_one_device() -> None:
    """SPEC R-SH-3: what an unreadable checkpoint is rebuilt from."""
    from isolators.kubernetes.dra import claims_of_node
    from tests.support.kube_api import allocation_result as result

    node, driver = "node-1", "gpu.isolator.dev"
    client = _Claims([
        _claim("b", "uid-b", result("gpus", driver, node, "gpu-1")),
        _claim("a", "uid-a", result("gpus", driver, node, "gpu-1"), result("gpus", driver, node, "gpu-2")),
        _claim("watch", "uid-c", result("gpus", driver, node, "gpu-1", admin_access=True)),
        _claim("gone", "uid-d", result("gpus", driver, node, "gpu-99")),
        _claim("other-node", "uid-e", result("gpus", driver, "node-2", "gpu-3")),
        _claim("other-driver", "uid-f", result("gpus", "other.dev", node, "gpu-4")),
        _claim("pending", "uid-g"),  # not allocated
    ])
    rebuilt = await claims_of_node(client, driver=driver, node=node, catalog=catalog("dgx8-nvlink.toml"))
    assert client.asked == [("ResourceClaim", "*")]  # every namespace, one list
    assert [(c.ref.name, [d.device for d in c.devices]) for c in rebuilt.claims] == [
        ("a", ["gpu-1", "gpu-2"]), ("watch", ["gpu-1"])]
    assert rebuilt.claims[0].devices[1].cdi_device_ids == [f"{driver}/claim=uid-a-gpu-2"]
    assert rebuilt.left_out == [
        "claim ns/b (uid uid-b): device gpu-1 (prepared for claim ns/a, uid uid-a) is not shared, so it cannot be"
        " held twice",
        f"claim ns/gone (uid uid-d): device gpu-99 is not one driver {driver} publishes on node {node} (gpu-0, gpu-1,"
        " gpu-2, ...)"]


@pytest.mark.asyncio
async def test_claims_that_cannot_be_listed_are_one_error_naming_the_api_servers_answer() -> None:
    import httpx2

    from isolators.kubernetes.dra import RebuildError, claims_of_node

    request = httpx2.Request("GET", "http://127.0.0.1:9/apis/resource.k8s.io/v1/resourceclaims")
    client = _Claims([], failure=httpx2.ConnectError("Connection refused", request=request))
    with pytest.raises(RebuildError) as failed:
        await claims_of_node(client, driver="gpu.isolator.dev", node="n", catalog=catalog("dgx8-nvlink.toml"))
    assert str(failed.value) == ("cannot list the ResourceClaims: the API server (127.0.0.1:9) could not be reached:"
                                 " ConnectError: Connection refused")


def test_a_rebuilt_checkpoint_that_cannot_be_written_puts_the_unreadable_one_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A missing checkpoint would read as "nothing prepared" at the next start: the unreadable one stays."""
    from isolators.kubernetes.dra import _rebuild

    path = tmp_path / "prepared-claims.json"
    path.write_bytes(b"\x00garbage")

    def full(checkpoint: str, data: bytes) -> None:
        raise CheckpointError(f"Cannot write the prepared-claims checkpoint {checkpoint}: No space left on device")

    monkeypatch.setattr(_rebuild, "write_checkpoint", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        _rebuild.replace_unreadable(str(path), b"{}", UnreadableFile(str(path), "garbage"), 0)
    assert [p.name for p in tmp_path.iterdir()] == ["prepared-claims.json"] and path.read_bytes() == b"\x00garbage"
    assert "Moved it aside" not in caplog.text
