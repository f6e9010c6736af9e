"""``gpu-isolator inspect``'s rendering of a node."""

from __future__ import annotations

from actors.gpu import Gpu
from isolators.inventory_table import render_gpu_table, render_inventory, render_topology, topology_cell
from actors.nvml import open_nvml, read_inventory


def test_table_lists_every_gpu_with_its_facts(data_dir):
    inventory = read_inventory(open_nvml(data_dir / "pcie4.toml"))
    table = render_gpu_table(inventory, {Gpu(195, 1): "allocated"})
    lines = table.splitlines()
    assert lines[0].split() == ["IDX", "MINOR", "UUID", "NAME", "BUS", "ID", "MEMORY", "NUMA", "MIG", "STATUS"]
    assert len(lines) == 5
    assert "GPU-6b7e2f10-0002-4c2a-8f00-a6000000a001" in lines[2] and lines[2].endswith("allocated")
    assert "00000000:B1:00.0" in lines[3] and "49140 MiB" in lines[3]


def test_topology_matrix_shows_nvlink_and_pcie_levels(data_dir):
    inventory = read_inventory(open_nvml(data_dir / "dgx8-nvlink.toml"))
    assert topology_cell(inventory, 0, 0) == "X"
    assert topology_cell(inventory, 0, 3) == "NV6"
    assert topology_cell(inventory, 0, 4) == "SYS"
    matrix = render_topology(inventory, legend=False).splitlines()
    assert matrix[0].split() == [f"GPU{i}" for i in range(8)] + ["NUMA"]
    assert matrix[1].split() == ["GPU0", "X", "NV6", "NV6", "NV6", "SYS", "SYS", "SYS", "SYS", "0"]
    mixed = read_inventory(open_nvml(data_dir / "mixed.json"))
    assert topology_cell(mixed, 0, 1) == "BRD" and topology_cell(mixed, 2, 3) == "NV12"
    plain = read_inventory(open_nvml(data_dir / "mixed.json"))
    assert "Legend:" in render_topology(plain)


def test_whole_inventory_has_a_header_and_control_devices(tmp_path):
    path = tmp_path / "n.toml"
    path.write_text("gpu_count = 2\n")
    text = render_inventory(read_inventory(open_nvml(path)))
    assert text.startswith(f"simulated node ({path}), driver 550.54.15, 2 GPUs")
    assert "Topology:" in text and "GPU1  -     X" in text
    assert text.rstrip().endswith("nvidia-modeset 195:254")
    empty = tmp_path / "e.toml"
    empty.write_text("gpu_count = 0\n")
    assert "No GPUs." in render_inventory(read_inventory(open_nvml(empty)))
