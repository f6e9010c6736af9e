"""MIG device identity, unit order and profile names (actors.mig)."""

from __future__ import annotations

import msgspec
import pytest

from actors.gpu import Gpu
from actors.mig import MigDevice, as_unit, format_units, gpu_instance_profile, is_unit, parse_profile
from actors.mig import profile_from_attributes, profile_memory_mib, profile_of_resource, resource_of_profile
from actors.mig import unit_sort_key


def test_a_mig_device_is_its_parent_and_instance_ids():
    device = MigDevice(Gpu(195, 0), 3, 0)
    assert device == MigDevice.parse("195:0/gi3/ci0") == MigDevice.parse(" 195.0 / gi3 / ci0 ")
    assert str(device) == "195:0/gi3/ci0"
    assert repr(device) == "MigDevice(Gpu(195, 0), gi=3, ci=0)"
    assert device != Gpu(195, 0) and hash(device) != hash(Gpu(195, 0))
    assert {device, MigDevice(Gpu(195, 0), 3, 0)} == {device}
    assert is_unit(device) and is_unit(Gpu(195, 0)) and not is_unit("195:0")
    for bad in ("195:0", "195:0/gi3", "gpu0/gi3/ci0", "195:0/gi-1/ci0", ""):
        with pytest.raises(ValueError, match="Invalid MIG device"):
            MigDevice.parse(bad)


def test_units_of_both_kinds_sort_together_parent_first():
    units = {
        Gpu(195, 1),
        MigDevice(Gpu(195, 0), 2, 0),
        Gpu(195, 0),
        MigDevice(Gpu(195, 0), 1, 1),
        MigDevice(Gpu(195, 0), 1, 0),
        MigDevice(Gpu(195, 2), 0, 0),
    }
    expected = [
        Gpu(195, 0),
        MigDevice(Gpu(195, 0), 1, 0),
        MigDevice(Gpu(195, 0), 1, 1),
        MigDevice(Gpu(195, 0), 2, 0),
        Gpu(195, 1),
        MigDevice(Gpu(195, 2), 0, 0),
    ]
    assert sorted(units) == expected == sorted(units, key=unit_sort_key)
    assert Gpu(195, 0) < MigDevice(Gpu(195, 0), 0, 0) < Gpu(195, 1)
    assert MigDevice(Gpu(195, 3), 0, 0) >= Gpu(195, 3) and Gpu(195, 4) > MigDevice(Gpu(195, 3), 9, 9)
    with pytest.raises(TypeError):
        MigDevice(Gpu(195, 0), 0, 0) < "x"  # noqa: B015 - the comparison is the test
    assert format_units(units) == "{195:0, 195:0/gi1/ci0, 195:0/gi1/ci1, 195:0/gi2/ci0, 195:1, 195:2/gi0/ci0}"


def test_mig_devices_cross_files_and_actors_as_plain_objects():
    device = MigDevice(Gpu(195, 7), 2, 1)
    assert msgspec.json.encode(device) == b'{"parent":{"major":195,"minor":7},"gi":2,"ci":1}'
    decoded = msgspec.json.decode(msgspec.json.encode([device, Gpu(195, 1)]))
    assert [as_unit(value) for value in decoded] == [device, Gpu(195, 1)]
    assert as_unit("195:7/gi2/ci1") == device and as_unit("195:1") == Gpu(195, 1) and as_unit(device) is device
    for bad in ({"parent": "x", "gi": 1, "ci": 0}, 7, "gpu0"):
        with pytest.raises(ValueError, match="Invalid"):
            as_unit(bad)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"parent": {"major": 195, "minor": 0}, "gi": -1, "ci": 0}, MigDevice)


def test_profile_names_follow_nvidias_form():
    assert parse_profile("1g.18gb").gpu_slices == 1 and parse_profile("1g.18gb").compute_slices == 1
    assert parse_profile("1c.3g.71gb").compute_slices == 1 and parse_profile("1c.3g.71gb").gpu_slices == 3
    assert parse_profile("1g.24gb+me.all").attributes == ("me.all",)
    assert gpu_instance_profile("1c.3g.71gb") == "3g.71gb" and gpu_instance_profile("2g.35gb") == "2g.35gb"
    assert resource_of_profile("1g.18gb") == "mig-1g.18gb" and profile_of_resource("mig-1g.18gb") == "1g.18gb"
    assert profile_of_resource("gpus") is None
    assert profile_memory_mib("1g.18gb") == 18 * 960
    for bad in ("1g18gb", "g.18gb", "1g.18", "0g.5gb", "1g.18gb+", "1g.18gb+Me", "1g.18GB", " 1g.18gb"):
        with pytest.raises(ValueError, match="expected '<G>g.<GB>gb'"):
            parse_profile(bad)
    with pytest.raises(ValueError, match="cannot be larger than its GPU instance"):
        parse_profile("4c.3g.40gb")


@pytest.mark.parametrize(
    "slices, compute, memory_mb, total_mib, name",
    [
        (1, 1, 16896, 143771, "1g.18gb"),   # H200
        (2, 2, 33792, 143771, "2g.35gb"),
        (3, 3, 71424, 143771, "3g.71gb"),
        (7, 7, 143104, 143771, "7g.141gb"),
        (1, 1, 9984, 81559, "1g.10gb"),     # H100 80GB
        (3, 3, 40192, 81559, "3g.40gb"),
        (1, 1, 4864, 40536, "1g.5gb"),      # A100 40GB
        (3, 3, 20096, 40536, "3g.20gb"),
        (3, 1, 20096, 40536, "1c.3g.20gb"),
    ],
)
def test_profiles_are_named_from_attributes_as_nvidia_rounds(slices, compute, memory_mb, total_mib, name):
    assert profile_from_attributes(slices, compute, memory_mb, total_mib * 1024 * 1024) == name
