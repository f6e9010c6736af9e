"""systemd's record of a container scope, over the system bus: ``DeviceAllow=``, and its reloads (R-PR-4, R-PR-6..8).

Rules:
- With the systemd cgroup driver a container's cgroup is a scope systemd
  owns; each ``daemon-reload`` re-applies its device rules from systemd's
  record (where a GPU whose ``/dev/char/<major>:<minor>`` link was
  missing does not survive), and on cgroup v2 systemd then
  attaches its newly compiled device program and detaches its previous
  one. The durable repair, and the prevention, add the devices to that
  record: ``org.freedesktop.systemd1.Manager.SetUnitProperties(unit,
  runtime=true, [("DeviceAllow", [(path, access), ...])])`` (runtime:
  gone at reboot, as the scope is), which systemd applies at once with a
  program of its own.
- ``SystemdScopes(address)`` speaks the system bus from asyncio
  (``dbus-fast``); ``address`` None is the system bus
  (``DBUS_SYSTEM_BUS_ADDRESS``, else ``unix:path=/run/dbus/system_bus_socket``).
  ``connect()`` (bounded by ``timeout_s``) connects, asks the bus who owns
  ``org.freedesktop.systemd1`` and subscribes to its ``Reloading`` signal;
  it answers None when the durable repair is possible, else why not (no
  client library, no bus, no systemd on it), never raising.
  ``status_line(reason)`` is what the plugin logs at start: what repair
  can do on this node.
- ``unit_of(cgroup)``: the scope's unit name when systemd manages it: the
  cgroup's last path component is a ``.scope`` unit name (letters, digits
  and ``:_.\\-@`` only), ``GetUnit`` answers a unit path and that unit's
  ``ControlGroup`` property is the cgroup's path (``/`` + its path under
  the hierarchy's mount); None otherwise (not connected, the cgroupfs
  driver, another unit of that name).
- ``allow(unit, rules, dev_dir)`` makes the ``SetUnitProperties`` call,
  each rule as its ``/dev/char/<major>:<minor>`` path (``block/`` for block
  devices) and its access; it answers what was done as one line. A refusal
  or no answer within ``timeout_s`` is a ``SystemdRefused`` naming the unit
  and systemd's answer.
- ``on_reload(callback)``: ``callback()`` is called on the event loop when
  systemd's ``Reloading(false)`` arrives (a reload has finished: the
  scopes' rules were re-applied); ``Reloading(true)`` (a reload begins) is
  ignored. ``close()`` disconnects.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from actors.devices import DeviceRule
from runtime import Failure

from ._cgroups import ContainerCgroup

__all__ = ["SYSTEMD_BUS_NAME", "SystemdRefused", "SystemdScopes", "device_allow_entries"]

logger = logging.getLogger(__name__)

SYSTEMD_BUS_NAME = "org.freedesktop.systemd1"
_PATH = "/org/freedesktop/systemd1"
_MANAGER = "org.freedesktop.systemd1.Manager"
_SCOPE = "org.freedesktop.systemd1.Scope"
_DEFAULT_ADDRESS = "unix:path=/run/dbus/system_bus_socket"
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\.scope")


class SystemdRefused(Failure):
    """systemd did not take the scope's new ``DeviceAllow=``."""


def device_allow_entries(rules: Sequence[DeviceRule], dev_dir: str) -> list[tuple[str, str]]:
    """``DeviceAllow=`` entries of ``rules``: ``(<dev_dir>/char/<major>:<minor>, access)`` each."""
    return [(os.path.join(dev_dir, "block" if rule.type == "b" else "char", f"{rule.major}:{rule.minor}"), rule.access)
            for rule in rules]


class SystemdScopes:
    """``DeviceAllow=`` on systemd's scopes, and its reloads (see module rules)."""

    def __init__(self, address: str | None = None, *, timeout_s: float = 5.0) -> None:
        self.address = address or os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or _DEFAULT_ADDRESS
        self.timeout_s = timeout_s
        self._bus: Any = None
        self._callbacks: list[Callable[[], None]] = []

    @property
    def connected(self) -> bool:
        return self._bus is not None and self._bus.connected

    async def connect(self) -> str | None:
        """Connect and subscribe; None when systemd answers, else why not (see module rules)."""
        try:
            from dbus_fast import Message, MessageType
            from dbus_fast.aio import MessageBus
        except ImportError as error:
            return f"its D-Bus client (dbus-fast) is not installed ({error})"
        bus = None
        try:
            with anyio.fail_after(self.timeout_s):
                bus = await MessageBus(bus_address=self.address).connect()
                owner = await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                                               interface="org.freedesktop.DBus", member="GetNameOwner",
                                               signature="s", body=[SYSTEMD_BUS_NAME]))
                if owner.message_type == MessageType.ERROR:
                    bus.disconnect()
                    return f"the system bus at {self.address} has no systemd on it ({_error_text(owner)})"
                bus.add_message_handler(self._on_message)
                match = await bus.call(Message(
                    destination="org.freedesktop.DBus", path="/org/freedesktop/DBus", interface="org.freedesktop.DBus",
                    member="AddMatch", signature="s",
                    body=[f"type='signal',sender='{SYSTEMD_BUS_NAME}',path='{_PATH}',interface='{_MANAGER}',"
                          "member='Reloading'"]))
                if match.message_type == MessageType.ERROR:
                    bus.disconnect()
                    return f"the system bus at {self.address} refused a subscription to systemd's Reloading signal" \
                           f" ({_error_text(match)})"
        except TimeoutError:
            if bus is not None:
                bus.disconnect()
            return f"the system bus at {self.address} did not answer within {self.timeout_s:g} s"
        except Exception as error:  # no socket, refused, authentication: the bus is not reachable
            if bus is not None:
                bus.disconnect()
            return f"the system bus at {self.address} cannot be reached ({type(error).__name__}: {error})"
        self._bus = bus
        return None

    @staticmethod
    def status_line(reason: str | None, address: str, systemd_dir: str = "/run/systemd/system") -> tuple[int, str]:
        """(log level, line) saying at start what repair can do on this node (R-PR-6)."""
        if reason is None:
            return logging.INFO, (
                f"Pod repair reaches systemd on the system bus ({address}): a GPU container's scope gets its GPU and"
                " control nodes in DeviceAllow= (runtime) when the plugin first sees it, so a daemon-reload keeps"
                " them, and systemd's Reloading signal starts a pass at once")
        if not os.path.isdir(systemd_dir):
            return logging.INFO, (
                f"Pod repair finds no systemd on this node ({systemd_dir} is absent; {reason}): containers' device"
                " rules are the runtime's (the cgroupfs driver), so repair writes the kernel directly")
        return logging.WARNING, (
            f"Pod repair cannot use systemd although it runs on this node: {reason}. So no scope gets its GPUs in"
            " DeviceAllow= before a daemon-reload: pods lose their GPUs at each reload until the next pass (every"
            " --repair_interval seconds) writes the kernel directly (on cgroup v2 it replaces systemd's device"
            " program in place, and detaches its own replacement once a reload superseded it). Mount the host's"
            " /run/dbus (the system bus socket) in the plugin's container to have the durable repair")

    async def _call(self, member: str, signature: str, body: list[Any], *, path: str = _PATH,
                    interface: str = _MANAGER) -> Any:
        from dbus_fast import Message

        with anyio.fail_after(self.timeout_s):
            return await self._bus.call(Message(destination=SYSTEMD_BUS_NAME, path=path, interface=interface,
                                                member=member, signature=signature, body=body))

    async def unit_of(self, cgroup: ContainerCgroup) -> str | None:
        """The scope systemd manages for ``cgroup``, or None (see module rules)."""
        from dbus_fast import MessageType

        name = cgroup.path.rsplit("/", 1)[-1]
        if not (self.connected and _UNIT.fullmatch(name)):
            return None
        try:
            unit = await self._call("GetUnit", "s", [name])
            if unit.message_type == MessageType.ERROR:
                return None
            group = await self._call("Get", "ss", [_SCOPE, "ControlGroup"], path=unit.body[0],
                                     interface="org.freedesktop.DBus.Properties")
        except (TimeoutError, Exception) as error:  # noqa: BLE001 - an unanswered question is "not managed"
            logger.debug("systemd did not say whether it manages %s: %s", name, error)
            return None
        if group.message_type == MessageType.ERROR:
            return None
        value = getattr(group.body[0], "value", group.body[0])
        return name if value == "/" + cgroup.path.strip("/") else None

    async def allow(self, unit: str, rules: Sequence[DeviceRule], dev_dir: str) -> str:
        """Add ``rules`` to the scope's ``DeviceAllow=`` (runtime); what was done, as one line."""
        from dbus_fast import MessageType, Variant

        entries = device_allow_entries(rules, dev_dir)
        if not self.connected:
            raise SystemdRefused(f"systemd is not reachable on the system bus ({self.address}) to set DeviceAllow="
                                 f" on {unit}")
        try:
            reply = await self._call("SetUnitProperties", "sba(sv)",
                                     [unit, True, [["DeviceAllow", Variant("a(ss)", [list(e) for e in entries])]]])
        except TimeoutError:
            raise SystemdRefused(f"systemd did not answer SetUnitProperties on {unit} within"
                                 f" {self.timeout_s:g} s") from None
        except Exception as error:
            raise SystemdRefused(f"systemd did not answer SetUnitProperties on {unit}: {error}") from error
        if reply.message_type == MessageType.ERROR:
            raise SystemdRefused(f"systemd refused DeviceAllow= on {unit}: {_error_text(reply)}")
        return f"systemd {unit}: DeviceAllow= " + ", ".join(f"{path} {access}" for path, access in entries) + \
            " (runtime)"

    def on_reload(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when a systemd reload has finished (see module rules)."""
        self._callbacks.append(callback)

    def _on_message(self, message: Any) -> None:
        from dbus_fast import MessageType

        if (message.message_type == MessageType.SIGNAL and message.member == "Reloading"
                and message.interface == _MANAGER and message.body == [False]):
            logger.info("systemd finished a reload: a pod repair pass now")
            for callback in list(self._callbacks):
                callback()

    def close(self) -> None:
        if self._bus is not None:
            self._bus.disconnect()
            self._bus = None


def _error_text(reply: Any) -> str:
    detail = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
    return f"{reply.error_name}: {detail}" if detail else str(reply.error_name)
