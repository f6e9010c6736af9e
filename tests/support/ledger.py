"""The node ledger as tests read it (SPEC 22).

Rules:
- ``leases(directory)`` is every lease of the ledger at ``directory`` as
  ``{device: (owner, holders)}`` (``195:3`` -> the owner and its holders),
  read under the ledger's mutex.
- ``ledger_command(*args)`` runs ``gpu-isolator ledger ARGS`` (bounded),
  its ``CompletedProcess`` with text output.
- ``until(check, what, bound)`` waits (bounded, ``bound`` seconds, 10 by
  default) for the state ``check()`` asserts -- a lease returned after its
  linger, holders written behind -- and fails naming ``what`` when it does
  not come: tests wait for state, never for time.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from actors.ledger import LedgerDirectory

__all__ = ["leases", "ledger_command", "until", "BOUND"]

BOUND = 10.0
REPO = Path(__file__).resolve().parents[2]


def leases(directory: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every lease: device -> (owner, holders)."""
    ledger = LedgerDirectory.open(os.fspath(directory))
    try:
        return {lease.device: (lease.owner, lease.holders) for lease in ledger.read().values()}
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
