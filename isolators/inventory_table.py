"""Text rendering of a node's inventory for ``gpu-isolator inspect``.

Rules:
- ``render_gpu_table`` lists one GPU a row: NVML index, minor, UUID, name,
  PCI bus id, memory (MiB), NUMA node, MIG; plus a health/allocation column
  when given. Columns are padded to their widest cell; no colours. The MIG
  devices of a GPU follow its row (R-MG-3): IDX ``<gpu>:<mig index>`` (as
  NVIDIA names them), UUID ``MIG-…``, NAME ``└ MIG <profile> (GI g, CI c)``,
  memory; ``status`` may key them by their ``MigDevice``.
- ``render_topology`` is a matrix like ``nvidia-smi topo -m``: ``X`` on the
  diagonal, ``NV<n>`` for n NVLink links, else the PCIe level (``BRD`` same
  board, ``PIX`` one switch, ``PXB`` several switches, ``PHB`` host bridge,
  ``NODE`` same NUMA node, ``SYS`` across sockets, ``-`` unknown), then a
  legend.
- ``render_inventory`` is the header line (source, driver, GPU count), the
  table and the matrix. Pure functions of a ``NodeInventory``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from actors.nvml import TOPOLOGY_NAMES, NodeInventory

__all__ = ["render_inventory", "render_gpu_table", "render_topology", "topology_cell"]

_LEGEND = """Legend:
  X    = self
  NV#  = connected by # NVLink links
  BRD  = on the same board
  PIX  = through one PCIe switch
  PXB  = through several PCIe switches
  PHB  = through a PCIe host bridge
  NODE = within one NUMA node
  SYS  = across NUMA nodes (sockets)
  -    = unknown"""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


def render_gpu_table(inventory: NodeInventory, status: Mapping[Any, str] | None = None) -> str:
    """The GPU table; ``status`` adds a STATUS column (e.g. "free", "allocated")."""
    header = ["IDX", "MINOR", "UUID", "NAME", "BUS ID", "MEMORY", "NUMA", "MIG"]
    if status is not None:
        header.append("STATUS")
    rows = []
    for info in inventory.gpus:
        row = [
            str(info.index),
            str(info.minor),
            info.uuid,
            info.name,
            info.pci_bus_id,
            f"{info.memory_total_mib} MiB",
            "-" if info.numa_node is None else str(info.numa_node),
            "on" if info.mig else "off",
        ]
        if status is not None:
            row.append(status.get(info.gpu, ""))
        rows.append(row)
        for mig in inventory.mig_devices_of(info.index) if inventory.mig_devices else ():
            row = [
                f"{info.index}:{mig.index}", "-", mig.uuid, f"└ MIG {mig.profile} (GI {mig.gi}, CI {mig.ci})",
                "", f"{mig.memory_total_mib} MiB", "", "",
            ]
            if status is not None:
                row.append(status.get(mig.device, ""))
            rows.append(row)
    if not rows:
        return "No GPUs."
    return _table(header, rows)


def topology_cell(inventory: NodeInventory, first: int, second: int) -> str:
    """One cell of the matrix for NVML indices ``first`` and ``second``."""
    if first == second:
        return "X"
    links = inventory.by_index(first).nvlink.get(second, 0)
    if links:
        return f"NV{links}"
    level = inventory.level(first, second)
    if level is None:
        return "-"
    return TOPOLOGY_NAMES.get(level, str(level))


def render_topology(inventory: NodeInventory, legend: bool = True) -> str:
    """The topology matrix (and its legend)."""
    indices = [info.index for info in inventory.gpus]
    if not indices:
        return "No GPUs."
    header = ["", *(f"GPU{i}" for i in indices), "NUMA"]
    rows = []
    for i in indices:
        info = inventory.by_index(i)
        rows.append(
            [f"GPU{i}", *(topology_cell(inventory, i, j) for j in indices), "-" if info.numa_node is None else str(info.numa_node)]
        )
    text = _table(header, rows)
    return f"{text}\n\n{_LEGEND}" if legend else text


def render_inventory(inventory: NodeInventory, status: Mapping[Any, str] | None = None) -> str:
    """Header, GPU table and topology matrix."""
    kind = "simulated node" if inventory.kind == "simulated" else "NVML"
    header = (
        f"{kind} ({inventory.source}), driver {inventory.driver_version},"
        f" {len(inventory.gpus)} GPU{'s' if len(inventory.gpus) != 1 else ''}"
    )
    if inventory.mig_devices:
        count = len(inventory.mig_devices)
        header += f", {count} MIG device{'s' if count != 1 else ''}"
    parts = [header, "", render_gpu_table(inventory, status)]
    if inventory.gpus:
        parts += ["", "Topology:", render_topology(inventory)]
    if inventory.control_devices:
        devices = ", ".join(f"{name} {number}" for name, number in inventory.control_devices.items())
        parts += ["", f"Control devices: {devices}"]
    return "\n".join(parts)
