"""Pod repair's decisions (SPEC section 20, R-PR-2..5) on a node in memory and the fake PodResources server
(the official proto over a real unix socket); the kernel's side is ``test_pod_repair_kernel.py``.

Shown here: the kubepods names of both cgroup drivers and the runtime's record read right (and nothing else
read as a container); a reloaded container given back exactly its GPUs and the control devices, another
container's and a GPU-less container's rules untouched; sources that disagree, IDs never offered and a
container that ended granting nothing, each logged once; PodResources missing or refusing answered as
waiting (said once) until it answers again; the ``/dev/char`` links made, and one pointing elsewhere left.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import grpc
import msgspec
import pytest

from actors.devices import DeviceRule
from actors.gpu import Gpu
from isolators.kubernetes.device_plugin import DeviceCatalog, OfferedDevice, ResourceOffer
from isolators.kubernetes.pod_repair import (AssignedDevices, PodRepair, PodResourcesClient, ensure_char_links,
                                             parse_container_cgroup, read_identity)
from isolators.kubernetes.pod_repair import SystemdScopes
from isolators.kubernetes.pod_repair.testing import (FakePodResources, MemoryPodHost, StandInScope, SystemdStandIn,
                                                     rules_of)

from tests.support.services import ROOT

GPU = "nvidia.com/gpu"
UUIDS = [f"GPU-0000000{i}-1111-4222-8333-44444444444{i}" for i in range(4)]
CONTROL = {"/dev/nvidiactl": DeviceRule.parse("c 195:255 rwm"), "/dev/nvidia-uvm": DeviceRule.parse("c 235:0 rwm")}
POD_UID = "0b4cc7a4-3c1e-4d59-9b5b-6c2b1e0f8a11"
CID = "3f" * 32
LOGGER = "isolators.kubernetes.pod_repair._repair"


def catalog(gpus: int = 4) -> DeviceCatalog:
    devices = [OfferedDevice(id=uuid, unit=Gpu(195, i), uuid=uuid) for i, uuid in enumerate(UUIDS[:gpus])]
    return DeviceCatalog([ResourceOffer(GPU, "gpus", devices)], 1)


@pytest.fixture
def pod_resources() -> Iterator[FakePodResources]:
    directory = tempfile.mkdtemp(prefix="k8s-pr-", dir="/tmp")
    server = FakePodResources(os.path.join(directory, "kubelet.sock")).start()
    try:
        yield server
    finally:
        server.close()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def repair_on(server: FakePodResources, host: MemoryPodHost, dev_dir: str = "/dev") -> PodRepair:
    return PodRepair(catalog(), PodResourcesClient(server.socket, timeout_s=5), host, control_devices=CONTROL,
                     dev_dir=dev_dir)


def assign(namespace: str, pod: str, container: str, *ids: str) -> AssignedDevices:
    return AssignedDevices(namespace=namespace, pod=pod, container=container, resource=GPU, ids=ids)


# -- names -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [
    f"kubepods-besteffort.slice/kubepods-besteffort-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope",
    f"kubepods-burstable.slice/kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/crio-{CID}.scope",
    f"kubepods-pod{POD_UID.replace('-', '_')}.slice/docker-{CID}.scope",
    f"besteffort/pod{POD_UID}/{CID}",
    f"burstable/pod{POD_UID}/crio-{CID}",
    f"pod{POD_UID}/{CID}",
])
def test_both_drivers_container_cgroups_name_pod_uid_and_container_id(path: str) -> None:
    assert parse_container_cgroup(path) == (POD_UID, CID)


@pytest.mark.parametrize("path", [
    f"kubepods-besteffort.slice/kubepods-besteffort-pod{POD_UID.replace('-', '_')}.slice/crio-conmon-{CID}.scope",
    f"besteffort/pod{POD_UID}",
    f"besteffort/pod{POD_UID}/../../{CID}",
    f"besteffort/pod{POD_UID}/{CID[:-1]}",
    f"besteffort/pod{POD_UID.upper()}/{CID}",
    f"guaranteed/pod{POD_UID}/{CID}",
])
def test_anything_else_is_no_container(path: str) -> None:
    assert parse_container_cgroup(path) is None


def test_the_runtimes_record_names_the_container_for_containerd_and_cri_o(tmp_path: Path) -> None:
    containerd = tmp_path / "containerd.json"
    containerd.write_text(json.dumps({"annotations": {
        "io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.sandbox-name": "train-0", "io.kubernetes.cri.sandbox-uid": POD_UID,
        "io.kubernetes.cri.container-name": "cuda"}}))
    crio = tmp_path / "crio.json"
    crio.write_text(json.dumps({"annotations": {
        "io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.name": "train-0", "io.kubernetes.pod.uid": POD_UID,
        "io.kubernetes.container.name": "cuda"}}))
    sandbox = tmp_path / "sandbox.json"
    sandbox.write_text(json.dumps({"annotations": {
        "io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.sandbox-name": "train-0", "io.kubernetes.cri.container-name": "pause"}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path in (containerd, crio):
        identity = read_identity(str(path))
        assert (identity.namespace, identity.pod, identity.pod_uid, identity.container) == (
            "ml", "train-0", POD_UID, "cuda")
    assert read_identity(str(sandbox)) is None
    assert read_identity(str(broken)) is None
    assert read_identity(str(tmp_path / "absent.json")) is None


# -- /dev/char ---------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_char_links_are_made_once_and_a_link_pointing_elsewhere_is_left(tmp_path: Path) -> None:
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        os.mknod(tmp_path / name, stat.S_IFCHR | 0o666, os.makedev(195, minor))
    (tmp_path / "char").mkdir()
    os.symlink("../somewhere-else", tmp_path / "char" / "195:1")
    repair = PodRepair(catalog(2), PodResourcesClient("/nonexistent"), MemoryPodHost(),
                       control_devices={str(tmp_path / "nvidiactl"): DeviceRule.parse("c 195:255 rwm")},
                       dev_dir=str(tmp_path))
    links = ensure_char_links(str(tmp_path), repair.all_nodes)
    assert sorted(links.made) == [str(tmp_path / "char" / "195:0"), str(tmp_path / "char" / "195:255")]
    assert links.refused == [(str(tmp_path / "char" / "195:1"), "it points at '../somewhere-else', not at"
                                                                f" {tmp_path / 'nvidia1'}")]
    assert os.readlink(tmp_path / "char" / "195:0") == "../nvidia0"
    assert os.readlink(tmp_path / "char" / "195:1") == "../somewhere-else"
    assert os.stat(tmp_path / "char" / "195:255").st_rdev == os.makedev(195, 255)
    again = ensure_char_links(str(tmp_path), repair.all_nodes)
    assert again.made == [] and len(again.kept) == 2 and len(again.refused) == 1
    repair.close()


# -- passes ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_reloaded_container_gets_exactly_its_gpus_and_the_control_devices_back(
        pod_resources: FakePodResources, caplog: pytest.LogCaptureFixture) -> None:
    host = MemoryPodHost()
    repair = repair_on(pod_resources, host)
    train = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0), Gpu(195, 2)]))
    other = host.add("ml", "train-1", "cuda", repair.nodes_of([Gpu(195, 1)]))
    plain = host.add("web", "front", "nginx", [])
    pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0], UUIDS[2]),
                                 assign("ml", "train-1", "cuda", UUIDS[1])]
    first = await repair.run_pass()
    assert (first.checked, first.repaired, first.failed, host.writes) == (2, [], [], [])
    host.reload(train.container_id)
    host.reload(plain.container_id)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = await repair.run_pass()
    assert msgspec.to_builtins(result.answer()) == {"checked": 2, "failed": [], "repaired": [
        {"pod": "train-0", "namespace": "ml", "container": "cuda", "gpus": [UUIDS[0], UUIDS[2]]}]}
    assert [cid for cid, _ in host.writes] == [train.container_id]
    assert set(host.writes[0][1]) == {DeviceRule.parse(rule) for rule in
                                      ("c 195:0 rwm", "c 195:2 rwm", "c 195:255 rwm", "c 235:0 rwm")}
    assert train.granted == train.given and other.granted == other.given and plain.granted == set()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Repaired"))
    assert line.startswith(f"Repaired pod ml/train-0 container cuda ({train.container_id[:12]}, GPUs {UUIDS[0]},"
                           f" {UUIDS[2]}): the kernel refused c 195:0 rwm, c 195:2 rwm, c 195:255 rwm, c 235:0 rwm")
    assert (repair.passes, repair.repaired, repair.failures, pod_resources.calls) == (2, 1, 0, 2)
    repair.close()


@pytest.mark.asyncio
async def test_sources_that_disagree_grant_nothing_and_are_said_once(
        pod_resources: FakePodResources, caplog: pytest.LogCaptureFixture) -> None:
    host = MemoryPodHost()
    repair = repair_on(pod_resources, host)
    # PodResources gives GPU 1; the container's /dev holds GPU 0's node.
    wrong_dev = host.add("ml", "a", "cuda", repair.nodes_of([Gpu(195, 0)]))
    # The runtime's record names another pod uid than the cgroup.
    wrong_uid = host.add("ml", "b", "cuda", repair.nodes_of([Gpu(195, 2)]))
    wrong_uid.identity = type(wrong_uid.identity)(namespace="ml", pod="b", pod_uid=POD_UID, container="cuda")
    # An ID this plugin never offered.
    host.add("ml", "c", "cuda", repair.nodes_of([Gpu(195, 3)]))
    ended = host.add("ml", "d", "cuda", repair.nodes_of([Gpu(195, 3)]))
    ended.running = False
    vanishing = host.add("ml", "e", "cuda", repair.nodes_of([Gpu(195, 1)]))
    host.vanishing.add(vanishing.container_id)  # it ends between the check and the repair
    for record in host.containers.values():
        record.granted.clear()
    pod_resources.assignments = [assign("ml", "a", "cuda", UUIDS[1]), assign("ml", "b", "cuda", UUIDS[2]),
                                 assign("ml", "c", "cuda", "GPU-not-offered-here"), assign("ml", "d", "cuda", UUIDS[3]),
                                 assign("ml", "e", "cuda", UUIDS[1])]
    survey = host.survey

    def survey_with_cgroup_uid() -> list:  # the cgroup names its own uid, the record another
        observed = survey()
        return [o if o.container_id != wrong_uid.container_id else type(o)(
            container_id=o.container_id, pod_uid="11111111-2222-4333-8444-555555555555", cgroups=o.cgroups,
            identity=o.identity) for o in observed]

    host.survey = survey_with_cgroup_uid  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = await repair.run_pass()
        again = await repair.run_pass()
    assert host.writes == [] and result.repaired == [] and result.checked == 2
    reasons = {failure.pod: failure.reason for failure in result.failed}
    assert set(reasons) == {"a", "b", "c", "e"}
    assert reasons["e"] == (f"container {vanishing.container_id[:12]}: cgroup memory/kubepods/pod"
                            f"{vanishing.identity.pod_uid}/{vanishing.container_id} is gone (the container ended):"
                            " nothing was granted")
    assert reasons["a"] == (f"the sources disagree: PodResources gives {UUIDS[1]} (nodes 195:1), container"
                            f" {wrong_dev.container_id[:12]}'s /dev holds 195:0; nothing granted")
    assert "the runtime's record of container" in reasons["b"] and f"names pod uid {POD_UID}" in reasons["b"]
    assert reasons["c"].startswith("PodResources names device IDs this plugin never offered: Unknown device IDs for"
                                   " nvidia.com/gpu: 'GPU-not-offered-here'")
    assert [f.reason for f in again.failed] == [f.reason for f in result.failed if f.pod != "e"]  # e has ended
    logged = [r.getMessage() for r in caplog.records if "left pod" in r.getMessage()]
    assert len(logged) == 4 and repair.failures == 4  # said and counted once, not every pass
    repair.close()


@pytest.mark.asyncio
async def test_pod_resources_missing_or_refusing_waits_and_says_so_once(
        pod_resources: FakePodResources, caplog: pytest.LogCaptureFixture) -> None:
    host = MemoryPodHost()
    missing = PodRepair(catalog(), PodResourcesClient("/tmp/k8s-none/kubelet.sock"), host, control_devices=CONTROL,
                        dev_dir="/dev")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first = await missing.run_pass()
        await missing.run_pass()
    assert first.answer() == {"checked": 0, "repaired": [], "failed": [], "waiting": (
        "no PodResources socket at /tmp/k8s-none/kubelet.sock (the kubelet serves it; is it running on this node,"
        " and is --pod_resources_socket its path?)")}
    assert sum("waits for the kubelet's PodResources API" in r.getMessage() for r in caplog.records) == 1
    missing.close()

    caplog.clear()
    repair = repair_on(pod_resources, host)
    train = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0)]))
    host.reload(train.container_id)
    pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0])]
    pod_resources.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limited")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        refused = await repair.run_pass()
        await repair.run_pass()
        assert refused.waiting == (f"PodResources List on {pod_resources.socket} failed: RESOURCE_EXHAUSTED:"
                                   " rate limited") and host.writes == []
        pod_resources.refuse(None)
        back = await repair.run_pass()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("waits for the kubelet's PodResources API" in m for m in messages) == 1
    assert "The kubelet's PodResources API answers again: pod repair resumes" in messages
    assert [r.pod for r in back.repaired] == ["train-0"] and train.granted == train.given
    repair.close()


@pytest.mark.asyncio
async def test_a_pass_that_raises_is_said_once_and_the_passes_go_on(
        pod_resources: FakePodResources, caplog: pytest.LogCaptureFixture) -> None:
    """A repair problem (here the node's survey failing twice, as an unreadable
    cgroup tree would) never ends ``run``: logged once, counted, and the
    next pass repairs as usual."""
    import anyio

    class BrokenSurvey(MemoryPodHost):
        broken = 2

        def survey(self):  # type: ignore[no-untyped-def]
            if self.broken:
                self.broken -= 1
                raise PermissionError(13, "Permission denied", "/sys/fs/cgroup/devices/kubepods")
            return super().survey()

    host = BrokenSurvey()
    repair = repair_on(pod_resources, host)
    train = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0)]))
    host.reload(train.container_id)
    pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0])]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(repair.run, 0.01)
                while repair.repaired == 0:
                    await anyio.sleep(0.01)
                group.cancel_scope.cancel()
    failed = [r for r in caplog.records if r.getMessage().startswith("Pod repair pass failed")]
    assert [r.levelno for r in failed] == [logging.ERROR]  # two failures, said once
    assert failed[0].getMessage() == ("Pod repair pass failed: PermissionError: [Errno 13] Permission denied:"
                                      " '/sys/fs/cgroup/devices/kubepods'; the plugin keeps serving its GPUs and"
                                      " tries again every 0.01 s")
    assert repair.failures == 2 and train.granted == train.given
    repair.close()


def test_a_link_that_cannot_be_made_is_refused_with_why(tmp_path: Path) -> None:
    """A /dev the plugin cannot write (a read-only tmpfs here, as a host /dev mounted read-only) is a refusal
    with why, not an error that ends the pass."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    os.mknod(tmp_path / "nvidia0", stat.S_IFCHR | 0o666, os.makedev(195, 0))
    (tmp_path / "char").mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "gi-test-ro", str(tmp_path / "char")],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        repair = PodRepair(catalog(1), PodResourcesClient("/nonexistent"), MemoryPodHost(), control_devices={},
                           dev_dir=str(tmp_path))
        links = ensure_char_links(str(tmp_path), repair.all_nodes)
        assert links.made == [] and links.refused == [(str(tmp_path / "char" / "195:0"), (
            "it cannot be made (Read-only file system; the plugin needs --dev_dir writable, as the host's /dev"
            " mounted read-write)"))]
        repair.close()
    finally:
        subprocess.run(["umount", str(tmp_path / "char")], check=True, capture_output=True)


@pytest.mark.parametrize(("option", "error"), [
    ("--repair_interval=0", "--repair_interval must be > 0 seconds, got 0.0"),
    ("--repair_pods=maybe", "--repair_pods takes true or false, got 'maybe'"),
    ("--container_config=/run/x/config.json", "--container_config '/run/x/config.json' must name the container id"
                                              " as {id}"),
])
def test_bad_repair_options_exit_2_with_one_line(option: str, error: str) -> None:
    result = subprocess.run([sys.executable, "-m", "isolators", "kubelet-plugin", option], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"gpu-isolator kubelet-plugin: error: {error}"


@pytest.mark.skipif(os.geteuid() != 0, reason="the credential must be root's (R-SC-6)")
def test_repair_pods_false_runs_no_pass_and_the_route_says_so(tmp_path: Path) -> None:
    from isolators.simulated_node import SimulatedNode

    from tests.support.kubelet import PluginCommand, flag_args, plugin_directory, write_credential

    node = SimulatedNode(tmp_path / "node", gpus=2).create_files()
    token = write_credential(tmp_path / "credential")
    (tmp_path / "cdi").mkdir()
    with plugin_directory() as directory:
        plugin = PluginCommand(flag_args(node.flag_values(cdi_spec_dir=str(tmp_path / "cdi"))) + [
            f"--device_plugin_dir={directory}", "--listen=127.0.0.1:0", f"--credential={tmp_path / 'credential'}",
            "--repair_pods=false"], tmp_path)
        try:
            plugin.start()
            assert plugin.post("/kubelet-plugin/repair", {}, token) == (
                409, "409 Conflict: pod repair is off (--repair_pods=false); restart the plugin without it\n")
            assert plugin.post("/kubelet-plugin/repair", {}, None)[0] == 401
            assert "kubelet_repair_passes_total" not in plugin.metrics()
            assert "Pod repair" not in plugin.log() and not os.path.exists(os.path.join(node.dev_dir, "char"))
        finally:
            plugin.close()


# -- nothing silent (R-PR-6) -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_container_whose_runtime_record_is_missing_fails_naming_where_it_looked(
        pod_resources: FakePodResources, caplog: pytest.LogCaptureFixture) -> None:
    """PodResources names a container holding this plugin's GPU, its cgroup is there, but the runtime's record of
    it is nowhere the plugin looks (containerd with another state dir): a failure of the pass naming where it
    looked, and one log line while it lasts, not `checked: 0, failed: []`."""
    host = MemoryPodHost()
    repair = repair_on(pod_resources, host)
    lost = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0)]), recorded=False)
    host.reload(lost.container_id)
    pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0])]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = await repair.run_pass()
        again = await repair.run_pass()
    reason = ("no runtime record names it: some of this node's pod containers have no record in memory, so which"
              " one it is cannot be told; nothing checked (name the runtime's place with --container_config)")
    assert msgspec.to_builtins(first.answer()) == {"checked": 0, "repaired": [], "failed": [
        {"pod": "train-0", "namespace": "ml", "container": "cuda", "gpus": [UUIDS[0]], "reason": reason}]}
    assert [f.reason for f in again.failed] == [reason] and host.writes == []
    logged = [r.getMessage() for r in caplog.records if "left pod" in r.getMessage()]
    assert logged == [f"Pod repair left pod ml/train-0 container cuda (GPUs {UUIDS[0]}) alone: {reason}"]
    assert repair.failures == 1
    # No pod container at all under the roots: said too.
    host.containers.clear()
    assert [f.reason for f in (await repair.run_pass()).failed] == [
        "no pod container found: no cgroup of a pod's container under the kubepods roots the plugin reads (its"
        " start-up log names them; --kubepods_root); nothing checked"]
    repair.close()


def test_the_start_log_names_the_runtime_state_dirs_it_reads_k3s_rke2_and_microk8s_among_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from isolators.kubernetes.pod_repair import RepairOptions, node_repair

    facts = SimpleNamespace(control_devices=CONTROL, caps=None)
    with caplog.at_level(logging.INFO, logger="isolators.kubernetes.pod_repair._node"):
        node_repair(RepairOptions(), catalog(), facts, "/dev").close()  # type: ignore[arg-type]
    line = next(r for r in caplog.records if "runtime state directories" in r.getMessage()
                or "runtime records" in r.getMessage()).getMessage()
    for directory in ("/run/containerd/io.containerd.runtime.v2.task/k8s.io",
                      "/run/containerd/io.containerd.runtime.v2.task/moby",
                      "/run/containers/storage/overlay-containers",
                      "/run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io",  # k3s and RKE2
                      "/var/snap/microk8s/common/run/containerd/io.containerd.runtime.v2.task/k8s.io"):
        assert f"{directory} ({'exists' if os.path.isdir(directory) else 'absent'})" in line
    caplog.clear()
    (tmp_path / "k8s.io").mkdir()
    options = RepairOptions(container_configs=(str(tmp_path / "k8s.io" / "{id}" / "config.json"),
                                               str(tmp_path / "absent" / "{id}" / "config.json")))
    with caplog.at_level(logging.INFO, logger="isolators.kubernetes.pod_repair._node"):
        node_repair(options, catalog(), facts, "/dev").close()  # type: ignore[arg-type]
    assert (f"Pod repair reads the containers' runtime records (OCI configs) in: {tmp_path / 'k8s.io'} (exists),"
            f" {tmp_path / 'absent'} (absent)") in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="isolators.kubernetes.pod_repair._node"):
        node_repair(RepairOptions(container_configs=(str(tmp_path / "absent" / "{id}"),)), catalog(), facts,
                    "/dev").close()  # type: ignore[arg-type]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "state directories" in r.getMessage()]
    assert [r.getMessage() for r in warned] == [
        f"Pod repair finds none of the runtime state directories it reads the containers' records in:"
        f" {tmp_path / 'absent'} (absent); no container can be joined to its pod, so none is repaired: mount the"
        " runtime's state directory in the plugin's container, or name it with --container_config"]


# -- systemd on the system bus (R-PR-6, R-PR-7) ---------------------------------------------------


@pytest.fixture
def system_bus() -> Iterator[str]:
    from tests.support.system_bus import dbus_skip_reason, private_bus

    reason = dbus_skip_reason()
    if reason:
        pytest.skip(reason)
    directory = tempfile.mkdtemp(prefix="k8s-bus-", dir="/tmp")
    try:
        with private_bus(directory) as address:
            yield address
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def memory_systemd(host: MemoryPodHost) -> "Callable[[StandInScope], None]":
    """What systemd's record does to a memory container when applied: its device rules become the record's."""
    def apply(scope: StandInScope) -> None:
        for record in host.containers.values():
            if scope.unit == record.cgroup_path.rsplit("/", 1)[-1]:
                record.granted = set(rules_of(scope.device_allow))
    return apply


@pytest.mark.asyncio
async def test_the_start_log_says_what_repair_can_do_on_this_node(system_bus: str, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        nobody = PodRepair(catalog(), PodResourcesClient("/nonexistent"), MemoryPodHost(), control_devices=CONTROL,
                           dev_dir="/dev", systemd=SystemdScopes(f"unix:path={tmp_path}/no-bus", timeout_s=5))
        await nobody.start()
        nobody.close()
        no_systemd = PodRepair(catalog(), PodResourcesClient("/nonexistent"), MemoryPodHost(),
                               control_devices=CONTROL, dev_dir="/dev", systemd=SystemdScopes(system_bus, timeout_s=5))
        await no_systemd.start()
        no_systemd.close()
        stand_in = SystemdStandIn(system_bus).start()
        try:
            reached = PodRepair(catalog(), PodResourcesClient("/nonexistent"), MemoryPodHost(),
                                control_devices=CONTROL, dev_dir="/dev", systemd=SystemdScopes(system_bus, timeout_s=5))
            await reached.start()
            reached.close()
        finally:
            stand_in.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Pod repair")]
    systemd_runs = os.path.isdir("/run/systemd/system")
    assert lines[0].startswith("Pod repair cannot use systemd although it runs on this node: the system bus at"
                               if systemd_runs else "Pod repair finds no systemd on this node (/run/systemd/system is"
                               f" absent; the system bus at unix:path={tmp_path}/no-bus cannot be reached")
    if systemd_runs:
        assert lines[0].endswith("Mount the host's /run/dbus (the system bus socket) in the plugin's container to"
                                 " have the durable repair")
    else:
        assert lines[0].endswith("): containers' device rules are the runtime's (the cgroupfs driver), so repair"
                                 " writes the kernel directly")
    assert f"the system bus at {system_bus} has no systemd on it (org.freedesktop.DBus.Error.NameHasNoOwner" in lines[1]
    assert lines[2] == (f"Pod repair reaches systemd on the system bus ({system_bus}): a GPU container's scope gets its"
                        " GPU and control nodes in DeviceAllow= (runtime) when the plugin first sees it, so a"
                        " daemon-reload keeps them, and systemd's Reloading signal starts a pass at once")


@pytest.mark.asyncio
async def test_a_gpu_containers_scope_gets_its_nodes_in_device_allow_when_first_seen_so_a_reload_keeps_them(
        pod_resources: FakePodResources, system_bus: str, caplog: pytest.LogCaptureFixture) -> None:
    host = MemoryPodHost()
    stand_in = SystemdStandIn(system_bus, apply=memory_systemd(host)).start()
    repair = PodRepair(catalog(), PodResourcesClient(pod_resources.socket, timeout_s=5), host,
                       control_devices=CONTROL, dev_dir="/dev", systemd=SystemdScopes(system_bus, timeout_s=5))
    try:
        train = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0), Gpu(195, 2)]), scope=True)
        plain = host.add("web", "front", "nginx", [], scope=True)
        unmanaged = host.add("ml", "train-1", "cuda", repair.nodes_of([Gpu(195, 1)]))  # cgroupfs names
        unit = train.cgroup_path.rsplit("/", 1)[-1]
        for record in (train, plain):  # the scopes as runc left them: no GPU in systemd's record
            stand_in.add_scope(record.cgroup_path.rsplit("/", 1)[-1], "/" + record.cgroup_path)
        pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0], UUIDS[2]),
                                     assign("ml", "train-1", "cuda", UUIDS[1])]
        await repair.start()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            first = await repair.run_pass()
            second = await repair.run_pass()
        assert (first.checked, first.repaired, first.failed) == (2, [], [])
        assert (second.checked, second.repaired, second.failed) == (2, [], [])
        allowed = [("/dev/char/195:0", "rwm"), ("/dev/char/195:2", "rwm"), ("/dev/char/195:255", "rwm"),
                   ("/dev/char/235:0", "rwm")]
        # The calls systemd got: the unit looked up once, its DeviceAllow= set once (runtime), nothing for the
        # GPU-less container or the one systemd does not manage.
        assert stand_in.calls == [("GetUnit", (unit,)), ("SetUnitProperties", (unit, True, [("DeviceAllow", allowed)]))]
        assert stand_in.scopes[unit].device_allow == allowed
        line = next(m for m in caplog.messages if m.startswith("Pod ml/train-0"))
        assert line == (f"Pod ml/train-0 container cuda ({train.container_id[:12]}, GPUs {UUIDS[0]}, {UUIDS[2]}):"
                        f" systemd {unit}: DeviceAllow= /dev/char/195:0 rwm, /dev/char/195:2 rwm, /dev/char/195:255"
                        " rwm, /dev/char/235:0 rwm (runtime), so that a daemon-reload keeps them")
        stand_in.reload()  # systemd re-applies every scope's record: the GPUs are in it now
        assert train.granted == train.given and plain.granted == set()
        after = await repair.run_pass()
        assert (after.repaired, host.writes, repair.repaired) == ([], [], 0)
    finally:
        repair.close()
        stand_in.close()


@pytest.mark.asyncio
async def test_systemds_reloading_signal_starts_a_pass_at_once_and_access_comes_back_through_systemd(
        pod_resources: FakePodResources, system_bus: str) -> None:
    """A container the plugin first sees after a reload took its GPUs (its scope's record never had them): the
    Reloading(false) signal starts a pass at once (the interval is an hour), and the GPUs come back through
    systemd (its record, then its program), nothing written to the kernel by the plugin."""
    import anyio

    host = MemoryPodHost()
    stand_in = SystemdStandIn(system_bus, apply=memory_systemd(host)).start()
    repair = PodRepair(catalog(), PodResourcesClient(pod_resources.socket, timeout_s=5), host,
                       control_devices=CONTROL, dev_dir="/dev", systemd=SystemdScopes(system_bus, timeout_s=5))
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(repair.run, 3600)
                while repair.passes < 1:
                    await anyio.sleep(0.01)
                train = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0)]), scope=True)
                unit = train.cgroup_path.rsplit("/", 1)[-1]
                stand_in.add_scope(unit, "/" + train.cgroup_path)
                pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0])]
                await anyio.to_thread.run_sync(stand_in.reload)
                while repair.repaired < 1:
                    await anyio.sleep(0.01)
                group.cancel_scope.cancel()
        assert repair.passes == 2 and train.granted == train.given and host.writes == []
        assert stand_in.calls == [("GetUnit", (unit,)), ("SetUnitProperties", (unit, True, [("DeviceAllow", [
            ("/dev/char/195:0", "rwm"), ("/dev/char/195:255", "rwm"), ("/dev/char/235:0", "rwm")])]))]
    finally:
        repair.close()
        stand_in.close()


@pytest.mark.asyncio
async def test_a_scope_systemd_refuses_is_a_failure_and_nothing_is_written(
        pod_resources: FakePodResources, system_bus: str) -> None:
    host = MemoryPodHost()
    stand_in = SystemdStandIn(system_bus, apply=memory_systemd(host)).start()
    repair = PodRepair(catalog(), PodResourcesClient(pod_resources.socket, timeout_s=5), host,
                       control_devices=CONTROL, dev_dir="/dev", systemd=SystemdScopes(system_bus, timeout_s=5))
    try:
        train = host.add("ml", "train-0", "cuda", repair.nodes_of([Gpu(195, 0)]), scope=True)
        unit = train.cgroup_path.rsplit("/", 1)[-1]
        stand_in.add_scope(unit, "/" + train.cgroup_path)
        pod_resources.assignments = [assign("ml", "train-0", "cuda", UUIDS[0])]
        await repair.start()
        assert (await repair.run_pass()).failed == []  # prevention: its GPUs in the record
        host.reload(train.container_id)
        del stand_in.scopes[unit]  # the unit is gone from systemd (as a scope that ended)
        result = await repair.run_pass()
        assert [f.reason for f in result.failed] == [
            f"container {train.container_id[:12]}: systemd refused DeviceAllow= on {unit}:"
            f" org.freedesktop.systemd1.NoSuchUnit: Unit {unit} not loaded.; nothing written (systemd manages its"
            " scope, so its device program is replaced by systemd alone)"]
        assert host.writes == [] and train.granted == set()
    finally:
        repair.close()
        stand_in.close()
