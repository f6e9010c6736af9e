"""SPEC R-SH-3 for the device plugin: this release carries on from what release 0.1.0's plugin kept.

What the device plugin keeps on disk: no state file of its own. Its pods' units are leases of its owner
(``kubelet-plugin:nvidia.com/gpu``) in the node ledger, with the pods as holders, and PodResources is the
truth it reconciles them from each pass (R-NL-3/4); the CDI node spec (``gpu-isolator-node.json``) is
derived from the inventory and written again at every start when it differs; its socket and the
``/dev/char`` links are made again at every start. The ledger's own files (format versions, an unreadable
lease) are the ledger's tests'.

The fixture (``writers/device_plugin.py``, written by 0.1.0's own code) is a node whose 0.1.0 plugin
allocated gpu-0 to pod ``p1`` and gpu-1, gpu-2 to ``p2`` (and gpu-3 to ``gone``, which ended), then stopped
on SIGTERM: its ledger, its CDI node spec and what PodResources listed. This release's ``kubelet-plugin``
(beside its DRA driver, as on a node running both) starts on copies of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest

from isolators.kubernetes.device_plugin import PLUGIN_OWNER
from tests.support.kube_node import KubeNode
from tests.support.ledger import leases
from tests.upgrades.kube_fixtures import corrupt, fixture_dir, running_from, wait_leases

FIXTURE = Path(fixture_dir("0.1.0", "device_plugin"))
HELD = {"195:0": (PLUGIN_OWNER, ("ns/p1/gpu",)), "195:1": (PLUGIN_OWNER, ("ns/p2/gpu",)),
        "195:2": (PLUGIN_OWNER, ("ns/p2/gpu",))}
ALL = [f"gpu-{minor}" for minor in range(8)]


@pytest.fixture
def old_node(tmp_path: Path) -> Iterator[KubeNode]:
    with running_from(FIXTURE, tmp_path) as kube:
        yield kube


def test_the_pods_stay_the_plugins_own_and_nothing_they_hold_is_handed_out(old_node: KubeNode) -> None:
    kube = old_node
    assert leases(kube.ledger) == HELD  # as 0.1.0 left them
    kube.start()
    uuid = kube.uuids
    kube.wait_listed(lambda listed: set(listed.values()) == {"Healthy"} and len(listed) == 8,
                     "every GPU listed: the pods' are the plugin's own, the kubelet knows them")
    kube.wait_slice(lambda devices: devices == ALL[3:], "the pods' GPUs left out of the DRA slice")
    calls = kube.pod_resources.calls
    deadline = time.monotonic() + 10
    while kube.pod_resources.calls < calls + 2:  # a whole pass after the ones above: List, reconcile, List
        assert time.monotonic() < deadline, "no two passes within 10s"
        time.sleep(0.02)
    assert leases(kube.ledger) == HELD  # the same owner, the same holders, after this release's passes
    assert "ERROR" not in kube.device_plugin.log() + kube.dra_plugin.log()
    # nothing a pod holds is handed out to another front door
    late = kube.claim(["gpu-1"])
    assert kube.prepare(late) == {"error": (
        f"claim ns/{late[1]} (uid {late[2]}): Held by another front door of this node: {uuid['gpu-1']} (195:1) is"
        f" held by {PLUGIN_OWNER} (running) for ns/p2/gpu; nothing was prepared")}
    # the plugin goes on allocating what is free, and gives back what a pod no longer holds
    kube.allocate("p3", [uuid["gpu-3"]])
    kube.remove_pod("p2")
    wait_leases(kube, {"195:0": HELD["195:0"], "195:3": (PLUGIN_OWNER, ("ns/p3/gpu",))}, "p2's GPUs back, p3's held")
    kube.wait_slice(lambda devices: devices == ["gpu-1", "gpu-2", *ALL[4:]], "p2's GPUs back in the slice")
    kube.remove_pod("p1")
    kube.remove_pod("p3")
    wait_leases(kube, {}, "every GPU back once no pod holds it")


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_cdi_node_spec_is_written_again_and_the_names_it_answers_resolve(old_node: KubeNode,
                                                                                    how: str) -> None:
    kube = old_node
    spec = kube.cdi / "gpu-isolator-node.json"
    corrupt(spec, how)
    kube.start(dra=False)
    written = json.loads(spec.read_text())
    answer = kube.allocate("p3", [kube.uuids["gpu-3"]])
    [name] = [device.name for device in answer.cdi_devices]
    kind, _, device = name.partition("=")
    assert kind == written["kind"] and device in {d["name"] for d in written["devices"]}
    [node] = next(d for d in written["devices"] if d["name"] == device)["containerEdits"]["deviceNodes"]
    assert node["path"] == "/dev/nvidia3" and node["hostPath"] == f"{kube.node.dev_dir}/nvidia3"
    wait_leases(kube, {**HELD, "195:3": (PLUGIN_OWNER, ("ns/p3/gpu",))}, "the pods' GPUs held, p3's too")


def test_a_pods_units_stay_held_when_the_ledger_refuses_one_of_them(old_node: KubeNode) -> None:
    """SPEC R-SH-3: a lease nobody can read keeps gpu-1 from the plugin; pod p2's other GPU, gpu-2, stays the
    plugin's (it never goes back to be handed out again), and neither is handed to another front door."""
    kube = old_node
    uuid = kube.uuids
    lease = Path(kube.ledger) / "units" / f"{uuid['gpu-1']}.lease"
    lease.write_bytes(b"\x00 not a lease")
    kube.start()
    kube.device_plugin.wait_log("but the node ledger refuses them to this plugin")
    calls = kube.pod_resources.calls
    deadline = time.monotonic() + 10
    while kube.pod_resources.calls < calls + 2:  # a whole pass after the refusal
        assert time.monotonic() < deadline, "no two passes within 10s"
        time.sleep(0.02)
    held = leases(kube.ledger)
    assert held["195:0"] == HELD["195:0"] and held["195:2"] == HELD["195:2"], held
    for gpu in ("gpu-1", "gpu-2"):
        late = kube.claim([gpu])
        error = kube.prepare(late)["error"]
        assert f"{uuid[gpu]} (195:{gpu[-1]}) is held by" in error and error.endswith("nothing was prepared"), error
