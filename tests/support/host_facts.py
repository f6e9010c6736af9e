"""The host's own facts a test may read only on purpose.

Rules:
- ``HOST_FACTS`` are the files that describe the machine the tests run on,
  not a simulated node: the loader cache (a volume built from it copies
  every driver library the host has: 300 MB a volume on a GPU host) and
  ``/proc/devices`` (its majors would judge a node's mknod'ed control
  devices). A simulated node has its own (``SimulatedNode.ld_cache`` and
  ``proc_dir``).
- The node ledger every front door of the host shares by default
  (``/run/gpu-isolator/ledger``, SPEC R-NL-1) is one of them too, with
  everything below it: a test's front doors use a ledger of their own
  (``--node_ledger``), never the host's. ``ledger_made()`` says whether the
  host's exists now and did not before ``ledger_before()`` (a child
  process's front door, which no hook sees, made it).
- ``watch()`` installs (once) an audit hook that records every Python
  ``open`` (and ``mkdir``) of one of them, in any thread of this process; ``opened()``
  and ``forget()`` read and clear the record. The tests' conftest fails a
  test that opened one unless it is marked ``host_facts`` (a test about
  the host's own cache). Child processes are not watched: what they read
  comes from the flags the test gives them (a node's ``flag_values``).
- ``own_facts(directory)`` writes a node's own in ``directory`` (an empty
  loader cache, an empty proc dir) and returns them as flags
  (``ld_cache``, ``proc_dir``); ``own_fact_args`` as CLI options.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from actors.ledger import DEFAULT_NODE_LEDGER
from actors.volume.testing import write_ld_cache

HOST_FACTS = frozenset({"/etc/ld.so.cache", "/proc/devices"})
HOST_LEDGER = DEFAULT_NODE_LEDGER
MARKER = "host_facts"

_opened: list[str] = []
_watching = False


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event in ("open", "os.mkdir") and args and isinstance(args[0], (str, os.PathLike)):
        path = os.fspath(args[0])
        if path in HOST_FACTS or os.path.normpath(path) in HOST_FACTS:
            _opened.append(path)
        elif path.startswith(HOST_LEDGER) and os.path.normpath(path).startswith(HOST_LEDGER):
            _opened.append(path)


def ledger_before() -> bool:
    """Whether the host's node ledger exists now (before a test)."""
    return os.path.lexists(HOST_LEDGER)


def ledger_made(existed: bool) -> bool:
    """Whether the host's node ledger exists now though it did not before (``ledger_before``)."""
    return not existed and os.path.lexists(HOST_LEDGER)


def own_facts(directory: str | os.PathLike[str]) -> dict[str, str]:
    """A node's own loader cache and proc dir in ``directory``, as flags."""
    proc = os.path.join(directory, "proc")
    os.makedirs(proc, exist_ok=True)
    return {"ld_cache": write_ld_cache(os.path.join(directory, "ld.so.cache")), "proc_dir": proc}


def own_fact_args(directory: str | os.PathLike[str]) -> list[str]:
    """``own_facts`` as ``--ld-cache FILE --proc-dir DIR`` (``cdi generate``)."""
    facts = own_facts(directory)
    return ["--ld-cache", facts["ld_cache"], "--proc-dir", facts["proc_dir"]]


def watch() -> None:
    """Record every open of a host fact from now on (idempotent)."""
    global _watching
    if not _watching:
        sys.addaudithook(_hook)
        _watching = True


def opened() -> list[str]:
    return list(_opened)


def forget() -> None:
    _opened.clear()
