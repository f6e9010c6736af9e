"""The project's bytecode, compiled once a test session for the processes the tests start.

Rules:
- The suite starts hundreds of Python processes of this project (``serve``,
  ``exec``, both Kubernetes plugins, the fault runs' agents, the CLI). Where
  the environment says ``PYTHONDONTWRITEBYTECODE=1`` (this machine's does),
  each of them compiles every module of the project it imports from source,
  ~0.3 s of CPU a start (a DRA driver's start: 1.3 s with it, 0.8 s without)
  -- and writes nothing, so the next start compiles them again.
- ``compile_project()`` writes, once a session (the tests' conftest calls it
  as the session is configured), the bytecode of the project's packages
  where Python looks for it (``__pycache__``, ignored by git), as
  ``compileall`` does: only a module whose bytecode is missing or older
  than its source is compiled. Python reads bytecode whatever that variable
  says; it only keeps Python from writing it. What a process runs is the
  same source either way.
- ``keep_bytecode()`` lets the test session's own process write bytecode
  too (``sys.dont_write_bytecode = False``, this process only; the conftest
  calls it beside ``compile_project``): pytest's rewrite of each test module
  (its assertions) is then kept in ``__pycache__`` and read by the next
  session instead of being done again -- collecting the suite takes 5 s,
  not 16 s, on 2 cores. The processes the tests start keep the
  environment's setting (they read what ``compile_project`` wrote).
- A checkout the session cannot write (another user's) is left as it is:
  its processes compile from source, as before; nothing fails.
"""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path

__all__ = ["PACKAGES", "compile_project", "keep_bytecode"]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "actors", "isolators", "scripts", "benchmarks", "tests")
"""The project's own packages (the test helpers too: the fault runs start them as processes)."""


def compile_project(root: Path = ROOT) -> bool:
    """Bytecode for every module of ``PACKAGES`` under ``root`` (see module rules); whether all were written."""
    done = True
    for name in PACKAGES:
        directory = root / name
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            done = False
            continue
        done = bool(compileall.compile_dir(str(directory), quiet=2)) and done
    return done


def keep_bytecode() -> None:
    """Let this process write the bytecode of what it imports, pytest's rewritten test modules too (see module
    rules)."""
    sys.dont_write_bytecode = False
