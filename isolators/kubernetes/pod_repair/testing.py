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
  when not given; ``scope=True``: its cgroup has the systemd driver's
  names, a ``cri-containerd-<id>.scope``; ``recorded=False``: the
  runtime's record of it is not found, so the survey knows no identity);
  ``reload(container_id)`` is what a systemd reload does to it (its rules
  for those nodes dropped); ``repair`` grants what it is asked and
  records it in ``writes``, or, for a container id in ``vanishing``,
  finds its cgroup gone (``CgroupGone``: a container that ended between
  the check and the repair) and grants nothing; ``through_systemd``
  writes nothing and checks that systemd gave the rules (else
  ``AccessError``); ``link_nodes`` makes nothing (no file system);
  ``records_looked_in()`` says ``memory``. Nothing blocks.
- ``SystemdStandIn(address, apply)`` is systemd's manager on a D-Bus bus
  (``dbus-fast``, on an event loop in a thread of its own; ``start()``,
  ``close()``): it owns ``org.freedesktop.systemd1`` and serves, at
  ``/org/freedesktop/systemd1``, ``org.freedesktop.systemd1.Manager``'s
  ``GetUnit(s) -> o`` (``org.freedesktop.systemd1.NoSuchUnit``, "Unit X
  not loaded.", for a unit it does not have) and
  ``SetUnitProperties(s name, b runtime, a(sv) properties)``
  (``DeviceAllow`` only, as ``a(ss)``: entries added to the scope's
  record, an entry of a path it holds updating its access, an empty list
  emptying it, as systemd does; another property is
  ``org.freedesktop.DBus.Error.InvalidArgs``), and emits ``Reloading(b)``;
  each unit it has (``add_scope(unit, control_group, device_allow)``: the
  scope as runc leaves it, its record not applied yet) is an object at ``/org/freedesktop/systemd1/unit/<escaped name>`` with
  ``org.freedesktop.systemd1.Scope``'s ``ControlGroup`` property. After
  each ``SetUnitProperties`` it applies the scope's record
  (``apply(scope)``, on its thread: what the test makes of systemd's
  device rules, in memory or in the kernel); ``reload()`` is a
  ``daemon-reload``: ``Reloading(true)``, every scope's record applied
  again, ``Reloading(false)``. ``calls`` records every method call
  ``(member, arguments)`` in order (variants unwrapped);
  ``wait_calls(member, count)`` waits (bounded) for that many.
  ``rules_of(device_allow)`` reads ``DeviceAllow=`` entries as
  ``DeviceRule``s as systemd does: ``/dev/char/<major>:<minor>`` and
  ``/dev/block/...`` parsed, another path stat()ed (a missing one left
  out).
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.devices import DeviceRule

from ..._types import ContainerDevice
from ._dev_char import CharLinks
from .._sockets import unix_target
from ._access import AccessError, CgroupGone
from ._cgroups import ContainerCgroup, PodIdentity
from ._repair import ContainerCheck, ObservedContainer
from ._pod_resources import AssignedDevices

__all__ = ["FakePodResources", "MemoryContainer", "MemoryPodHost", "StandInScope", "SystemdStandIn", "rules_of"]


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
        self.scope = False
        self.recorded = True

    @property
    def cgroup_path(self) -> str:
        uid, cid = self.identity.pod_uid, self.container_id
        if self.scope:
            return f"kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope"
        return f"kubepods/pod{uid}/{cid}"


class MemoryPodHost:
    """A ``PodHost`` in memory (see module rules)."""

    def __init__(self) -> None:
        self.containers: dict[str, MemoryContainer] = {}
        self.writes: list[tuple[str, tuple[DeviceRule, ...]]] = []
        self.vanishing: set[str] = set()

    def add(self, namespace: str, pod: str, container: str, nodes: Iterable[ContainerDevice], *,
            pod_uid: str | None = None, container_id: str | None = None, scope: bool = False,
            recorded: bool = True) -> MemoryContainer:
        identity = PodIdentity(namespace=namespace, pod=pod, pod_uid=pod_uid or str(uuid.uuid4()), container=container)
        record = MemoryContainer(identity, container_id or uuid.uuid4().hex * 2, list(nodes))
        record.scope, record.recorded = scope, recorded
        self.containers[record.container_id] = record
        return record

    def reload(self, container_id: str) -> None:
        self.containers[container_id].granted.clear()

    def survey(self) -> list[ObservedContainer]:
        observed = []
        for record in self.containers.values():
            uid, cid = record.identity.pod_uid, record.container_id
            cgroup = ContainerCgroup(hierarchy="memory", version=0, path=record.cgroup_path, pod_uid=uid,
                                     container_id=cid)
            observed.append(ObservedContainer(container_id=cid, pod_uid=uid, cgroups=(cgroup,),
                                              identity=record.identity if record.recorded else None))
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

    def repair(self, container: ObservedContainer, rules: Sequence[DeviceRule], *,
               through_systemd: bool = False) -> list[str]:
        if container.container_id in self.vanishing:
            self.containers.pop(container.container_id, None)
            raise CgroupGone(f"cgroup {container.cgroups[0].directory} is gone (the container ended): nothing was"
                             " granted")
        record = self.containers[container.container_id]
        if through_systemd:
            refused = [rule for rule in rules if rule not in record.granted]
            if refused:
                raise AccessError(f"after systemd took DeviceAllow= the kernel still refuses"
                                  f" {', '.join(map(str, refused))} on {container.cgroups[0].directory}")
            return []
        record.granted.update(rules)
        self.writes.append((container.container_id, tuple(rules)))
        return [f"granted {rule}" for rule in rules]

    def link_nodes(self, nodes: Sequence[ContainerDevice]) -> CharLinks:
        return CharLinks()

    def records_looked_in(self) -> str:
        return "memory"


_DEVICE_PATH = re.compile(r"/dev/(char|block)/(\d+):(\d+)")


def rules_of(device_allow: Iterable[tuple[str, str]]) -> list[DeviceRule]:
    """``DeviceAllow=`` entries as rules, as systemd reads them: ``/dev/char|block/<major>:<minor>`` parsed, any
    other path stat()ed (links followed) and taken when it is a device node; the rest left out."""
    rules = []
    for path, access in device_allow:
        match = _DEVICE_PATH.fullmatch(path)
        if match:
            rules.append(DeviceRule("c" if match.group(1) == "char" else "b", int(match.group(2)),
                                    int(match.group(3)), access))
            continue
        try:
            info = os.stat(path)
        except OSError:
            continue
        if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
            rules.append(DeviceRule("c" if stat.S_ISCHR(info.st_mode) else "b", os.major(info.st_rdev),
                                    os.minor(info.st_rdev), access))
    return rules


class StandInScope:
    """One scope unit of ``SystemdStandIn``: its cgroup and its ``DeviceAllow=`` record."""

    def __init__(self, unit: str, control_group: str, device_allow: Iterable[tuple[str, str]]) -> None:
        self.unit = unit
        self.control_group = control_group
        self.device_allow: list[tuple[str, str]] = list(device_allow)


def _unit_path(unit: str) -> str:
    """systemd's object path of a unit (``bus_label_escape``: every byte not a letter or digit as ``_xx``)."""
    return "/org/freedesktop/systemd1/unit/" + "".join(
        ch if ch.isascii() and ch.isalnum() else f"_{ord(ch):02x}" for ch in unit)


class SystemdStandIn:
    """systemd's manager on a D-Bus bus, for tests (see module rules)."""

    def __init__(self, address: str, apply: Callable[[StandInScope], None] | None = None,
                 timeout_s: float = 10.0) -> None:
        self.address = address
        self.apply = apply or (lambda scope: None)
        self.timeout_s = timeout_s
        self.scopes: dict[str, StandInScope] = {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._changed = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._bus: Any = None
        self._manager: Any = None

    # -- the thread and its loop -------------------------------------------------------------
    def start(self) -> "SystemdStandIn":
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="systemd-stand-in", daemon=True)
        self._thread.start()
        self._run(self._connect())
        return self

    def _run(self, coroutine: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(self.timeout_s)

    async def _connect(self) -> None:
        from dbus_fast import RequestNameReply
        from dbus_fast.aio import MessageBus

        self._bus = await MessageBus(bus_address=self.address).connect()
        self._manager = _manager_interface(self)
        self._bus.export("/org/freedesktop/systemd1", self._manager)
        for scope in self.scopes.values():
            self._export(scope)
        reply = await self._bus.request_name("org.freedesktop.systemd1")
        if reply != RequestNameReply.PRIMARY_OWNER:
            raise RuntimeError(f"the stand-in could not own org.freedesktop.systemd1 on {self.address}: {reply}")

    def _export(self, scope: StandInScope) -> None:
        self._bus.export(_unit_path(scope.unit), _scope_interface(scope))

    def close(self) -> None:
        if self._loop is None:
            return
        if self._bus is not None:
            self._loop.call_soon_threadsafe(self._bus.disconnect)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(self.timeout_s)
        self._loop.close()
        self._loop = None

    # -- what the test does ---------------------------------------------------------------------
    def add_scope(self, unit: str, control_group: str, device_allow: Iterable[tuple[str, str]] = ()) -> StandInScope:
        """A scope unit of ``control_group`` (``/`` + its path under the mount) with that record, not applied: the
        scope as runc leaves it at the container's start (runc's device program in place of systemd's first)."""
        scope = StandInScope(unit, control_group, device_allow)

        async def add() -> None:
            self.scopes[unit] = scope
            if self._bus is not None:
                self._export(scope)

        if self._loop is None:
            self.scopes[unit] = scope
        else:
            self._run(add())
        return scope

    def reload(self) -> None:
        """A ``daemon-reload``: ``Reloading(true)``, every scope's record applied again, ``Reloading(false)``."""

        async def reload() -> None:
            self._manager.Reloading(True)
            for scope in list(self.scopes.values()):
                self.apply(scope)
            self._manager.Reloading(False)

        self._run(reload())

    def wait_calls(self, member: str, count: int, timeout: float = 20.0) -> list[tuple[Any, ...]]:
        """The arguments of the first ``count`` calls of ``member``, waiting (bounded) for them."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                made = [arguments for name, arguments in self.calls if name == member]
                if len(made) >= count:
                    return made[:count]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{count} {member} call(s) did not come within {timeout}s; calls: {self.calls}")
                self._changed.wait(left)

    def _record(self, member: str, arguments: tuple[Any, ...]) -> None:
        with self._changed:
            self.calls.append((member, arguments))
            self._changed.notify_all()

    # -- the manager's methods (on the loop) -----------------------------------------------------
    def _get_unit(self, name: str) -> str:
        from dbus_fast.errors import DBusError

        self._record("GetUnit", (name,))
        if name not in self.scopes:
            raise DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not loaded.")
        return _unit_path(name)

    def _set_unit_properties(self, name: str, runtime: bool, properties: list[Any]) -> None:
        from dbus_fast.errors import DBusError

        unwrapped = [(key, [tuple(entry) for entry in getattr(value, "value", value)]) for key, value in properties]
        self._record("SetUnitProperties", (name, runtime, unwrapped))
        scope = self.scopes.get(name)
        if scope is None:
            raise DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not loaded.")
        for key, entries in unwrapped:
            if key != "DeviceAllow":
                raise DBusError("org.freedesktop.DBus.Error.InvalidArgs",
                                f"Cannot set property {key}, or unknown property.")
            if not entries:
                scope.device_allow.clear()
            for path, access in entries:
                held = [i for i, (held_path, _) in enumerate(scope.device_allow) if held_path == path]
                if held:
                    scope.device_allow[held[0]] = (path, access)
                else:
                    scope.device_allow.append((path, access))
        self.apply(scope)


def _manager_interface(stand_in: SystemdStandIn) -> Any:
    from dbus_fast.service import ServiceInterface, method, signal

    class Manager(ServiceInterface):
        def __init__(self) -> None:
            super().__init__("org.freedesktop.systemd1.Manager")

        @method()
        def GetUnit(self, name: "s") -> "o":  # type: ignore[name-defined]  # noqa: F821
            return stand_in._get_unit(name)

        @method()
        def SetUnitProperties(self, name: "s", runtime: "b", properties: "a(sv)"):  # type: ignore[no-untyped-def,name-defined]  # noqa: F821,E501
            stand_in._set_unit_properties(name, runtime, properties)

        @signal()
        def Reloading(self, active: bool) -> "b":  # type: ignore[name-defined]  # noqa: F821
            return active

    return Manager()


def _scope_interface(scope: StandInScope) -> Any:
    from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property

    class Scope(ServiceInterface):
        def __init__(self) -> None:
            super().__init__("org.freedesktop.systemd1.Scope")

        @dbus_property(access=PropertyAccess.READ)
        def ControlGroup(self) -> "s":  # type: ignore[name-defined]  # noqa: F821
            return scope.control_group

    return Scope()
