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
- What such a process imports of this project comes from a read-only
  copy every user can read (``readable_copy()``: ``runtime``, ``actors``,
  ``isolators`` and ``tests.support``, byte-compiled, in a root-owned
  0755 directory under /tmp made once per test session and removed at
  its end), never from the checkout: a checkout may live where only its
  owner can enter (a clone under ``/root``, mode 0700 on Debian), and the
  program imports parts of itself lazily after the drop (a command's
  module when the parser is built). A copy rather than a skip: the
  shared box is the most security-relevant behaviour there is, and a
  root user's clone in their home is the common case on a server, so it
  must be tested there too. The interpreter, its standard library and
  the venv's packages are not copied (about 1.4 GB here): the root-started
  interpreter imports what the program needs of them before the drop, as
  it always did. ``popen(..., root=DIR)`` imports from ``DIR`` instead
  (a test of what an unreadable installation does).
- ``user.cli(*args)`` is ``gpu-isolator ARGS`` as that user.
- ``public_dir(prefix)``: a directory every user may traverse (mode 0755,
  under ``/tmp``), for the sockets, device nodes and programs such users
  reach; removed by the caller (``shutil.rmtree``).
"""

from __future__ import annotations

import atexit
import compileall
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
# an editable install's finder would import this project from its checkout, ahead of sys.path
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
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


COPIED = ("runtime", "actors", "isolators", "tests/__init__.py", "tests/support")
_copy: str | None = None


def readable_copy() -> str:
    """A read-only copy of this project that every user can read (see the
    module rules), made on first use and removed when the session ends."""
    global _copy
    if _copy is None:
        directory = tempfile.mkdtemp(prefix="gpu-isolator-test-copy-", dir="/tmp")
        atexit.register(shutil.rmtree, directory, True)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in COPIED:
            source, target = ROOT / name, os.path.join(directory, name)
            if source.is_dir():
                shutil.copytree(source, target, ignore=ignore)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(source, target)
        compileall.compile_dir(directory, quiet=1)  # as root: the users' imports read bytecode, write none
        for path, dirs, files in os.walk(directory):
            os.chmod(path, 0o755 if path == directory else 0o555)
            for file in files:
                os.chmod(os.path.join(path, file), 0o444)
        _copy = directory
    return _copy


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
              root: str | os.PathLike[str] | None = None, **popen: Any) -> subprocess.Popen:
        """``module.main(args)`` as this user (see module rules); ``cgroup``:
        a ``cgroup.procs`` file to join first, as the user's session;
        ``root``: where this project is imported from (default: the
        readable copy)."""
        groups = ",".join(str(g) for g in self.groups)
        return subprocess.Popen([sys.executable, "-c", _AS_USER, str(root or readable_copy()), str(self.uid),
                                 str(self.gid), groups, cgroup or "-", module, *args], cwd=cwd, **popen)

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
