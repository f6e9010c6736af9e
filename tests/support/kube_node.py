"""Both Kubernetes plugins of one simulated node, with the kubelet's and the API server's fakes (SPEC R-NL-4).

Rules:
- ``KubeNode(base, sockets, host_file, ledger)`` is one node as a
  Kubernetes node sees it: the simulated node of ``host_file`` (files under
  ``base/node``, CDI specs in ``base/cdi``), the fake kubelet of the device
  plugin API (``tests.support.kubelet.FakeKubelet``, in
  ``sockets/device-plugins``) with its PodResources server
  (``FakePodResources``, ``sockets/pod-resources.sock``), the fake DRA
  kubelet (``FakeDraKubelet``, ``sockets/registry`` and
  ``sockets/plugins``) and the fake API server (``FakeApiServer``), and
  the two commands (``device_plugin``: ``gpu-isolator kubelet-plugin``,
  ``--repair_pods=false`` unless ``repair_pods``, with
  ``device_plugin_options``; ``dra_plugin``: ``gpu-isolator dra-plugin`` of
  driver ``DRIVER`` on node ``NODE``, with ``dra_plugin_options``), each with ``--node_ledger=ledger``,
  ``--listen`` on loopback and passes of ``pass_s`` seconds, ``env`` added
  to their environment, ``prefixes[command]`` the argv each is started
  under (e.g. ``tests.support.kernel.in_cgroups``). Nothing runs
  until ``start(dra=True)``: the fakes, then both plugins (each
  registered; the device plugin alone with ``dra=False``).
  ``restart_device_plugin()`` / ``restart_dra_plugin()`` start one again
  after it stopped or was killed (from the source tree ``code``: this
  repository when None, the default; an earlier release's tree for an
  upgrade) (``kill_device_plugin()`` /
  ``kill_dra_plugin()``: SIGKILL), registered again.
- What the kubelet and the scheduler do, as they do it:
  ``allocate(pod, ids, resource=GPU)`` is the kubelet's ``Allocate`` for one container
  (``<pod>/gpu``) of namespace ``ns`` and, once it answered, the
  assignment PodResources lists from then on (a refusal raises the
  ``grpc.RpcError`` and assigns nothing); ``remove_pod(pod)`` is the pod
  gone (PodResources no longer lists it). ``claim(devices)`` stores a
  ResourceClaim the scheduler allocated ``devices`` (``gpu-<minor>``) of
  this node to; ``share(requests)`` one the scheduler allocates as
  Kubernetes does, consumable capacity included (``FakeApiServer.allocate``:
  ``requests`` its ``capacity.requests``); ``prepare(claim)`` / ``unprepare(claim)`` are the
  kubelet's calls for it (the answer for its uid).
- What each one offers: ``listed()`` is the device plugin's last
  ``ListAndWatch`` list as ``{UUID: health}``; ``wait_listed(predicate)``
  waits (bounded) until the newest list is one it holds for; ``slice_devices()`` the names
  of the devices of this node's ResourceSlice; ``wait_slice(predicate)``
  waits (bounded) for one it holds for.
- ``assigned()`` is every unit PodResources names (UUIDs); ``prepared()``
  every device of a claim the DRA checkpoint holds (``gpu-<minor>``).
- ``close()`` stops what runs (SIGTERM, then kill) and the fakes; always
  safe. The MPS daemons a sharing plugin started outlive it (as on a
  node); ``end_mps_daemons(runtime_dir)`` kills those a test left
  (SIGKILL, by the PID each wrote in its pipe directory).
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any, Callable

from isolators.kubernetes.pod_repair import AssignedDevices
from isolators.kubernetes.pod_repair.testing import FakePodResources

from .dra_kubelet import DraPluginCommand, FakeDraKubelet
from .kube_api import FakeApiServer, allocation_result
from .kubelet import WAIT, FakeKubelet, PluginCommand, flag_args

GPU = "nvidia.com/gpu"
DRIVER = "gpu.isolator.dev"
NODE = "node-a"
NAMESPACE = "ns"


class KubeNode:
    """One Kubernetes node: both plugins and the fakes around them (see module rules)."""

    def __init__(self, base: Path, sockets: Path, host_file: str | os.PathLike[str], ledger: str, *,
                 pass_s: float = 0.2, allocate_grace_s: float | None = None, repair_pods: bool = False,
                 device_plugin_options: tuple[str, ...] = (), dra_plugin_options: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, prefixes: dict[str, list[str]] | None = None) -> None:
        from isolators.simulated_node import SimulatedNode

        self.base = Path(base)
        self.sockets = Path(sockets)
        self.ledger = ledger
        self.node = SimulatedNode(self.base / "node", host=host_file).create_files()
        self.cdi = self.base / "cdi"
        self.cdi.mkdir(exist_ok=True)
        self.uuids = {f"gpu-{gpu.minor}": gpu.uuid for gpu in _gpus(host_file)}
        self.api = FakeApiServer()
        (self.sockets / "device-plugins").mkdir(parents=True, exist_ok=True)
        self.pod_resources = FakePodResources(str(self.sockets / "pod-resources.sock"))
        self.kubelet = FakeKubelet(self.sockets / "device-plugins")
        self.dra_kubelet = FakeDraKubelet(self.sockets / "registry")
        common = flag_args(self.node.flag_values(cdi_spec_dir=str(self.cdi), node_ledger=ledger)) + [
            "--listen=127.0.0.1:0", f"--poll_interval={pass_s}"]
        grace = [f"--allocate_grace={allocate_grace_s}"] if allocate_grace_s is not None else []
        self.device_plugin_args = common + [
            f"--device_plugin_dir={self.sockets / 'device-plugins'}", f"--repair_pods={str(repair_pods).lower()}",
            f"--repair_interval={pass_s}", f"--pod_resources_socket={self.pod_resources.socket}", *grace,
            *device_plugin_options]
        self.dra_plugin_args = common + [
            f"--plugins_registry_dir={self.sockets / 'registry'}", f"--plugins_dir={self.sockets / 'plugins'}",
            f"--node_name={NODE}", f"--kubeconfig={self.base / 'kubeconfig'}", "--api_timeout=5", *dra_plugin_options]
        self.env = env
        self.prefixes = prefixes or {}
        """Command name (``kubelet-plugin``, ``dra-plugin``) -> the argv it is started under."""
        self.device_plugin: PluginCommand | None = None
        self.dra_plugin: DraPluginCommand | None = None
        self.registrations = 0
        self.code: Path | None = None
        """The source tree the plugins start from (None: this repository)."""
        self._started = False

    # -- running ---------------------------------------------------------------------------
    def start(self, dra: bool = True) -> "KubeNode":
        self.api.start()
        self.api.kubeconfig(self.base / "kubeconfig")
        self.pod_resources.start()
        self.kubelet.start()
        self._started = True
        self.restart_device_plugin()
        if dra:
            self.restart_dra_plugin()
        return self

    def restart_device_plugin(self, timeout: float = 60.0) -> PluginCommand:
        """Start the device plugin (again) and wait until the kubelet holds its new registration."""
        self.device_plugin = PluginCommand(self.device_plugin_args, self.base, self.env, code=self.code,
                                           prefix=self.prefixes.get(PluginCommand.COMMAND, ())).start(timeout)
        self.registrations += 1
        self.kubelet.wait_registrations(self.registrations, timeout=timeout)
        return self.device_plugin

    def restart_dra_plugin(self, timeout: float = 60.0) -> DraPluginCommand:
        """Start the DRA driver (again) and register it with the kubelet's plugin watcher."""
        self.dra_plugin = DraPluginCommand(self.dra_plugin_args, self.base, self.env, code=self.code,
                                           prefix=self.prefixes.get(DraPluginCommand.COMMAND, ())).start(timeout)
        self.dra_kubelet.register(timeout=timeout)
        return self.dra_plugin

    def kill_device_plugin(self) -> None:
        assert self.device_plugin is not None
        self.device_plugin.stop(signal.SIGKILL)

    def kill_dra_plugin(self) -> None:
        assert self.dra_plugin is not None
        self.dra_plugin.stop(signal.SIGKILL)

    def close(self) -> None:
        for command in (self.device_plugin, self.dra_plugin):
            if command is not None:
                try:
                    command.stop()
                except AssertionError:
                    pass
                command.close()
        self.dra_kubelet.close()
        if self._started:
            self.kubelet.close()
            self.pod_resources.close()
        self.api.close()

    # -- the kubelet and the scheduler -------------------------------------------------------
    def allocate(self, pod: str, ids: list[str], resource: str = GPU) -> Any:
        """The kubelet's Allocate for ``pod``'s container, then its assignment in PodResources."""
        answer = self.kubelet.allocate(resource, ids)
        self.pod_resources.assignments = [*self.pod_resources.assignments, AssignedDevices(
            namespace=NAMESPACE, pod=pod, container="gpu", resource=resource, ids=tuple(ids))]
        return answer

    def remove_pod(self, pod: str) -> None:
        self.pod_resources.assignments = [entry for entry in self.pod_resources.assignments if entry.pod != pod]

    def claim(self, devices: list[str]) -> tuple[str, str, str]:
        """A ResourceClaim allocated ``devices`` of this node; (namespace, name, uid)."""
        uid = str(uuid.uuid4())
        name = f"claim-{uid[:8]}"
        self.api.add_claim(NAMESPACE, name, [allocation_result("gpus", DRIVER, NODE, device) for device in devices],
                           uid=uid)
        return (NAMESPACE, name, uid)

    def share(self, requests: dict[str, str] | None) -> tuple[str, str, str]:
        """A ResourceClaim asking ``requests`` (``capacity.requests``), allocated by the scheduler's rules."""
        uid = str(uuid.uuid4())
        name = f"share-{uid[:8]}"
        self.api.allocate(NAMESPACE, name, driver=DRIVER, node=NODE, requests=requests, uid=uid)
        return (NAMESPACE, name, uid)

    def prepare(self, claim: tuple[str, str, str], timeout: float = WAIT) -> dict:
        return self.dra_kubelet.prepare([claim], timeout=timeout)[claim[2]]

    def unprepare(self, claim: tuple[str, str, str]) -> dict:
        return self.dra_kubelet.unprepare([claim])[claim[2]]

    # -- what each one offers and holds -----------------------------------------------------
    def listed(self) -> dict[str, str]:
        streams = self.kubelet.streams.get(GPU)
        lists = streams[-1].lists if streams else []
        return {device_id: health for device_id, health, _ in lists[-1]} if lists else {}

    def wait_listed(self, predicate: Callable[[dict[str, str]], bool], what: str, timeout: float = WAIT) -> dict:
        """The device plugin's newest list once ``predicate`` holds for it (bounded)."""
        def now() -> dict[str, str] | None:
            listed = self.listed()
            return listed if listed and predicate(listed) else None

        return self.kubelet._wait(now, what, timeout)

    def slice_devices(self) -> list[str]:
        slices = self.api.slices(NODE)
        return sorted((d["name"] for s in slices for d in s["spec"].get("devices") or []),
                      key=lambda name: int(name.split("-")[1]))

    def wait_slice(self, predicate: Callable[[list[str]], bool], what: str, timeout: float = WAIT) -> list[str]:
        self.api.wait_for(lambda api: predicate(self.slice_devices()), what, timeout)
        return self.slice_devices()

    def assigned(self) -> set[str]:
        return {device_id for entry in self.pod_resources.assignments for device_id in entry.ids}

    def prepared(self) -> dict[str, list[str]]:
        """Claim uid -> its devices, as the DRA driver's checkpoint holds them."""
        path = Path(self.node.work_dir) / "dra" / DRIVER / "prepared-claims.json"
        if not path.exists():
            return {}
        return {claim["ref"]["uid"]: [d["device"] for d in claim["devices"]]
                for claim in json.loads(path.read_text())["claims"]}


def end_mps_daemons(runtime_dir: str | os.PathLike[str]) -> None:
    """SIGKILL every MPS daemon a test's plugin left under ``runtime_dir`` (see module rules)."""
    for pid_file in Path(runtime_dir).glob("mps/*/pipe/nvidia-cuda-mps-control.pid"):
        try:
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        except (ValueError, OSError):
            pass


def _gpus(host_file: str | os.PathLike[str]) -> list[Any]:
    from actors.nvml import load_host_file

    return list(load_host_file(str(host_file)).gpus)
