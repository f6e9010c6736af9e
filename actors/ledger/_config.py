"""Where a front door finds the node ledger (``Flags.node_ledger``).

Rules (SPEC R-NL-1):
- ``node_ledger_dir(flags, environ)`` is the directory a front door
  uses, or None when the ledger is off:
  - ``flags.node_ledger`` given (not None): that directory; the empty
    string turns the ledger off.
  - Not given, on the real NVML (``flags.host_file`` is None): the
    environment's ``GPU_ISOLATOR_NODE_LEDGER`` when set (empty: off), else
    ``DEFAULT_NODE_LEDGER`` (``/run/gpu-isolator/ledger``) -- the same for
    every front door, so they coordinate with no configuration. A value
    that is not an absolute path is a ``LedgerError`` naming the variable
    (as ``--node_ledger`` is a flag error).
  - Not given, on a simulated node (a host file: the demo, laptops,
    tests): off, so nothing there needs root or touches ``/run``.
- ``describe_node_ledger(flags, environ)`` is the line a front door logs
  at start: where its ledger is, or that it is off and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from actors.flags import Flags

from ._errors import LedgerError

__all__ = ["DEFAULT_NODE_LEDGER", "NODE_LEDGER_ENV", "node_ledger_dir", "describe_node_ledger"]

DEFAULT_NODE_LEDGER = "/run/gpu-isolator/ledger"
NODE_LEDGER_ENV = "GPU_ISOLATOR_NODE_LEDGER"


def node_ledger_dir(flags: Flags, environ: Mapping[str, str] | None = None) -> str | None:
    """The node ledger directory for ``flags`` (None: off; see module rules)."""
    if flags.node_ledger is not None:
        return flags.node_ledger or None
    if flags.host_file is not None:
        return None
    env = os.environ if environ is None else environ
    value = env.get(NODE_LEDGER_ENV)
    if value is not None:
        if value and (not value.startswith("/") or "\x00" in value):
            raise LedgerError(f"Invalid ${NODE_LEDGER_ENV} {value!r}: expected an absolute directory (as"
                              " --node_ledger), or an empty value to turn the node ledger off")
        return value or None
    return DEFAULT_NODE_LEDGER


def describe_node_ledger(flags: Flags, environ: Mapping[str, str] | None = None) -> str:
    """Where the node ledger is, or why it is off (a front door's start-up line)."""
    env = os.environ if environ is None else environ
    directory = node_ledger_dir(flags, env)
    if directory is not None:
        return f"node ledger {directory}: GPUs are shared with the other front doors of this node"
    if flags.node_ledger is not None:
        why = "--node_ledger is empty"
    elif flags.host_file is None:
        why = f"${NODE_LEDGER_ENV} is empty"
    else:
        why = "a simulated node (--host_file) has none unless --node_ledger=DIR is given"
    return (f"node ledger off ({why}): this front door does not coordinate its GPUs with other front"
            " doors of this node; never run another beside it")
