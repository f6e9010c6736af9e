"""The embedded simulated node: the demo's node, and ``inspect --simulated``'s.

Rules:
- ``EMBEDDED_HOST_FILE`` is a host file (TOML) for an 8-GPU node shaped like
  a DGX-1 without its cross links: two NVLink islands of four GPUs (every
  pair inside an island joined by 6 links), pairs of GPUs behind one PCIe
  switch, one NUMA node per island.
- ``embedded_host_spec()`` parses it (always valid; a test checks it).
- Only a caller that chose it uses it, and says so on screen (R-NV-1): the
  library never falls back to it when NVML is missing.
"""

from __future__ import annotations

from ._hostfile import HostSpec, parse_host_file

__all__ = ["EMBEDDED_HOST_FILE", "embedded_host_spec"]

_BUSES = ["06", "07", "0A", "0B", "85", "86", "89", "8A"]


def _render() -> str:
    lines = [
        "# Embedded simulated node: 8 GPUs, two NVLink islands of 4 (0-3, 4-7).",
        'driver_version = "550.54.15"',
        "",
    ]
    for index in range(8):
        island = index // 4
        peers = [peer for peer in range(island * 4, island * 4 + 4) if peer != index]
        nvlink = ", ".join(f'"{peer}" = 6' for peer in peers)
        lines += [
            "[[gpus]]",
            f'uuid = "GPU-5a1d0000-0000-4000-8000-00000000000{index}"',
            'name = "Tesla V100-SXM2-32GB"',
            f'pci_bus_id = "00000000:{_BUSES[index]}:00.0"',
            "memory_total_mib = 32768",
            f"numa_node = {island}",
            f"pcie_switch = {index // 2}",
            f"host_bridge = {island}",
            f"nvlink = {{ {nvlink} }}",
            "power_mw = 45000",
            "temperature_c = 38",
            "",
        ]
    return "\n".join(lines)


EMBEDDED_HOST_FILE = _render()


def embedded_host_spec() -> HostSpec:
    """The embedded node, resolved."""
    return parse_host_file(EMBEDDED_HOST_FILE, "<embedded 8-GPU node>.toml")
