"""The v2 device program, run by a small reference interpreter (no kernel).

The kernel-level check of the same property is in test_cgroups_v2_equivalence.py.
"""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings, strategies as st

from actors.devices import Policy, DeviceRule, build_device_program, container_policy, program_instructions
from actors.devices import _device_program as dp
from actors.devices._bpf import program_tags
from tests.support.rules import ACCESSES, every_rule, exact, policies

ACCESS = {"m": dp.ACC_MKNOD, "r": dp.ACC_READ, "w": dp.ACC_WRITE}


def run(program: bytes, kind: str, major: int, minor: int, access: str) -> int:
    """Interpret the opcodes the compiler emits, on one device access."""
    bits = 0
    for ch in access:
        bits |= ACCESS[ch]
    ctx = struct.pack("<III", (bits << 16) | dp.DEVICE_TYPES[kind], major, minor)
    insns = [struct.unpack_from("<BBhi", program, i) for i in range(0, len(program), 8)]
    regs = [0] * 11
    pc = 0
    for _step in range(10_000):
        op, regs_byte, off, imm = insns[pc]
        dst, src = regs_byte & 0xF, regs_byte >> 4
        pc += 1
        if op == dp.LDX_MEM_W:
            regs[dst] = struct.unpack_from("<I", ctx, off)[0]
        elif op == dp.ALU32_AND_K:
            regs[dst] = (regs[dst] & imm) & 0xFFFFFFFF
        elif op == dp.ALU32_RSH_K:
            regs[dst] = (regs[dst] & 0xFFFFFFFF) >> imm
        elif op == dp.ALU64_MOV_K:
            regs[dst] = imm
        elif op == dp.JMP_JA:
            pc += off
        elif op == dp.JMP_JEQ_K:
            pc += off if regs[dst] == imm else 0
        elif op == dp.JMP_JNE_K:
            pc += off if regs[dst] != imm else 0
        elif op == dp.JMP_JSET_K:
            pc += off if regs[dst] & imm else 0
        elif op == dp.JMP_JLT_K:
            pc += off if regs[dst] < imm else 0
        elif op == dp.JMP_JLE_K:
            pc += off if regs[dst] <= imm else 0
        elif op == dp.JMP_EXIT:
            return regs[0]
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")
    raise AssertionError("program did not exit")


def test_an_empty_allow_list_is_deny_everything() -> None:
    program = build_device_program(Policy())
    assert len(program) == 16
    assert run(program, "c", 1, 3, "r") == 0


def test_allow_all_with_a_deny() -> None:
    access = Policy.create(["a"], ["c 195:1 w"])
    program = build_device_program(access)
    assert run(program, "b", 8, 0, "rwm") == 1
    assert run(program, "c", 195, 1, "r") == 1
    assert run(program, "c", 195, 1, "rw") == 0


def test_container_policy_verdicts() -> None:
    allow, deny = container_policy(["c 195:255 rwm"], ["c 195:0 rw", "c 195:1 rw"])
    program = build_device_program(Policy(allow, deny))
    assert run(program, "c", 1, 3, "rw") == 1
    assert run(program, "c", 195, 0, "rw") == 1
    assert run(program, "c", 195, 2, "r") == 0
    assert run(program, "c", 195, 0, "m") == 1
    assert run(program, "c", 195, 0, "rwm") == 0  # the GPU rule is rw; no single rule gives rwm
    assert run(program, "b", 8, 0, "m") == 1 and run(program, "b", 8, 0, "r") == 0


def test_program_length_does_not_grow_with_consecutive_gpus() -> None:
    control = ["c 195:255 rwm", "c 195:254 rwm", "c 235:0 rwm", "c 235:1 rwm"]
    lengths = {
        len(program_instructions(Policy(*container_policy(control, [f"c 195:{i} rw" for i in range(n)]))))
        for n in (1, 2, 8, 64)
    }
    assert len(lengths) == 1, lengths
    # One type check per (type, access) group and one compare per major or run.
    assert lengths.pop() < 40


def test_tags_match_the_kernel_hash_of_the_instructions() -> None:
    program = build_device_program(Policy.create(["c 1:3 rwm"]))
    assert len(program_tags(program)) == 2 and all(len(tag) == 8 for tag in program_tags(program))


ALLOW = every_rule([None, 0, 1, 195, 196], [None, 0, 1, 2, 3, 5, 255])
DENY = exact(ALLOW)
QUERY_DEVICES = list(itertools.product(("b", "c"), (0, 1, 195, 196, 7), (0, 1, 2, 3, 4, 5, 255, 9)))


@settings(max_examples=150, derandomize=True, deadline=None)
@given(policies(st.lists(st.sampled_from(ALLOW), max_size=10), st.lists(st.sampled_from(DENY), max_size=4)))
def test_program_verdict_equals_is_granted(access: Policy) -> None:
    program = build_device_program(access)
    for kind, major, minor in QUERY_DEVICES:
        for acc in ACCESSES:
            expected = 1 if access.is_granted(kind, major, minor, acc) else 0
            assert run(program, kind, major, minor, acc) == expected, (str(access.allow), kind, major, minor, acc)


def test_jumps_never_go_backwards_or_out_of_the_program() -> None:
    allow, deny = container_policy(["c 195:255 rwm"], [f"c 195:{i} rw" for i in (0, 2, 4, 5, 6)])
    insns = program_instructions(Policy.create(allow, ["c 1:3 w"]))
    for index, (op, _dst, _src, off, _imm) in enumerate(insns):
        if op & 0x07 == 0x05 and op != dp.JMP_EXIT:
            assert 0 <= off and index + 1 + off < len(insns)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_encode_is_eight_bytes_per_instruction(n: int) -> None:
    access = Policy.create([f"c 195:{i} rw" for i in range(n)])
    assert len(build_device_program(access)) == 8 * len(program_instructions(access))


# -- reading a program back (cgroups v2 keeps no other record) ------------------------------

MANY_MAJORS = st.one_of(st.none(), st.integers(0, 4095))
MANY_MINORS = st.one_of(st.none(), st.integers(0, 1048575), st.integers(0, 12))
RULES = st.builds(DeviceRule, st.sampled_from(["b", "c"]), MANY_MAJORS, MANY_MINORS, st.sampled_from(ACCESSES))


@settings(max_examples=300, derandomize=True, deadline=None)
@given(policies(st.lists(st.one_of(st.sampled_from(ALLOW), RULES), max_size=14),
                st.lists(st.sampled_from(DENY), max_size=4)))
def test_a_program_reads_back_as_the_policy_it_was_compiled_from(access: Policy) -> None:
    program = build_device_program(access)
    back = dp.read_policy(program)
    assert back is not None, str(access)
    assert build_device_program(back) == program  # the proof the kernel's tag checks
    if access.allow:  # (an empty allow list compiles to "deny everything", whatever the deny list)
        assert back == access


def test_container_policies_read_back() -> None:
    control = ["c 195:255 rwm", "c 235:0 rwm", "c 235:1 rwm", "c 195:254 rwm"]
    for gpus in ([], [0], [3], [0, 1, 2, 5], list(range(8))):
        access = Policy.container(control, [f"c 195:{g} rwm" for g in gpus])
        assert dp.read_policy(build_device_program(access)) == access
    assert dp.read_policy(build_device_program(Policy((), ()))) == Policy((), ())


@pytest.mark.parametrize("code", [
    b"",
    b"\x00" * 7,
    bytes.fromhex("b700000001000000" "9500000000000000"),  # r0 = 1; exit: not a layout of ours
    b"\xff" * 64,
])
def test_instructions_of_another_shape_are_not_read_as_a_policy(code: bytes) -> None:
    assert dp.read_policy(code) is None


def test_a_changed_instruction_is_never_read_as_another_policy() -> None:
    """Each single change either is refused or reads as a policy that compiles
    to the changed program itself: never a policy the program does not hold."""
    access = Policy.container(["c 195:255 rwm"], ["c 195:0 rwm", "c 195:3 rwm"])
    program = build_device_program(access)
    for index in range(0, len(program)):
        for flip in (0x01, 0x10, 0x80):
            changed = bytearray(program)
            changed[index] ^= flip
            back = dp.read_policy(bytes(changed))
            assert back is None or build_device_program(back) == bytes(changed), (index, flip, back)


def test_a_program_naming_millions_of_devices_is_not_read() -> None:
    """A hostile program could name every minor in one range check: it is
    refused before any rule is built (the reader stays small)."""
    huge = Policy.create([f"c 195:{m} rw" for m in range(0, 10)])
    insns = program_instructions(huge)
    index = next(i for i, insn in enumerate(insns) if insn[0] == dp.JMP_JLE_K)
    op, dst, src, off, _imm = insns[index]
    insns[index] = (op, dst, src, off, dp.MAX_READ_RULES * 100)
    assert dp.read_policy(dp.encode(insns)) is None
    insns[index] = (op, dst, src, off, -1)
    assert dp.read_policy(dp.encode(insns)) is None


# -- a kernel that blinds constants (net.core.bpf_jit_harden = 2) ---------------------------

_BLINDED_ALU = {0x04, 0x14, 0x24, 0x34, 0x44, 0x54, 0x94, 0xA4, 0xB4}  # ADD SUB MUL DIV OR AND MOD XOR MOV, K
_BLINDED_JMP = {0x15, 0x25, 0x35, 0x45, 0x55, 0x65, 0x75, 0xA5, 0xB5, 0xC5, 0xD5}  # JEQ .. JSLE, K


def blind(insns: list, rnd: int) -> list:
    """What the kernel's ``bpf_jit_blind_constants`` leaves (kernel/bpf/core.c),
    for the opcodes a device program uses: ``r = 0`` as ``r ^= r``; an ALU or
    conditional jump on a constant K as ``ax = rnd ^ K; ax ^= rnd; op ax``;
    every jump re-aimed at the first instruction of what it named."""
    ax = dp.BPF_REG_AX
    patches = []
    for op, dst, src, off, imm in insns:
        cls = op & 0x07
        if imm == 0 and op in (0xB4, 0xB7):
            patches.append([(0xAF, dst, dst, 0, 0)])
        elif (cls == 0x04 and op in _BLINDED_ALU) or (cls == 0x07 and (op & ~0x03) in _BLINDED_ALU):
            wide = 0x07 if cls == 0x07 else 0x04
            patches.append([(0xB0 | wide, ax, 0, 0, rnd ^ imm), (0xA0 | wide, ax, 0, 0, rnd), (op | 0x08, dst, ax, off, 0)])
        elif op in _BLINDED_JMP:
            patches.append([(0xB7, ax, 0, 0, rnd ^ imm), (0xA7, ax, 0, 0, rnd), (op | 0x08, dst, ax, off, 0)])
        else:
            patches.append([(op, dst, src, off, imm)])
    starts, position = [], 0
    for patch in patches:
        starts.append(position)
        position += len(patch)
    starts.append(position)
    out = []
    for index, patch in enumerate(patches):
        *head, (op, dst, src, off, imm) = patch
        out += head
        if op & 0x07 == 0x05 and op not in (dp.JMP_EXIT, 0x85):
            off = starts[index + 1 + off] - len(out) - 1
        out.append((op, dst, src, off, imm))
    return out


RANDOMS = st.integers(-(1 << 31), (1 << 31) - 1)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(policies(st.lists(st.one_of(st.sampled_from(ALLOW), RULES), max_size=14),
                st.lists(st.sampled_from(DENY), max_size=4)), RANDOMS)
def test_a_program_blinded_by_the_kernel_reads_back_as_the_same_policy(access: Policy, rnd: int) -> None:
    insns = program_instructions(access)
    blinded = blind(insns, rnd)
    assert any(dp.BPF_REG_AX in (dst, src) for _op, dst, src, _off, _imm in blinded) or len(insns) == 2
    assert dp.unblind(blinded) == insns
    back = dp.read_policy(dp.encode(blinded))
    assert back is not None and back.program[0] == build_device_program(access)  # the tag proves this
    if access.allow:
        assert back == access


def test_a_blinded_program_that_is_not_the_kernels_rewrite_is_not_read() -> None:
    access = Policy.container(["c 195:255 rwm"], ["c 195:0 rwm", "c 195:3 rwm"])
    blinded = blind(program_instructions(access), 0x5A5A5A5A)
    first = next(i for i, insn in enumerate(blinded) if insn[1] == dp.BPF_REG_AX)
    for broken in (
        blinded[:first] + blinded[first + 1:],  # the xor without its mov
        blinded[:first + 1] + blinded[first + 2:],  # the mov without its xor
        [*blinded[:first + 2], (0x07, dp.BPF_REG_AX, 0, 0, 1), *blinded[first + 2:]],  # ax changed between
    ):
        assert dp.read_policy(dp.encode(broken)) is None
    changed = list(blinded)
    op, dst, src, off, imm = changed[first + 1]
    changed[first + 1] = (op, dst, src, off, imm ^ 0x10)  # another constant: another program (or none of ours)
    back = dp.read_policy(dp.encode(changed))
    assert back is None or back != access
