"""A process inside a cgroup, asked to open device nodes: the kernel's verdict.

Rules:
- A ``DeviceProbe`` is a child (``python -I -S``) moved into a cgroup with
  ``move_to``; ``open(path)`` answers 0 or the errno of opening the node,
  ``mknod`` the same for creating a node (the ``m`` access);
  ``access(path)`` / ``may_mknod(...)`` answer the verdict.
- ``verdict(code)`` is the ONE place a test judges such an answer: DENIED
  iff EPERM (the device cgroup refused it); GRANTED for any other answer
  of the device layer, since the open got past the cgroup: 0 (a driver
  serves the node, as on a GPU host for major 195), ENXIO (no driver
  behind the major, as here), ENODEV (a driver without that minor), ...
  An errno that comes before the cgroup is asked (ENOENT, ENOTDIR,
  EACCES, ELOOP, ENAMETOOLONG: no such node, no permission on the path)
  is neither: ``unreached(<name>)``, so a test expecting either fails.
  Tests compare verdicts, never errnos.
- Probes are killed by ``close()``; a test fixture closes every probe it
  spawned, and the kernel teardown kills whatever is still in a test cgroup.
- ``assert_verdicts(probe, nodes, granted, denied)`` judges several nodes
  at once (one failure shows every verdict).
- ``mknod_nodes`` makes device nodes in a test's own directory (root only).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterable

GRANTED = "granted"
DENIED = "denied"
BEFORE_THE_CGROUP = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP, errno.ENAMETOOLONG})
"""Errnos of a path that never reached the device cgroup's check."""
ABSENT = "unreached(ENOENT)"
"""The verdict on a node that is not there (e.g. not in a container's /dev)."""


def verdict(code: int | str) -> str:
    """The kernel's verdict on an open or mknod that answered ``code`` (0 or
    an errno, or its name as ``errno.errorcode`` spells it); see module rules."""
    if isinstance(code, str):
        if code in ("0", "OK"):
            code = 0
        elif code.startswith("E") and isinstance(getattr(errno, code, None), int):
            code = getattr(errno, code)
        else:
            return f"unknown({code})"  # a message no errno name was found for: no verdict
    if code == errno.EPERM:
        return DENIED
    if code in BEFORE_THE_CGROUP:
        return f"unreached({errno.errorcode[code]})"
    return GRANTED


def verdicts(codes: dict) -> dict:
    """``verdict`` of every value of a mapping (path or name -> answer)."""
    return {key: verdict(code) for key, code in codes.items()}


_PROBE_SCRIPT = r"""
import os, sys
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "exit":
        break
    try:
        if words[0] == "open":
            os.close(os.open(words[1], int(words[2])))
        else:
            path, kind, major, minor = words[1], words[2], int(words[3]), int(words[4])
            mode = (0o20000 if kind == "c" else 0o60000) | 0o600
            os.mknod(path, mode, os.makedev(major, minor))
            os.unlink(path)
        print(0, flush=True)
    except OSError as error:
        print(error.errno, flush=True)
"""


class DeviceProbe:
    """A child process that opens device nodes on request (see module rules)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-u", "-c", _PROBE_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid

    def move_to(self, cgroup_dir: str) -> None:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(self.pid))

    def _ask(self, line: str) -> int:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        """0 when the open succeeded, else its errno."""
        return self._ask(f"open {path} {flags}")

    def mknod(self, directory: str, kind: str, major: int, minor: int) -> int:
        """0 when mknod of a ``kind`` node ``major:minor`` succeeded, else its errno."""
        return self._ask(f"mknod {directory}/mknod-{uuid.uuid4().hex} {kind} {major} {minor}")

    def access(self, path: str, flags: int = os.O_RDWR) -> str:
        """The kernel's verdict on opening ``path`` (``verdict(open(path, flags))``)."""
        return verdict(self.open(path, flags))

    def may_mknod(self, directory: str, kind: str, major: int, minor: int) -> str:
        """The kernel's verdict on creating a ``kind`` node ``major:minor``."""
        return verdict(self.mknod(directory, kind, major, minor))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream:
                stream.close()


def assert_verdicts(probe: "DeviceProbe", nodes: "DeviceNodes", granted: Iterable[tuple[str, int, int] | str] = (),
                    denied: Iterable[tuple[str, int, int] | str] = ()) -> None:
    """``probe`` opens every one of ``granted`` past the device cgroup and is
    refused every one of ``denied``: a ``(kind, major, minor)`` is that node
    of ``nodes`` (a block node opened read-only, a character node read-write),
    a string a path."""
    granted, denied = list(granted), list(denied)

    def opened(key: tuple[str, int, int] | str) -> str:
        if isinstance(key, str):
            return probe.access(key)
        return probe.access(nodes[key], os.O_RDONLY if key[0] == "b" else os.O_RDWR)

    seen = {key: opened(key) for key in granted + denied}
    assert seen == {**dict.fromkeys(granted, GRANTED), **dict.fromkeys(denied, DENIED)}, seen


class DeviceNodes:
    """Device nodes made in a directory, their paths by ``(kind, major, minor)``."""

    def __init__(self, directory: str, paths: dict[tuple[str, int, int], str]) -> None:
        self.directory = directory
        self.paths = paths

    def __getitem__(self, key: tuple[str, int, int]) -> str:
        return self.paths[key]


def mknod_nodes(directory: str, nodes: Iterable[tuple[str, int, int]], name: str = "{kind}{major}_{minor}",
                mode: int = 0o666) -> DeviceNodes:
    """Device nodes ``(kind, major, minor)`` (kind ``c`` or ``b``) in
    ``directory``, named by ``name`` (root only)."""
    paths = {}
    for kind, major, minor in nodes:
        path = os.path.join(directory, name.format(kind=kind, major=major, minor=minor))
        os.mknod(path, (stat.S_IFCHR if kind == "c" else stat.S_IFBLK) | mode, os.makedev(major, minor))
        paths[(kind, major, minor)] = path
    return DeviceNodes(directory, paths)
