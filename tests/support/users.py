"""Real throwaway user accounts, and processes that are theirs, for tests (root only).

Rules:
- ``throwaway_users(count)`` (a context manager) creates ``count`` real
  accounts with ``useradd`` (unique names ``gi<pid><hex>``, no home, a
  group of their own) and removes them with ``userdel`` on the way out,
  whether the test passed or not. ``throwaway_group()`` likewise makes a
  group (``groupadd``/``groupdel``), ``ThrowawayUser.join(group)`` adds a
  user to it. Without root, ``useradd`` or ``userdel`` they skip with the
  reason.
- ``user.popen(module, *args, cgroup=None)`` runs ``module.main(args)``
  of this project as that user: the interpreter starts as root and
  imports what the program needs (this interpreter may live where the
  user cannot read, e.g. under ``/root``), joins ``cgroup`` (a
  ``cgroup.procs`` file: the user's session, as a login would place it)
  when given, then drops to the user -- supplementary groups, gid, then
  uid, real, effective and saved -- marks itself dumpable as a process
  the user started would be, and runs. From there on the kernel knows it
  as the user's process, nothing else: ``SO_PEERCRED``,
  ``/proc/<pid>/status``, signals and ptrace all say so.
- ``user.cli(*args)`` is ``gpu-isolator ARGS`` as that user.
- ``public_dir(prefix)``: a directory every user may traverse (mode 0755,
  under ``/tmp``), for the sockets, device nodes and programs such users
  reach; removed by the caller (``shutil.rmtree``).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]

_AS_USER = r"""
import ctypes, importlib, os, sys
sys.path.insert(0, sys.argv.pop(1))  # this project (tests.support modules are imported from it)
import json, socket, signal, select, secrets, threading, errno, struct, array, shlex, time, argparse, encodings.idna
import msgspec
import isolators.cli
from isolators.service import _client, _commands, _demand, _exec, _frames, _launcher, _messages, _status
uid, gid, groups, cgroup, module = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
main = isolators.cli.main if module == "isolators" else importlib.import_module(module).main
if cgroup != "-":  # a session of the user's in that cgroup, as a login would make one
    with open(cgroup, "w") as procs:
        procs.write(str(os.getpid()))
os.setgroups([int(g) for g in groups.split(",") if g])
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: as a process the user started
sys.argv = [module, *sys.argv[6:]]
sys.exit(main(sys.argv[1:]))
"""


def _skip_unless_able() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create throwaway user accounts")
    for tool in ("useradd", "userdel", "groupadd", "groupdel", "gpasswd"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (the passwd package) to create throwaway user accounts")


def unique_name(tag: str = "") -> str:
    return f"gi{tag}{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"


class ThrowawayUser:
    """A real account that exists for one test (see module rules)."""

    def __init__(self, name: str) -> None:
        entry = pwd.getpwnam(name)
        self.name = name
        self.uid = entry.pw_uid
        self.gid = entry.pw_gid

    @property
    def groups(self) -> list[int]:
        return os.getgrouplist(self.name, self.gid)

    def join(self, group: str) -> None:
        subprocess.run(["gpasswd", "-a", self.name, group], check=True, capture_output=True)

    def popen(self, module: str, *args: str, cwd: str | os.PathLike[str] = "/", cgroup: str | None = None,
              **popen: Any) -> subprocess.Popen:
        """``module.main(args)`` as this user (see module rules); ``cgroup``:
        a ``cgroup.procs`` file to join first, as the user's session."""
        groups = ",".join(str(g) for g in self.groups)
        return subprocess.Popen([sys.executable, "-c", _AS_USER, str(ROOT), str(self.uid), str(self.gid), groups,
                                 cgroup or "-", module, *args], cwd=cwd, **popen)

    def cli(self, *args: str, **popen: Any) -> subprocess.Popen:
        """``gpu-isolator ARGS`` as this user."""
        return self.popen("isolators", *args, **popen)

    def __repr__(self) -> str:
        return f"<user {self.name} uid {self.uid}>"


@contextlib.contextmanager
def throwaway_users(count: int, tag: str = "") -> Iterator[list[ThrowawayUser]]:
    _skip_unless_able()
    names: list[str] = []
    try:
        for _ in range(count):
            name = unique_name(tag)
            subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            names.append(name)
        yield [ThrowawayUser(name) for name in names]
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True)  # its own group goes with it


@contextlib.contextmanager
def throwaway_group() -> Iterator[str]:
    _skip_unless_able()
    name = unique_name("g")
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["groupdel", name], capture_output=True)
        with contextlib.suppress(KeyError):
            grp.getgrnam(name)  # still there: nothing more to do (it is reported by useradd's tools)


def public_dir(prefix: str = "gpu-isolator-test-") -> str:
    """A fresh directory under /tmp that every user may traverse (0755)."""
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(directory, 0o755)
    return directory
