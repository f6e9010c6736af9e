"""The node ledger as tests read it (SPEC 22).

Rules:
- ``leases(directory)`` is every lease of the ledger at ``directory`` as
  ``{device: (owner, holders)}`` (``195:3`` -> the owner and its holders),
  read under the ledger's mutex.
- ``owner_free(directory, owner)``: whether another process could take
  ``owner``'s lock now (the kernel's answer: no process of it runs).
- ``ledger_command(*args)`` runs ``gpu-isolator ledger ARGS`` (bounded),
  its ``CompletedProcess`` with text output.
- ``until(check, what, bound)`` waits (bounded, ``bound`` seconds, 10 by
  default) for the state ``check()`` asserts -- a lease returned after its
  linger, holders written behind -- and fails naming ``what`` when it does
  not come: tests wait for state, never for time.
- ``inode_limited(path)`` mounts a tmpfs of its own at ``path`` (root
  only: the test skips otherwise; unmounted afterwards, whatever
  happened), whose ``leave_free(n)`` takes every inode but ``n`` with
  filler files (a lease can then be removed, and ``n`` more written: the
  kernel's ENOSPC, as on a full ``/run``) and ``refill()`` frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from actors.ledger import LedgerDirectory, LedgerError

__all__ = ["leases", "owner_free", "ledger_command", "until", "inode_limited", "InodeLimited", "BOUND"]

BOUND = 10.0
REPO = Path(__file__).resolve().parents[2]


def leases(directory: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every lease: device -> (owner, holders)."""
    ledger = LedgerDirectory.open(os.fspath(directory))
    try:
        return {lease.device: (lease.owner, lease.holders) for lease in ledger.read().values()}
    finally:
        ledger.close()


def owner_free(directory: str | os.PathLike[str], owner: str) -> bool:
    """Whether ``owner``'s lock may be taken now (see module rules)."""
    ledger = LedgerDirectory.open(os.fspath(directory))
    try:
        ledger.hold_owner(owner).release()
        return True
    except LedgerError:
        return False
    finally:
        ledger.close()


def ledger_command(*args: str) -> subprocess.CompletedProcess:
    """``gpu-isolator ledger ARGS`` (see module rules)."""
    return subprocess.run([sys.executable, "-m", "isolators", "ledger", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


async def until(check: Callable[[], bool], what: str, bound: float = BOUND) -> None:
    """Wait until ``check()`` holds, at most ``bound`` seconds (see module rules)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while not check():
        assert loop.time() < deadline, f"not within {bound:g} s: {what}"
        await asyncio.sleep(0.005)


class InodeLimited:
    """A tmpfs with few inodes (see module rules)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / ".filler"

    def free(self) -> int:
        return os.statvfs(self.path).f_ffree

    def leave_free(self, count: int) -> None:
        """Take every free inode but ``count`` with filler files."""
        self._filler.mkdir(exist_ok=True)
        made = len(os.listdir(self._filler))
        while self.free() > count:
            (self._filler / str(made)).touch()
            made += 1
        assert self.free() == count, f"{self.path}: {self.free()} inodes free, not {count}"

    def refill(self) -> None:
        """Free every inode the fillers took."""
        shutil.rmtree(self._filler, ignore_errors=True)


@contextlib.contextmanager
def inode_limited(path: Path, inodes: int = 64) -> Iterator[InodeLimited]:
    """A tmpfs of ``inodes`` inodes mounted at ``path`` (see module rules)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a ledger filesystem that fills up) needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=1m,nr_inodes={inodes},mode=0755",
                              "gi-test-ledger", str(path)], capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield InodeLimited(path)
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True, capture_output=True, timeout=30)
