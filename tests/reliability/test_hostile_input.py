"""Hostile input (issue 9): each is rejected with ONE clear error and nothing
written — cgroup roots that are empty, absolute or climb out; resources that
are not a whole number of GPUs; host files with wrong types, duplicate
minors or a million GPUs; named-message bodies that do not decode; a
v2 device program of our name that is not ours (never read as ours); scripts that are
huge, deeply nested or wrongly typed.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import msgspec
import pytest

from actors.devices import PROGRAM_NAME, CgroupsV1Backend, CgroupsV2Backend, DeviceControl, InvalidCgroupError, bpf
from actors.nvml import HostFileError
from isolators import ContainerConfig, ContainerID, ContainerState, Flags, FlagsError, NvidiaComponents
from isolators import NvidiaGpuIsolatorProcess, Resources, ResourcesError, ScriptError, load_script
from runtime import Clock, Process, Runtime, dispatch, send, snapshot, spawn
from tests.support.errors import isolator_failure, raises_isolator_error
from tests.support.kernel import attach_program, attached_programs, detach_program, hierarchy_of, skip_reason
from tests.support.nodes import Node, judge
from tests.support.kernel import BACKENDS

TOKEN = f"rel-hostile-{uuid.uuid4().hex[:8]}"


def one_line(error: BaseException, limit: int = 400) -> str:
    message = str(error)
    assert message and "\n" not in message and len(message) <= limit, repr(message[:600])
    return message


# -- cgroups_root ---------------------------------------------------------------------

BAD_ROOTS = [
    "",
    "   ",
    "/",
    f"/{TOKEN}",
    f"/sys/fs/cgroup/devices/{TOKEN}",
    "..",
    ".",
    f"../{TOKEN}",
    f"../../{TOKEN}",
    f"{TOKEN}/../../{TOKEN}-x",
    f"{TOKEN}/..",
    f"./{TOKEN}",
    f"{TOKEN}//x",
    f"{TOKEN}/./x",
    f"{TOKEN}/",
    f"{TOKEN}\x00x",
    f"{TOKEN}\nx",
]


def listing(hierarchy: str) -> set[str]:
    """The hierarchy and its parent, two levels deep (other tests' roots excluded)."""
    seen = set()
    for top in (os.path.dirname(hierarchy), hierarchy):
        for name in os.listdir(top):
            if name.startswith("gpu-isolator-test-"):
                continue  # concurrent test runs come and go; our token is checked apart
            seen.add(os.path.join(top, name))
    return seen


def token_paths(hierarchy: str) -> list[str]:
    found = []
    for top in (os.path.dirname(os.path.dirname(hierarchy)), os.path.dirname(hierarchy), hierarchy, "/"):
        found += [os.path.join(top, n) for n in os.listdir(top) if TOKEN in n]
    return found


@pytest.mark.parametrize("root", BAD_ROOTS, ids=lambda r: repr(r.replace(TOKEN, "T"))[1:-1] or "empty")
def test_a_bad_cgroups_root_is_refused_by_the_flags(root: str, tmp_path: Any) -> None:
    with pytest.raises(FlagsError) as caught:
        Flags(cgroups_root=root)
    message = one_line(caught.value)
    assert "cgroups_root" in message
    with pytest.raises(FlagsError):
        Flags.from_args([f"--cgroups_root={root}"])
    with pytest.raises(FlagsError):
        Flags().replace(cgroups_root=root)
    flags_file = tmp_path / "flags.json"
    flags_file.write_text(json.dumps({"cgroups_root": root}))
    with pytest.raises(FlagsError):
        Flags.from_file(str(flags_file))


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_bad_cgroups_root_writes_nothing_anywhere(backend: str, tmp_path: Any) -> None:
    """Bypassing the flags (a Flags value mutated after validation, or the device
    control built directly): refused before anything is created."""
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    hierarchy = hierarchy_of(backend)
    before = listing(hierarchy) if hierarchy else set()
    node = Node(str(tmp_path), backend)
    async with Runtime():
        components = await NvidiaComponents.create(node.flags())
        try:
            for root in BAD_ROOTS + [f"{TOKEN}\\..\\x", "x" * 300]:
                with pytest.raises(InvalidCgroupError) as caught:
                    await DeviceControl.create(backend, hierarchy, root, node.work_dir)
                assert "cgroups_root" in one_line(caught.value)
                flags = node.flags()
                flags.cgroups_root = root  # msgspec Structs are mutable: no validation here
                with raises_isolator_error() as refused:
                    await NvidiaGpuIsolatorProcess.create(flags, components)
                assert str(refused.value) == str(caught.value)  # device control's text, with its cause
                assert isinstance(refused.value.__cause__, InvalidCgroupError)
                if backend == "cgroups_v1":
                    with pytest.raises(InvalidCgroupError):
                        CgroupsV1Backend(hierarchy, root)
                if backend == "cgroups_v2":
                    with pytest.raises(InvalidCgroupError):
                        CgroupsV2Backend(hierarchy, root)
        finally:
            await components.close()
        assert snapshot() == {}, "an actor outlived a refused start"
    if hierarchy:
        assert listing(hierarchy) == before
        assert token_paths(hierarchy) == []
    assert not os.path.exists(node.work_dir)


@pytest.mark.parametrize("value", ["../x", "..", ".", "a/b", "a\\b", "a.b", "a b", "a\x00", "", "x" * 243])
def test_a_container_id_that_would_become_a_path_is_refused(value: str) -> None:
    with pytest.raises(ValueError) as caught:
        ContainerID(value)
    one_line(caught.value)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"value": value}, ContainerID)
    with pytest.raises(ValueError):
        ContainerID("child", ContainerID(value))


# -- resources -------------------------------------------------------------------------

BAD_RESOURCES = {
    "gpus:nan": "not a finite number",
    "gpus:inf": "not a finite number",
    "gpus:-inf": "not a finite number",
    "gpus:-1": "negative",
    "gpus:abc": "not a number",
    "gpus": "missing or extra ':'",
    "gpus:": "empty value",
    "gpus:1:2": "missing or extra ':'",
    "gpus:1e308": "too large",
    "gpus:1e400": "not a finite number",
    "gpus:0x10": "not a number",
}


@pytest.mark.parametrize("text", list(BAD_RESOURCES))
def test_a_gpus_value_that_is_not_a_number_is_one_clear_error(text: str) -> None:
    with pytest.raises(ResourcesError) as caught:
        Resources.parse(text)
    message = one_line(caught.value)
    assert BAD_RESOURCES[text] in message and "gpus" in message


@pytest.mark.asyncio
@pytest.mark.parametrize("text", ["gpus:nan", "gpus:-1", "gpus:abc", "gpus", "gpus:[1-2]", "gpus:{a,b}"])
async def test_bad_agent_resources_stop_the_start(text: str, tmp_path: Any) -> None:
    node = Node(str(tmp_path), "memory")
    async with Runtime():
        with pytest.raises(ValueError) as caught:  # ResourcesError (a ValueError)
            await NvidiaComponents.create(node.flags(resources=text, nvidia_gpu_devices=[0]))
        one_line(caught.value)
        assert snapshot() == {}


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_hostile_gpu_requests_fail_at_prepare_and_update_changing_nothing(
    backend: str, node_factory: Any
) -> None:
    node = node_factory(backend)
    async with Runtime():
        _c, isolator = await node.start()
        await isolator.recover([], set())
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=Resources.parse("gpus:1")))
        before = await judge(node, {"c1": 1})
        cases = {
            "gpus:1e9": "Requested 1000000000 gpus but only 3 available",
            "gpus:1e15": "Requested 1000000000000000 gpus but only 3 available",
            "gpus:5": "Requested 5 gpus but only 3 available",
            "gpus:0.5": "The 'gpus' resource must be an unsigned integer",
            "gpus:2.25": "The 'gpus' resource must be an unsigned integer",
            "gpus:[1-2]": "The 'gpus' resource must be an unsigned integer",
            "gpus:{a,b}": "The 'gpus' resource must be an unsigned integer",
        }
        for text, expected in cases.items():
            await isolator_failure(isolator.prepare(ContainerID("c2"), ContainerConfig(resources=Resources.parse(text))),
                                   expected)
            assert await judge(node, {"c1": 1}) == before
            assert not node.cgroup_exists("c2")
            update_expected = expected.replace("Requested 1000000000 ", "Requested 999999999 ").replace(
                "Requested 1000000000000000 ", "Requested 999999999999999 ").replace("Requested 5 ", "Requested 4 ")
            await isolator_failure(isolator.update(ContainerID("c1"), Resources.parse(text)), update_expected)
            assert await judge(node, {"c1": 1}) == before
        await node.clean_all()
        await node.stop()


# -- host files ---------------------------------------------------------------------------

BAD_HOSTS = {
    "a million GPUs": ({"gpu_count": 1_000_000}, "gpu_count: expected `int` <= 1024, got 1000000"),
    "a million GPU tables": ({"gpus": [{}] * 100_000}, "gpus: expected `array` of length <= 1024"),
    "a count in words": ({"gpu_count": "four"}, "gpu_count: expected `int`, got 'four'"),
    "a boolean count": ({"gpu_count": True}, "gpu_count: expected `int`, got True"),
    "a negative count": ({"gpu_count": -1}, "gpu_count: expected `int` >= 0"),
    "gpus not a list": ({"gpus": 5}, "gpus: expected `array`, got 5"),
    "a minor in words": ({"gpus": [{"minor": "x"}]}, "gpus[0].minor: expected `int`, got 'x'"),
    "a huge minor": ({"gpus": [{"minor": 10**30}]}, "gpus[0].minor: expected `int` <= 1048575"),
    "duplicate minors": ({"gpus": [{"minor": 1}, {"minor": 1}]}, "gpus[1].minor: minor 1 is already used by gpus[0]"),
    "the nvidiactl minor": ({"gpus": [{"minor": 255}]}, "minor 255 is the control device 'nvidiactl'"),
    "a top-level list": ([1, 2], "expected a table at the top level, got list"),
    "an unknown key": ({"gpu_count": 1, "gpu_cuont": 2}, "unknown key 'gpu_cuont'"),
    "a huge unknown key": ({"gpu_count": 1, "q" * 100_000: 1}, "unknown key 'qqqq"),
    "an unknown control device": (
        {"gpu_count": 1, "control_devices": {"../../etc/passwd": "1:1"}}, "unknown control device"),
    "a garbled device number": (
        {"gpu_count": 1, "control_devices": {"nvidiactl": "x" * 100_000}}, "expected 'major:minor'"),
    "a garbled bus id": ({"gpus": [{"pci_bus_id": "zz" * 50_000}]}, "expected a PCI bus id"),
    "memory in words": ({"gpus": [{"memory_total_mib": "lots"}]}, "gpus[0].memory_total_mib: expected `int`"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BAD_HOSTS))
async def test_a_hostile_host_file_stops_the_start_with_one_error(case: str, tmp_path: Any) -> None:
    document, expected = BAD_HOSTS[case]
    node = Node(str(tmp_path), "memory")
    with open(node.host_file, "w") as handle:
        json.dump(document, handle)
    async with Runtime():
        with pytest.raises(HostFileError) as caught:
            await NvidiaComponents.create(node.flags())
        message = one_line(caught.value)
        assert expected in message and node.host_file in message, message
        assert snapshot() == {}, "an actor outlived a refused start"
    assert sorted(os.listdir(tmp_path)) == ["dev", "host.json", "ld.so.cache", "proc"]  # the node's own: nothing written


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "text, expected",
    [
        (b"\xff\xfe\x00gpu_count", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid"),
        (b"gpu_count = ", "not valid TOML"),
        (b"", "missing: give 'gpu_count = N'"),
    ],
    ids=["binary", "deep", "truncated", "empty"],
)
async def test_a_garbled_host_file_stops_the_start(text: bytes, expected: str, tmp_path: Any) -> None:
    node = Node(str(tmp_path), "memory")
    node.host_file = str(tmp_path / "host.toml")
    (tmp_path / "host.toml").write_bytes(text)
    async with Runtime():
        with pytest.raises(HostFileError) as caught:
            await NvidiaComponents.create(node.flags())
        assert expected in one_line(caught.value)
        assert snapshot() == {}


# -- named messages -------------------------------------------------------------------------


class Allocate(msgspec.Struct, frozen=True):
    container: str
    gpus: int


class Receiver(Process):
    def __init__(self) -> None:
        super().__init__(id="receiver")
        self.got: list[Allocate] = []

    def initialize(self) -> None:
        self.install("allocate", self.on_allocate, Allocate)

    def on_allocate(self, sender: Any, body: Allocate) -> None:
        self.got.append(body)

    def ping(self) -> str:
        return "pong"


@pytest.mark.asyncio
async def test_message_bodies_that_do_not_decode_are_counted_and_the_receiver_keeps_serving() -> None:
    selfref: dict[str, Any] = {}
    selfref["x"] = selfref
    hostile = [
        b"\xff\xfe\x00",
        b'{"container": "c1", "gpus": 2',  # truncated
        b'{"container": 1, "gpus": 2}',  # wrong type
        b'{"container": "c1", "gpus": 1e400}',
        b'{"container": "c1", "gpus": 2, "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,  # deeply nested
        b"x" * 1_000_000,
        '{"container": "c1"}',  # missing field
        selfref,
        object(),
        None,
        12,
        {"container": "c1", "gpus": "2"},
    ]
    async with Runtime():
        receiver = Receiver()
        pid = spawn(receiver)
        await Clock.settle()
        for body in hostile:
            send(pid, "allocate", body)
        send(pid, "no-such-message", b"{}")
        send(pid, "allocate", b'{"container": "c1", "gpus": 2}')
        await Clock.settle()
        assert await dispatch(pid, Receiver.ping) == "pong"
        assert receiver.got == [Allocate("c1", 2)]
        stats = receiver.stats()
        assert stats["messages_rejected"] == len(hostile) + 1, stats
        assert stats["state"] == "running" and stats["failures"] == 0, stats


# -- v2: programs of our name that are not ours -----------------------------------------------

HOSTILE_PROGRAMS = {
    "allow everything": bytes.fromhex("b700000001000000" "9500000000000000"),  # r0 = 1; exit
    "one of ours, one instruction changed": None,  # filled in from the real program below
}


def attached(node: Any, cgroup: str) -> list[int]:
    """Ids of the device programs the kernel runs for ``cgroup``."""
    return attached_programs(os.path.join(node.root, cgroup))


@pytest.mark.asyncio
async def test_a_program_of_our_name_that_is_not_ours_is_never_read_as_ours(node_factory: Any) -> None:
    """cgroups v2 keeps no file: a cgroup's policy is its program read back. A
    program that carries our name but is not one we wrote (hostile, or
    damaged) is never read as a policy: its container's device state is
    unknown, and every free GPU stays out of the pool until it is cleaned up."""
    node = node_factory("cgroups_v2")
    async with Runtime():
        _c, isolator = await node.start()
        await isolator.recover([], set())
        await isolator.prepare(ContainerID("c1"), ContainerConfig(resources=Resources.parse("gpus:2")))
        await isolator.prepare(ContainerID("c2"), ContainerConfig(resources=Resources.parse("gpus:1")))
        held = await judge(node, {"c1": 2, "c2": 1})
        await node.stop()  # the agent goes away; c1 and c2 keep running
        (ours,) = attached(node, "c1")
        fd = bpf.prog_get_fd_by_id(ours)
        try:
            code = bpf.prog_xlated(fd, bpf.prog_info(fd).xlated_len)
        finally:
            os.close(fd)
        programs = dict(HOSTILE_PROGRAMS)
        changed = bytearray(code)
        changed[-12] ^= 0x01  # the immediate of the allow exit's "r0 = 1": now "r0 = 0"
        programs["one of ours, one instruction changed"] = bytes(changed)
        path = os.path.join(node.root, "c1")
        for name, hostile in programs.items():
            detach_program(path, attached(node, "c1")[0])
            attach_program(path, hostile, PROGRAM_NAME)
            _c, isolator = await node.start()
            await isolator.recover([ContainerState(ContainerID("c1")), ContainerState(ContainerID("c2"))], set())
            report = " | ".join(isolator.recovery_report)
            assert "Container c1: cgroup 'c1' exists but its device state is unknown (its device rules cannot" \
                   " be read back); GPUs [0, 1, 3] are kept out of the free pool" in report, (name, report)
            assert await node.components.allocator.available() == set(), name  # all but c2's quarantined
            assert await isolator.containers() == {"c1": [0, 1, 3], "c2": held["c2"]}, name
            assert await isolator.devices.state("c1") is None, name
            await node.stop()
        _c, isolator = await node.start()
        await isolator.recover([ContainerState(ContainerID("c2"))], set())
        await isolator.cleanup(ContainerID("c1"))  # recovered as an orphan of unknown state
        await isolator.cleanup(ContainerID("c2"))
        assert node.cgroups() == []
        assert len(await node.components.allocator.available()) == node.gpus
        await node.stop()


# -- scripts -----------------------------------------------------------------------------------

BAD_SCRIPTS = {
    "huge": ("steps: []\n" + "# padding\n" * 200_000, "limit"),
    "deep flow lists": ("steps: " + "[" * 1000 + "]" * 1000, "nested"),
    "deep JSON": ('{"steps": ' + "[" * 1000 + "]" * 1000 + "}", "nested"),
    "deep mappings": ("node: " + "{a: " * 200 + "1" + "}" * 200, "nested"),
    "steps not a list": ("steps: 5", "$.steps"),
    "an id that is a number": ("steps:\n  - prepare: {id: 3}\n", "$.steps[0].prepare.id"),
    "resources that are a list": ("steps:\n  - prepare: {id: c1, resources: [1, 2]}\n", "resources"),
    "an unknown action": ("steps:\n  - explode: {id: c1}\n", "explode"),
    "two actions in a step": ("steps:\n  - prepare: {id: c1}\n    cleanup: {id: c1}\n", "exactly one action"),
    "a list at the top": ("- 1\n- 2\n", "mapping"),
    "a number at the top": ("42", "mapping"),
    "an unknown top-level key": ("stepz: []\n", "stepz"),
    "a node of the wrong type": ("node: 5\nsteps: []\n", "$.node"),
    "a huge repeat": ("steps:\n  - concurrent: {repeat: 100000000, steps: []}\n", "repeat"),
    "an alias bomb": (
        "a: &a [1,1,1,1,1,1,1,1,1]\n"
        + "".join(f"l{i}: &l{i} [{','.join([f'*{p}'] * 9)}]\n" for i, p in enumerate(["a"] + [f"l{j}" for j in range(7)]))
        + "steps: []\n",
        "expands",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SCRIPTS))
def test_a_hostile_script_is_one_script_error(case: str) -> None:
    text, expected = BAD_SCRIPTS[case]
    with pytest.raises(ScriptError) as caught:
        load_script(text)
    message = one_line(caught.value, limit=600)
    assert expected in message, message


@pytest.mark.parametrize(
    "text", ["steps: [\n  - prepare: {id: c1\n", "steps: []\x00", b"\xff\xfe\x00steps"], ids=["unclosed", "nul", "binary"]
)
def test_a_script_with_a_syntax_error_is_one_line(text: str) -> None:
    with pytest.raises(ScriptError) as caught:
        load_script(text)
    one_line(caught.value)
