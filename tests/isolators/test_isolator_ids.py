"""R-TY-1: hostile container ids are refused with InvalidContainerID before
any path is built — on construction, on decode, and at every isolator entry
(an id forged past validation); nothing appears on disk."""

from __future__ import annotations

import os

import msgspec
import pytest

import runtime
from isolators import ContainerConfig, ContainerID, ContainerState, ImageManifest, InvalidContainerID
from isolators import IsolatorError, Resources
from tests.support.errors import isolator_failure

HOSTILE = ["..", ".", "a/b", "x" * 300, "x" * 243, "a\nb", "a\x00b", "\x7f", "", "a b", "a\\b", "a.b",
           "/etc", "../../escape", "tab\there", "\u00e9" * 200, "\ud800"]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_refused_on_construction(value) -> None:
    with pytest.raises(InvalidContainerID):
        ContainerID(value)
    with pytest.raises(InvalidContainerID):
        ContainerID(value, ContainerID("parent"))
    with pytest.raises(InvalidContainerID):
        ContainerID("child", value)  # a parent given as a bare string is no id either
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"value": value}, ContainerID)
    if value.isascii():
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode({"value": value}), type=ContainerID)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"value": "child", "parent": {"value": value}}, ContainerID)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"container_id": {"value": value}}, ContainerState)


def test_invalid_container_id_is_an_isolator_error_and_a_value_error() -> None:
    with pytest.raises(InvalidContainerID) as error:
        ContainerID("..")
    assert isinstance(error.value, IsolatorError) and isinstance(error.value, ValueError)
    assert isinstance(error.value, runtime.Failure)
    assert "'..'" in str(error.value)


def test_longest_valid_id_and_parse() -> None:
    assert ContainerID("x" * 242).value == "x" * 242
    nested = ContainerID.parse("parent.child")
    assert nested == ContainerID("child", ContainerID("parent")) and nested.path() == "parent/child"
    for text in ("", "a/b", "a..b", ".a", "a."):
        with pytest.raises(InvalidContainerID):
            ContainerID.parse(text)


def forged(value: str, parent: ContainerID | None = None) -> ContainerID:
    """An id whose value was changed after validation (as a buggy caller could)."""
    cid = ContainerID("placeholder", parent)
    msgspec.structs.force_setattr(cid, "value", value)
    return cid


def snapshot(node) -> dict[str, list[str]]:
    seen = {}
    for top in [node.runtime_dir, node.tmp, node.root]:
        if top is None or not os.path.exists(top):
            seen[str(top)] = []
            continue
        found = []
        for directory, subdirs, files in os.walk(top):
            for name in subdirs + files:
                found.append(os.path.relpath(os.path.join(directory, name), top))
        seen[top] = sorted(found)
    return seen


@pytest.mark.asyncio
@pytest.mark.parametrize("value", ["..", "a/b", "x" * 300, "bad\x01id", "", "."])
async def test_forged_ids_are_refused_at_every_entry_and_nothing_appears(node, value) -> None:
    rootfs = os.path.join(node.tmp, "rootfs")
    os.makedirs(rootfs)
    config = ContainerConfig(resources=Resources.parse("gpus:1"), rootfs=rootfs, docker_manifest=ImageManifest())
    with pytest.raises(InvalidContainerID) as plain:
        ContainerID(value)
    refused = str(plain.value)  # what every entry says: the id's own check
    async with runtime.Runtime():
        components, isolator = await node.start()
        before = snapshot(node)
        cgroups_before = await isolator.devices.list_cgroups()
        for cid in (forged(value), forged(value, ContainerID("parent")), ContainerID("child", forged(value))):
            calls = [
                lambda: isolator.prepare(cid, config),
                lambda: isolator.update(cid, Resources.parse("gpus:2")),
                lambda: isolator.usage(cid),
                lambda: isolator.cleanup(cid),
                lambda: isolator.watch(cid),
                lambda: isolator.recover([ContainerState(cid)], set()),
                lambda: isolator.recover([], {cid}),
            ]
            for call in calls:
                await isolator_failure(call(), refused, InvalidContainerID)
        assert snapshot(node) == before
        assert await isolator.devices.list_cgroups() == cgroups_before
        assert await isolator.containers() == {}
        assert await components.allocator.available() == components.allocator.total()


@pytest.mark.asyncio
async def test_non_id_arguments_are_refused(memory_node) -> None:
    async with runtime.Runtime():
        components, isolator = await memory_node.start()
        for bogus in ("c1", None, 7):
            refused = f"Invalid container id {bogus!r}: expected a ContainerID"
            await isolator_failure(isolator.prepare(bogus, ContainerConfig()), refused, InvalidContainerID)
            await isolator_failure(isolator.cleanup(bogus), refused, InvalidContainerID)
        assert await isolator.containers() == {}
