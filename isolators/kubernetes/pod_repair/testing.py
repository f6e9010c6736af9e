"""Doubles for pod repair, used by tests and benchmarks alike: a fake PodResources server and a node in memory.

Rules:
- ``FakePodResources(socket)`` serves ``PodResourcesLister`` (the official
  proto's modules, grpcio's synchronous server on threads of its own) on a
  unix socket: ``start()``, ``close()``; ``assignments`` (a list of
  ``AssignedDevices``, replaced at will) is what ``List`` answers, grouped
  by pod and container as the kubelet does; ``refuse(code, details)``
  makes every call fail with that status until ``refuse(None)``; ``calls``
  counts ``List`` calls, ``refused`` those it failed (a test that waits for
  one refused call after ``refuse`` knows no later pass gets past ``List``).
- ``MemoryPodHost`` is a ``PodHost`` whose containers live in memory:
  ``add(namespace, pod, container, nodes)`` makes a running container
  given ``nodes`` (its /dev holds them, its rules grant them; ids made up
  when not given); ``reload(container_id)`` is what a systemd reload does
  to it (its rules for those nodes dropped); ``repair`` grants what it is
  asked and records it in ``writes``, or, for a container id in
  ``vanishing``, finds its cgroup gone (``CgroupGone``: a container that
  ended between the check and the repair) and grants nothing; ``link_nodes`` makes nothing (no
  file system). Nothing blocks.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.devices import DeviceRule

from ..._types import ContainerDevice
from ._dev_char import CharLinks
from .._sockets import unix_target
from ._access import CgroupGone
from ._cgroups import ContainerCgroup, PodIdentity
from ._repair import ContainerCheck, ObservedContainer
from ._pod_resources import AssignedDevices

__all__ = ["FakePodResources", "MemoryContainer", "MemoryPodHost"]


class FakePodResources:
    """The kubelet's PodResources server, faked (see module rules)."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.assignments: list[AssignedDevices] = []
        self.calls = 0
        self.refused = 0
        self._refusal: tuple[Any, str] | None = None
        self._server: Any = None
        self._lock = threading.Lock()

    def start(self) -> "FakePodResources":
        import grpc

        from .._api import pods_rpc

        fake = self

        class Lister(pods_rpc.PodResourcesListerServicer):
            def List(self, request: Any, context: Any) -> Any:
                return fake._list(context)

        server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="fake-pod-resources"))
        pods_rpc.add_PodResourcesListerServicer_to_server(Lister(), server)
        server.add_insecure_port(unix_target(self.socket))
        server.start()
        self._server = server
        return self

    def refuse(self, code: Any, details: str = "refused by the test") -> None:
        """Fail every ``List`` with ``code`` (a ``grpc.StatusCode``); None answers again."""
        with self._lock:
            self._refusal = None if code is None else (code, details)

    def _list(self, context: Any) -> Any:
        from .._api import pods_pb

        with self._lock:
            self.calls += 1
            refusal = self._refusal
            assignments = list(self.assignments)
            if refusal is not None:
                self.refused += 1
        if refusal is not None:
            context.abort(refusal[0], refusal[1])
        pods: dict[tuple[str, str], dict[str, list[AssignedDevices]]] = {}
        for entry in assignments:
            pods.setdefault((entry.namespace, entry.pod), {}).setdefault(entry.container, []).append(entry)
        return pods_pb.ListPodResourcesResponse(pod_resources=[
            pods_pb.PodResources(name=pod, namespace=namespace, containers=[
                pods_pb.ContainerResources(name=name, devices=[
                    pods_pb.ContainerDevices(resource_name=entry.resource, device_ids=list(entry.ids))
                    for entry in entries if entry.ids])
                for name, entries in containers.items()])
            for (namespace, pod), containers in pods.items()])

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(10)
            self._server = None


class MemoryContainer:
    """One running container of ``MemoryPodHost``."""

    def __init__(self, identity: PodIdentity, container_id: str, nodes: Sequence[ContainerDevice]) -> None:
        self.identity = identity
        self.container_id = container_id
        self.dev_nodes = {(node.major, node.minor): node.path for node in nodes
                          if node.path.startswith(("/dev/nvidia-caps/",)) or node.path[len("/dev/nvidia"):].isdigit()}
        self.granted: set[DeviceRule] = {DeviceRule(node.type, node.major, node.minor, node.permissions)
                                         for node in nodes}
        self.given = frozenset(self.granted)
        self.running = True


class MemoryPodHost:
    """A ``PodHost`` in memory (see module rules)."""

    def __init__(self) -> None:
        self.containers: dict[str, MemoryContainer] = {}
        self.writes: list[tuple[str, tuple[DeviceRule, ...]]] = []
        self.vanishing: set[str] = set()

    def add(self, namespace: str, pod: str, container: str, nodes: Iterable[ContainerDevice], *,
            pod_uid: str | None = None, container_id: str | None = None) -> MemoryContainer:
        identity = PodIdentity(namespace=namespace, pod=pod, pod_uid=pod_uid or str(uuid.uuid4()), container=container)
        record = MemoryContainer(identity, container_id or uuid.uuid4().hex * 2, list(nodes))
        self.containers[record.container_id] = record
        return record

    def reload(self, container_id: str) -> None:
        self.containers[container_id].granted.clear()

    def survey(self) -> list[ObservedContainer]:
        observed = []
        for record in self.containers.values():
            uid, cid = record.identity.pod_uid, record.container_id
            cgroup = ContainerCgroup(hierarchy="memory", version=0, path=f"kubepods/pod{uid}/{cid}", pod_uid=uid,
                                     container_id=cid)
            observed.append(ObservedContainer(container_id=cid, pod_uid=uid, identity=record.identity,
                                              cgroups=(cgroup,)))
        return observed

    def check_all(self, items: Sequence[tuple[ObservedContainer, Sequence[DeviceRule]]]) -> list[ContainerCheck]:
        checks = []
        for container, rules in items:
            record = self.containers.get(container.container_id)
            if record is None or not record.running:
                checks.append(ContainerCheck())
                continue
            checks.append(ContainerCheck(dev_nodes=dict(record.dev_nodes),
                                         missing=tuple(rule for rule in rules if rule not in record.granted)))
        return checks

    def repair(self, container: ObservedContainer, rules: Sequence[DeviceRule]) -> list[str]:
        if container.container_id in self.vanishing:
            self.containers.pop(container.container_id, None)
            raise CgroupGone(f"cgroup {container.cgroups[0].directory} is gone (the container ended): nothing was"
                             " granted")
        record = self.containers[container.container_id]
        record.granted.update(rules)
        self.writes.append((container.container_id, tuple(rules)))
        return [f"granted {rule}" for rule in rules]

    def link_nodes(self, nodes: Sequence[ContainerDevice]) -> CharLinks:
        return CharLinks()
