"""The ``ledger`` command of the ``gpu-isolator`` CLI: the operator's view of the node ledger.

Rules (SPEC R-NL-5):
- ``gpu-isolator ledger [--node_ledger=DIR] [--host_file=FILE] [--json]``
  shows every unit of the node, one a row: the unit (``195:3``,
  ``195:0/gi1/ci0``), its UUID, its state (``free``; ``held``; ``mig``: a
  GPU some of whose MIG devices are held), the owner with whether it runs
  (the kernel's answer: its lock), the holders, and health (what the front
  doors running on the node report: ``healthy``, or ``unhealthy`` with the
  reason and who said so). The units are NVML's (the real one, or
  ``--host_file``'s simulated node), plus any leased unit NVML does not
  list; without NVML only the leased units are shown, and the first line
  says why. ``--json`` prints one JSON object: ``directory``, ``units``
  (each with ``unit``, ``uuid``, ``state``, ``owner``, ``alive``,
  ``holders``, ``health``, ``reason``, ``reported_by``) and ``owners``
  (owner -> running).
- ``gpu-isolator ledger release --owner OWNER [--node_ledger=DIR]`` returns
  every unit of an owner that does not run (the operator's act for a front
  door that will never come back) and prints what it returned; it is
  refused (exit 2, one line) while that owner runs.
- The directory is ``--node_ledger`` when given, else the default every
  front door uses (``actors.ledger.node_ledger_dir``: the environment's
  ``GPU_ISOLATOR_NODE_LEDGER`` or ``/run/gpu-isolator/ledger``). The
  command never makes the directory: a missing one is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_command", "ledger_rows"]

PROG = "gpu-isolator"


def add_command(sub: Any) -> None:
    ledger = sub.add_parser(
        "ledger", help="show which front door holds each GPU of this node (the node ledger)",
        description="Show every unit (GPU, MIG device) of this node: free, or held by which front door (an"
                    " isolator agent, serve, the Kubernetes plugins), whether that front door runs, for whom,"
                    " and its health. 'ledger release --owner OWNER' returns the units of a front door that"
                    " will not come back.",
    )
    _common(ledger)
    ledger.add_argument("--host_file", "--host-file", metavar="FILE",
                        help="a simulated node (TOML or JSON host file) instead of this machine's GPUs")
    ledger.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ledger.set_defaults(func=_cmd_ledger)
    from .cli import _commands

    actions = _commands(ledger, "ledger_command", required=False)
    release = actions.add_parser(
        "release", help="return every unit of a front door that does not run any more",
        description="Return every unit the node ledger says OWNER holds. Refused while OWNER runs (a process"
                    " holds its lock): a running front door returns its units itself. For a front door that"
                    " will never come back; one that restarts reconciles its units by itself.",
    )
    _common(release, default=argparse.SUPPRESS)  # the ledger's own --node_ledger, when given there, stays
    release.add_argument("--owner", metavar="OWNER", required=True,
                         help="the owner as 'gpu-isolator ledger' shows it, e.g. isolator:/var/lib/gpu-isolator")
    release.set_defaults(func=_cmd_release)


def _common(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument("--node_ledger", "--node-ledger", metavar="DIR", default=default,
                        help="the node ledger's directory (default: $GPU_ISOLATOR_NODE_LEDGER, else"
                             " /run/gpu-isolator/ledger)")


def _directory(args: argparse.Namespace) -> str:
    from actors.flags import Flags
    from actors.ledger import DEFAULT_NODE_LEDGER, node_ledger_dir

    from .cli import UsageError

    if args.node_ledger is not None:
        if not args.node_ledger:
            raise UsageError(f"{PROG} ledger: error: --node_ledger is empty: name the ledger's directory")
        return args.node_ledger
    directory = node_ledger_dir(Flags())  # the default every front door on the real NVML uses
    if directory is None:
        raise UsageError(f"{PROG} ledger: error: $GPU_ISOLATOR_NODE_LEDGER is empty (the ledger is off);"
                         f" name one with --node_ledger=DIR (the default is {DEFAULT_NODE_LEDGER})")
    return directory


def _cmd_ledger(args: argparse.Namespace) -> int:
    from actors.ledger import LedgerDirectory
    from actors.nvml import NvmlError, NvmlService

    from .cli import _run_async

    path = _directory(args)

    async def show() -> int:
        from runtime import Executor

        executor = Executor(1, name="ledger-command")
        try:
            view = await executor.run(_read_view, LedgerDirectory, path)
        finally:
            executor.shutdown(wait=False)
        inventory = None
        note = None
        try:
            service = await NvmlService.open(args.host_file)
        except NvmlError as error:
            if args.host_file is not None:
                raise
            note = f"NVML is not available ({error.headline}): only the units held are shown"
        else:
            try:
                inventory = await service.inventory()
            finally:
                await service.close()
        rows = ledger_rows(view, inventory)
        if args.json:
            print(json.dumps({"directory": view.directory, "units": rows,
                              "owners": dict(sorted(view.alive.items()))}), flush=True)
        else:
            print(_render(view.directory, rows, note), flush=True)
        return 0

    return _run_async(show)


def _read_view(directory_type: Any, path: str) -> Any:
    directory = directory_type.open(path, create=False)
    try:
        return directory.view()
    finally:
        directory.close()


def _cmd_release(args: argparse.Namespace) -> int:
    from actors.ledger import LedgerDirectory, LedgerError, unreadable_help

    unreadable = unreadable_help(args.owner)
    if unreadable is not None:  # no front door: nothing runs that could return it
        raise LedgerError(f"{args.owner} is no front door: {unreadable}")
    path = _directory(args)
    directory = LedgerDirectory.open(path, create=False)
    try:
        released = directory.release_owner(args.owner)
    finally:
        directory.close()
    if not released:
        print(f"{args.owner} holds no unit in the node ledger {path}", flush=True)
        return 0
    print(f"Returned {len(released)} unit(s) of {args.owner} (not running) in the node ledger {path}:", flush=True)
    for lease in released:
        print(f"  {lease.named()} {lease.held_for()}", flush=True)
    return 0


def ledger_rows(view: Any, inventory: Any = None) -> list[dict[str, Any]]:
    """One row per unit (see module rules): the inventory's units in NVML order,
    then leased units it does not list."""
    leases = view.leases
    units: list[tuple[str, str, str | None]] = []  # (device, uuid, parent uuid)
    if inventory is not None:
        for gpu in inventory.gpus:
            units.append((str(gpu.gpu), gpu.uuid, None))
            for mig in inventory.mig_devices_of(gpu.index):
                units.append((str(mig.device), mig.uuid, gpu.uuid))
    listed = {uuid for _, uuid, _ in units}
    for uuid, lease in sorted(leases.items(), key=lambda item: (item[1].device, item[0])):
        if uuid not in listed:
            units.append((lease.device, uuid, lease.parent))
    reports: dict[str, list[tuple[str, str]]] = {}
    for owner, unhealthy in sorted(view.health.items()):
        for uuid, reason in unhealthy.items():
            reports.setdefault(uuid, []).append((owner, reason))
    rows = []
    for device, uuid, _parent in units:
        lease = leases.get(uuid)
        children = [other for other in leases.values() if other.parent == uuid]
        if lease is not None:
            state, owner, holders = "held", lease.owner, list(lease.holders)
        elif children:
            state, owner = "mig", None
            holders = [f"{child.device or child.unit}: {child.owner}" for child in children]
        else:
            state, owner, holders = "free", None, []
        said = reports.get(uuid, [])
        rows.append({
            "unit": device, "uuid": uuid, "state": state, "owner": owner,
            "alive": view.alive.get(owner) if owner is not None else None,
            "holders": holders, "health": "unhealthy" if said else "healthy",
            "reason": "; ".join(reason for _, reason in said) or None,
            "reported_by": [owner_name for owner_name, _ in said],
        })
    return rows


def _render(directory: str, rows: list[dict[str, Any]], note: str | None) -> str:
    from actors.ledger import unreadable_help

    lines = [f"node ledger {directory}"] + ([note] if note else [])
    header = ("UNIT", "UUID", "STATE", "OWNER", "HOLDERS", "HEALTH")
    table = [header]
    for row in rows:
        owner = "-"
        if row["owner"] is not None:
            state = ("unreadable: remove the file once no container uses the unit" if unreadable_help(row["owner"])
                     else "running" if row["alive"] else "not running")
            owner = f"{row['owner']} ({state})"
        health = row["health"]
        if row["reason"]:
            health += f": {row['reason']} ({', '.join(row['reported_by'])})"
        table.append((row["unit"] or "?", row["uuid"], row["state"], owner, ", ".join(row["holders"]) or "-",
                      health))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(r, widths)) + "  " + r[-1])
    return "\n".join(line.rstrip() for line in lines)

