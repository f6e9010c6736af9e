"""Device programs of others (runc, systemd): judged by running them, widened without rewriting them (pure).

Rules:
- ``program_allows(insns, type, major, minor, access)`` runs a
  ``BPF_PROG_TYPE_CGROUP_DEVICE`` program's instructions (as the kernel
  holds them: ``prog_xlated``; a constant-blinded form is undone first with
  ``_device_program.unblind``) on one access, as the kernel would:
  ``struct bpf_cgroup_dev_ctx`` in r1 (``access_type`` = device type in the
  low 16 bits, access bits in the high 16; ``major``; ``minor``), 64-bit
  registers, 32-bit ALU and JMP32 forms truncating as the ISA says, and
  the verdict in r0 at ``exit`` (non-zero allows). It answers True or
  False, or None when the program does anything else (a helper call, a
  map, a store, a load other than a 32-bit word of the context, more than
  ``MAX_STEPS`` steps): a program it cannot read is never judged.
- ``program_grants(insns, rule)`` is True when the program allows the
  rule's device for the rule's whole access and for each of its bits alone
  (the opens a workload makes), None when unreadable.
- ``allowing(insns, rules)`` is a program that allows exactly what
  ``insns`` allows plus the rules' accesses: a prologue that checks each
  rule (type, major, minor, requested bits within the rule's) and returns
  1, then the old instructions unchanged (their jumps are relative, and
  the prologue leaves r1, the context, as the kernel gave it). Never fewer
  of the old program's devices, never a device the rules do not name. The
  rules must be exact (no wildcard): a ``ValueError`` otherwise.
- Nothing here touches the kernel; the caller loads and attaches (with
  ``BPF_F_REPLACE``, so the cgroup is never without the old program's
  rules), and checks the result by running it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._device_program import (ACCESS_BITS, ALU32_AND_K, ALU32_RSH_K, ALU64_MOV_K, CTX_ACCESS_TYPE, CTX_MAJOR, CTX_MINOR,
                              DEVICE_TYPES, JMP_EXIT, JMP_JNE_K, LDX_MEM_W, R0, R1, R2, R3, R4, R5, Insn, access_mask,
                              decode, encode, unblind)
from ._rules import DeviceRule

__all__ = ["MAX_STEPS", "allowing", "program_allows", "program_grants"]

MAX_STEPS = 100_000
"""Instructions run before a program is called unreadable (the kernel's verifier bounds real ones far lower)."""

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_CTX = object()  # r1 before anything overwrote it: the context pointer

# Instruction classes and operations (linux/bpf_common.h, linux/bpf.h).
_LDX, _ALU, _JMP, _JMP32, _ALU64 = 0x01, 0x04, 0x05, 0x06, 0x07
_X = 0x08
_ALU_OPS = {
    0x00: lambda a, b: a + b, 0x10: lambda a, b: a - b, 0x20: lambda a, b: a * b,
    0x40: lambda a, b: a | b, 0x50: lambda a, b: a & b, 0x60: lambda a, b, bits=64: a << (b & (bits - 1)),
    0x70: lambda a, b, bits=64: a >> (b & (bits - 1)), 0xA0: lambda a, b: a ^ b, 0xB0: lambda a, b: b,
}
_JMP_OPS = {
    0x10: lambda a, b: a == b, 0x20: lambda a, b: a > b, 0x30: lambda a, b: a >= b, 0x40: lambda a, b: a & b != 0,
    0x50: lambda a, b: a != b, 0xA0: lambda a, b: a < b, 0xB0: lambda a, b: a <= b,
}
_SIGNED_JMP_OPS = {0x60: lambda a, b: a > b, 0x70: lambda a, b: a >= b, 0xC0: lambda a, b: a < b,
                   0xD0: lambda a, b: a <= b}
_CTX_OFFSETS = (CTX_ACCESS_TYPE, CTX_MAJOR, CTX_MINOR)
_ALU32_MOV_X = 0xBC  # BPF_ALU | BPF_MOV | BPF_X


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >> (bits - 1) & 1 else value


def _known(op: int) -> bool:
    cls = op & 0x07
    if cls == _LDX:
        return op == LDX_MEM_W
    if cls in (_ALU, _ALU64):
        return op & 0xF0 in _ALU_OPS
    if cls in (_JMP, _JMP32):
        return op == JMP_EXIT or (op & 0xF0 == 0x00 and cls == _JMP) or op & 0xF0 in _JMP_OPS \
            or op & 0xF0 in _SIGNED_JMP_OPS
    return False


def _instructions(code: bytes | Sequence[Insn]) -> list[Insn] | None:
    """The instructions as loaded, None when any is outside what ``_run`` reads."""
    insns = decode(code) if isinstance(code, (bytes, bytearray)) else list(code)
    if any(dst == 11 or src == 11 for _op, dst, src, _off, _imm in insns):  # BPF_REG_AX: a blinded form
        unblinded = unblind(insns)
        if unblinded is None:
            return None
        insns = unblinded
    if not all(_known(insn[0]) for insn in insns):
        return None
    return insns


def _run(insns: list[Insn], ctx: tuple[int, int, int]) -> bool | None:
    regs: list[object] = [None] * 11
    regs[R1] = _CTX
    regs[10] = None  # the frame pointer: nothing here may use the stack
    pc, steps, n = 0, 0, len(insns)
    while 0 <= pc < n:
        steps += 1
        if steps > MAX_STEPS:
            return None
        op, dst, src, off, imm = insns[pc]
        cls = op & 0x07
        if cls == _LDX:
            if op != LDX_MEM_W or regs[src] is not _CTX or off not in _CTX_OFFSETS or dst == 10:
                return None
            regs[dst] = ctx[_CTX_OFFSETS.index(off)]
        elif cls in (_ALU, _ALU64):
            function = _ALU_OPS.get(op & 0xF0)
            bits = 64 if cls == _ALU64 else 32
            if function is None or dst == 10 or (op & _X and not isinstance(regs[src], int)):
                return None
            left = regs[dst]
            if op & 0xF0 != 0xB0 and not isinstance(left, int):  # only a move may write an unset register
                return None
            right = regs[src] if op & _X else imm & (_U64 if bits == 64 else _U32)
            mask = _U64 if bits == 64 else _U32
            a, b = (left if isinstance(left, int) else 0) & mask, right & mask  # type: ignore[operator]
            value = function(a, b, bits) if op & 0xF0 in (0x60, 0x70) else function(a, b)
            regs[dst] = value & mask
        elif cls in (_JMP, _JMP32):
            code = op & 0xF0
            if op == JMP_EXIT:
                verdict = regs[R0]
                return verdict != 0 if isinstance(verdict, int) else None
            if code == 0x00 and cls == _JMP:  # ja
                pc += 1 + off
                continue
            bits = 64 if cls == _JMP else 32
            mask = _U64 if bits == 64 else _U32
            left = regs[dst]
            right = regs[src] if op & _X else imm & mask
            if not isinstance(left, int) or not isinstance(right, int):
                return None
            a, b = left & mask, right & mask
            if code in _JMP_OPS:
                taken = _JMP_OPS[code](a, b)
            elif code in _SIGNED_JMP_OPS:
                taken = _SIGNED_JMP_OPS[code](_signed(a, bits), _signed(b, bits))
            else:
                return None  # a call, or an opcode device programs do not use
            pc += 1 + off if taken else 1
            continue
        else:
            return None  # stores, 64-bit immediates (maps), atomics
        pc += 1
    return None  # ran off either end: not a program the verifier passed


def program_allows(code: bytes | Sequence[Insn], type: str, major: int, minor: int, access: str) -> bool | None:
    """Whether the program allows one access (see module rules); None when it cannot be judged."""
    insns = _instructions(code)
    if insns is None:
        return None
    ctx = ((access_mask(access) << 16) | DEVICE_TYPES[type], major, minor)
    return _run(insns, ctx)


def program_grants(code: bytes | Sequence[Insn], rule: DeviceRule) -> bool | None:
    """Whether the program allows ``rule``'s device for its access and each of its bits alone."""
    if rule.major is None or rule.minor is None or rule.type == "a":
        raise ValueError(f"program_grants judges exact device rules, got {rule}")
    insns = _instructions(code)
    if insns is None:
        return None
    accesses = [rule.access] + ([bit for bit in rule.access] if len(rule.access) > 1 else [])
    for access in accesses:
        verdict = _run(insns, ((access_mask(access) << 16) | DEVICE_TYPES[rule.type], rule.major, rule.minor))
        if not verdict:
            return verdict
    return True


def allowing(code: bytes | Sequence[Insn], rules: Iterable[DeviceRule]) -> bytes:
    """The old program's instructions behind a prologue allowing ``rules`` (see module rules)."""
    insns = _instructions(code)
    if insns is None:
        raise ValueError("the program's instructions are not readable; it cannot be widened")
    prologue: list[Insn] = [
        (LDX_MEM_W, R2, R1, CTX_ACCESS_TYPE, 0),
        (_ALU32_MOV_X, R3, R2, 0, 0),
        (ALU32_RSH_K, R3, 0, 0, 16),  # the access bits
        (ALU32_AND_K, R2, 0, 0, 0xFFFF),  # the device type
        (LDX_MEM_W, R4, R1, CTX_MAJOR, 0),
        (LDX_MEM_W, R5, R1, CTX_MINOR, 0),
    ]
    for rule in rules:
        if rule.major is None or rule.minor is None or rule.type == "a":
            raise ValueError(f"a program is widened by exact device rules only, got {rule}")
        outside = sum(ACCESS_BITS.values()) & ~access_mask(rule.access)
        prologue += [
            (JMP_JNE_K, R2, 0, 7, DEVICE_TYPES[rule.type]),
            (JMP_JNE_K, R4, 0, 6, rule.major),
            (JMP_JNE_K, R5, 0, 5, rule.minor),
            (_ALU32_MOV_X, R0, R3, 0, 0),
            (ALU32_AND_K, R0, 0, 0, outside),
            (JMP_JNE_K, R0, 0, 2, 0),
            (ALU64_MOV_K, R0, 0, 0, 1),
            (JMP_EXIT, 0, 0, 0, 0),
        ]
    return encode(prologue + insns)
