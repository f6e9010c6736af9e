"""What the service asks the host about its clients and their processes (blocking).

Rules:
- ``listener_uid(host, port)``: the user owning the TCP socket listening at
  ``host:port`` on this host (``/proc/net/tcp`` and ``tcp6``; a wildcard
  listener on that port counts), None when no socket of this host listens
  there. An exec client listens at its PID's address, so this is who sent
  a message -- and a sender that is not on this host has no process here.
- ``process_owner(pid)``: the real and effective uid of a process;
  ``HostError`` when it does not exist.
- ``move_into(pid, cgroup_dir, suffix, controller, uid)``: write ``pid``
  into ``<cgroup_dir>/cgroup.procs`` after checking that it belongs to
  ``uid`` (root may move any process), then read ``/proc/<pid>/cgroup``
  back: the move is confirmed only when the kernel says the process is in
  a cgroup whose path ends with ``suffix`` on that hierarchy
  (``controller``: ``devices`` on v1, ``""`` on the unified hierarchy).
- ``process_counts(dirs)``: how many processes each cgroup holds (0 when
  it is gone). One call per poll, for every cgroup polled.
- All of these block: the service runs each through its executor, one job
  per request or poll.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket

from runtime import Failure

__all__ = ["HostError", "listener_uid", "process_owner", "user_name", "move_into", "process_counts",
           "cgroup_of"]

_LISTEN = "0A"


class HostError(Failure):
    """A fact about a process or socket that does not hold; the message says which."""


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {ipaddress.ip_address(info[4][0]) for info in infos}


def _decode(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word in host (little-endian) order.
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def listener_uid(host: str, port: int, proc_net: str = "/proc/net") -> int | None:
    """Who owns the socket listening at ``host:port`` here (see module rules)."""
    wanted = _addresses(host)
    wanted |= {a.ipv4_mapped for a in wanted if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped}
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, name)) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _LISTEN:
                continue
            hex_address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port:
                continue
            address = _decode(hex_address)
            mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
            if address.is_unspecified or address in wanted or (mapped is not None and mapped in wanted):
                return int(fields[7])
    return None


def process_owner(pid: int, proc: str = "/proc") -> tuple[int, int]:
    """(real uid, effective uid) of process ``pid``."""
    try:
        with open(os.path.join(proc, str(pid), "status")) as status:
            for line in status:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real), int(effective)
    except (FileNotFoundError, ProcessLookupError):
        pass
    except OSError as error:
        raise HostError(f"Cannot read process {pid}: {error.strerror}") from None
    raise HostError(f"Process {pid} does not exist")


def user_name(uid: int | None) -> str | None:
    """The login name of ``uid`` (its number as text when it has none)."""
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def cgroup_of(pid: int, controller: str, proc: str = "/proc") -> str | None:
    """The cgroup path of ``pid`` on the hierarchy with ``controller``
    (``""``: the unified hierarchy), None when it has no such line."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup")) as lines:
            for line in lines:
                number, controllers, path = line.rstrip("\n").split(":", 2)
                if controller == "" and number == "0" and controllers == "":
                    return path
                if controller and controller in controllers.split(","):
                    return path
    except OSError:
        return None
    return None


def move_into(pid: int, cgroup_dir: str, suffix: str, controller: str, uid: int) -> None:
    """Move ``pid`` into the cgroup, checked and confirmed (see module rules)."""
    real, effective = process_owner(pid)
    if uid != 0 and (real != uid or effective != uid):
        raise HostError(f"Process {pid} belongs to uid {real}, not to the sender (uid {uid}); a client may move"
                        " only its own processes")
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(pid))
    except ProcessLookupError:
        raise HostError(f"Process {pid} does not exist") from None
    except OSError as error:
        raise HostError(f"Cannot move process {pid} into the cgroup '{cgroup_dir}': {error.strerror}") from None
    path = cgroup_of(pid, controller)
    if path is None or not (path == suffix or path.endswith(suffix)):
        raise HostError(f"Process {pid} is not in the cgroup '{cgroup_dir}' after the move (the kernel says"
                        f" {path!r})")


def process_counts(cgroup_dirs: list[str]) -> list[int]:
    """How many processes each cgroup holds (0 when it is gone)."""
    counts = []
    for directory in cgroup_dirs:
        try:
            with open(os.path.join(directory, "cgroup.procs")) as procs:
                counts.append(sum(1 for line in procs if line.strip()))
        except OSError:
            counts.append(0)
    return counts
