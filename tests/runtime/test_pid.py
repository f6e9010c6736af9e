"""R-RT-1: PIDs -- str/parse, hashing, ordering, msgspec, generated ids."""

from __future__ import annotations

import re

import msgspec
import pytest

from runtime import PID, Process, generate_id


def test_str_of_local_pid_is_its_id() -> None:
    assert str(PID("allocator(1)")) == "allocator(1)"


def test_str_of_remote_pid_is_id_at_host_port() -> None:
    assert str(PID("slave(1)", "10.0.0.5", 5051)) == "slave(1)@10.0.0.5:5051"


@pytest.mark.parametrize("text", ["a", "foo(12)", "x@h:1", "slave(1)@10.0.0.5:5051", "we@ird@host:80"])
def test_parse_reverses_str(text: str) -> None:
    pid = PID.parse(text)
    assert str(pid) == text
    assert PID.parse(str(pid)) == pid


def test_parse_splits_id_host_and_port() -> None:
    assert PID.parse("slave(1)@10.0.0.5:5051") == PID("slave(1)", "10.0.0.5", 5051)
    assert PID.parse("local") == PID("local")


@pytest.mark.parametrize("text", ["a@host", "a@host:port", "@host:1", "a@:1", "a@host:"])
def test_parse_rejects_malformed_addresses_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        PID.parse(text)


def test_parse_rejects_empty_text() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        PID.parse("")


def test_pids_are_hashable_and_equal_by_value() -> None:
    table = {PID("a"): 1, PID("a", "h", 1): 2}
    assert table[PID("a")] == 1
    assert table[PID.parse("a@h:1")] == 2
    assert len({PID("a"), PID("a"), PID("b")}) == 2


def test_pids_are_frozen() -> None:
    pid = PID("a")
    with pytest.raises(AttributeError):
        pid.id = "b"  # type: ignore[misc]


def test_pids_order_by_id_then_address_local_first() -> None:
    pids = [PID("b"), PID("a", "h", 2), PID("a", "h", 1), PID("a"), PID("a", "g", 9)]
    assert sorted(pids) == [PID("a"), PID("a", "g", 9), PID("a", "h", 1), PID("a", "h", 2), PID("b")]
    assert PID("a") < PID("a", "h", 1) <= PID("a", "h", 1) < PID("b")
    assert PID("b") > PID("a", "h", 1) >= PID("a", "h", 1)


def test_pid_does_not_order_against_other_types() -> None:
    with pytest.raises(TypeError):
        PID("a") < "a"  # noqa: B015


@pytest.mark.parametrize("pid", [PID("a(1)"), PID("a(1)", "host", 5050)])
def test_pids_round_trip_through_msgspec(pid: PID) -> None:
    assert msgspec.json.decode(msgspec.json.encode(pid), type=PID) == pid
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(pid), type=PID) == pid


def test_pid_inside_a_struct_round_trips() -> None:
    class Envelope(msgspec.Struct):
        sender: PID
        to: list[PID]

    env = Envelope(PID("a"), [PID("b", "h", 1)])
    assert msgspec.json.decode(msgspec.json.encode(env), type=Envelope) == env


def test_generated_ids_read_name_n_and_never_repeat() -> None:
    ids = [generate_id("worker") for _ in range(3)]
    assert all(re.fullmatch(r"worker\(\d+\)", i) for i in ids)
    assert len(set(ids)) == 3


def test_process_pid_is_generated_from_its_class_name_or_explicit() -> None:
    class Allocator(Process):
        pass

    assert re.fullmatch(r"Allocator\(\d+\)", Allocator().pid.id)
    assert Allocator().pid != Allocator().pid
    assert Process(id="fixed").pid == PID("fixed")
