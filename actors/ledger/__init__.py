"""The node ledger (SPEC section 22): every front door of a node shares its GPUs.

A directory of lease files, one per unit held (a whole GPU or a MIG
device; a MIG device and its parent conflict), each naming its *owner* (a
front door instance: ``isolator:<work_dir>``, ``serve:<socket>``,
``kubelet-plugin:<resource>``, ``dra-plugin:<driver>``) and the holders
inside it; and a lock per owner that its process holds while it runs, so
the kernel tells a live owner from a dead one. The allocator actor
(``actors.allocator``) is the one place that takes and returns leases; this
package is the files (``LedgerDirectory``: every call blocks, run it in an
executor), the values (``Lease``, ``LeaseBatch``, ``BatchResult``,
``LedgerView``), the pure decision (``decide``) and where the directory is
(``node_ledger_dir``). Rules of each piece are at the top of its module.
"""

from ._batch import BatchResult, LeaseBatch, TakeRequest, TakeResult, decide
from ._config import DEFAULT_NODE_LEDGER, NODE_LEDGER_ENV, describe_node_ledger, node_ledger_dir
from ._directory import LOCK_TIMEOUT, LedgerDirectory, LedgerView, OwnerLock
from ._errors import LedgerError
from ._lease import UNREADABLE, Lease, LeaseConflict, blocking, describe_conflicts, unreadable_help
from ._names import (
    MAX_HOLDER,
    OWNER_KINDS,
    check_holder,
    check_owner,
    dra_plugin_owner,
    isolator_owner,
    kubelet_plugin_owner,
    lease_file_name,
    owner_file_name,
    serve_owner,
)

__all__ = [
    "BatchResult", "LeaseBatch", "TakeRequest", "TakeResult", "decide",
    "DEFAULT_NODE_LEDGER", "NODE_LEDGER_ENV", "describe_node_ledger", "node_ledger_dir",
    "LOCK_TIMEOUT", "LedgerDirectory", "LedgerView", "OwnerLock", "LedgerError", "Lease", "LeaseConflict",
    "blocking", "describe_conflicts", "UNREADABLE", "unreadable_help", "MAX_HOLDER", "OWNER_KINDS", "check_holder", "check_owner", "dra_plugin_owner", "isolator_owner",
    "kubelet_plugin_owner", "lease_file_name", "owner_file_name", "serve_owner",
]
