"""The cgroup v2 device program: a policy compiled to eBPF (pure).

Rules:
- The kernel runs a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program on every device
  access with ``struct bpf_cgroup_dev_ctx {u32 access_type; u32 major;
  u32 minor;}``: low 16 bits of access_type the device type (block 1,
  char 2), high 16 bits the access (mknod 1, read 2, write 4). Returning 1
  allows, 0 refuses with EPERM.
- The program decides exactly as ``Policy.is_granted``: a deny
  rule covering the device with an overlapping bit refuses; otherwise one
  allow rule must cover the device and every requested bit.
- Compact layout (the verifier's time grows with the branches it must
  explore): the rules are grouped by (type, access); each group is one
  type check and one access check, then one compare-and-jump per major
  (and per minor under it; a run of consecutive numbers is one range
  check, so 8 GPUs cost what 1 does) to a shared exit: deny groups first
  (to the deny exit), then allow groups (to the allow exit). An allow list
  with ``a *:* rwm`` skips the allow groups. An empty allow list is
  ``r0 = 0; exit``.
- No instruction is unreachable (the verifier refuses that): the input is
  normalised first, so a group never holds code after an unconditional jump.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Iterable, Sequence, Union

from ._rules import DeviceRule, normalize

if TYPE_CHECKING:
    from ._policy import Policy

# struct bpf_cgroup_dev_ctx offsets and the kernel's encodings.
CTX_ACCESS_TYPE = 0
CTX_MAJOR = 4
CTX_MINOR = 8
DEV_BLOCK = 1
DEV_CHAR = 2
ACC_MKNOD = 1
ACC_READ = 2
ACC_WRITE = 4
DEVICE_TYPES = {"b": DEV_BLOCK, "c": DEV_CHAR}
ACCESS_BITS = {"m": ACC_MKNOD, "r": ACC_READ, "w": ACC_WRITE}
ALL_ACCESS = ACC_MKNOD | ACC_READ | ACC_WRITE

# Opcodes (linux/bpf_common.h, linux/bpf.h).
LDX_MEM_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W
ALU32_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
ALU32_RSH_K = 0x74  # BPF_ALU | BPF_RSH | BPF_K
ALU64_MOV_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
JMP_JA = 0x05  # BPF_JMP | BPF_JA
JMP_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JMP_JNE_K = 0x55  # BPF_JMP | BPF_JNE | BPF_K
JMP_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
JMP_JLT_K = 0xA5  # BPF_JMP | BPF_JLT | BPF_K (unsigned)
JMP_JLE_K = 0xB5  # BPF_JMP | BPF_JLE | BPF_K (unsigned)
JMP_EXIT = 0x95  # BPF_JMP | BPF_EXIT

R0, R1, R2, R3, R4, R5 = range(6)
R_TYPE, R_ACCESS, R_MAJOR, R_MINOR = R2, R3, R4, R5

Target = Union[int, str]
Insn = tuple[int, int, int, Target, int]  # code, dst, src, off (or label), imm


class _Label(str):
    """A position marker in an instruction list."""


def access_mask(access: str) -> int:
    """The kernel's access bits of ``access`` (``"rw"`` -> 6)."""
    mask = 0
    for ch in access:
        mask |= ACCESS_BITS[ch]
    return mask


def _groups(rules: Sequence[DeviceRule]) -> dict[tuple[str, str], list[DeviceRule]]:
    groups: dict[tuple[str, str], list[DeviceRule]] = {}
    for rule in rules:
        groups.setdefault((rule.type, rule.access), []).append(rule)
    return groups


def _runs(register: int, values: Iterable[int], target: str) -> list[Insn | _Label]:
    """Jump to ``target`` when ``register`` holds one of ``values``: one
    compare per isolated value, a range check per run of consecutive ones."""
    code: list[Insn | _Label] = []
    ordered = sorted(set(values))
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        low, high = ordered[start], ordered[end]
        if low == high:
            code.append((JMP_JEQ_K, register, 0, target, low))
        else:
            if low > 0:
                code.append((JMP_JLT_K, register, 0, 1, low))
            code.append((JMP_JLE_K, register, 0, target, high))
        start = end + 1
    return code


def _matches(rules: Sequence[DeviceRule], target: str) -> list[Insn | _Label]:
    """Jumps to ``target`` for the devices of one group (majors, then minors)."""
    if any(rule.major is None and rule.minor is None for rule in rules):
        return [(JMP_JA, 0, 0, target, 0)]
    code: list[Insn | _Label] = []
    whole_majors = [rule.major for rule in rules if rule.major is not None and rule.minor is None]
    any_major_minors = [rule.minor for rule in rules if rule.major is None and rule.minor is not None]
    code += _runs(R_MAJOR, whole_majors, target)
    code += _runs(R_MINOR, any_major_minors, target)
    by_major: dict[int, list[int]] = {}
    for rule in rules:
        if rule.major is not None and rule.minor is not None:
            by_major.setdefault(rule.major, []).append(rule.minor)
    for major, minors in by_major.items():
        checks = _runs(R_MINOR, minors, target)
        code.append((JMP_JNE_K, R_MAJOR, 0, len(checks), major))
        code += checks
    return code


def _section(rules: Sequence[DeviceRule], target: str, prefix: str, deny: bool) -> list[Insn | _Label]:
    code: list[Insn | _Label] = []
    for index, ((kind, access), members) in enumerate(_groups(rules).items()):
        skip = _Label(f"{prefix}{index}")
        if kind != "a":
            code.append((JMP_JNE_K, R_TYPE, 0, skip, DEVICE_TYPES[kind]))
        mask = access_mask(access)
        if mask != ALL_ACCESS:
            if deny:  # no requested bit in the rule: not this group
                code.append((JMP_JSET_K, R_ACCESS, 0, 1, mask))
                code.append((JMP_JA, 0, 0, skip, 0))
            else:  # a requested bit outside the rule: not this group
                code.append((JMP_JSET_K, R_ACCESS, 0, skip, ALL_ACCESS & ~mask))
        code.extend(_matches(members, target))
        code.append(skip)
    return code


def program_instructions(access: "Policy") -> list[Insn]:
    """The program for ``access`` as resolved instructions (see module rules)."""
    allow = normalize(access.allow)
    deny = normalize(access.deny)
    if not allow:
        return [(ALU64_MOV_K, R0, 0, 0, 0), (JMP_EXIT, 0, 0, 0, 0)]
    code: list[Insn | _Label] = [
        (LDX_MEM_W, R_TYPE, R1, CTX_ACCESS_TYPE, 0),
        (ALU32_AND_K, R_TYPE, 0, 0, 0xFFFF),
        (LDX_MEM_W, R_ACCESS, R1, CTX_ACCESS_TYPE, 0),
        (ALU32_RSH_K, R_ACCESS, 0, 0, 16),
        (LDX_MEM_W, R_MAJOR, R1, CTX_MAJOR, 0),
        (LDX_MEM_W, R_MINOR, R1, CTX_MINOR, 0),
        (ALU64_MOV_K, R0, 0, 0, 0),
    ]
    code += _section(deny, "deny", "deny_skip", deny=True)
    catch_all = DeviceRule("a") in allow
    allow_exit = [_Label("allow"), (ALU64_MOV_K, R0, 0, 0, 1), (JMP_EXIT, 0, 0, 0, 0)]
    if catch_all:
        code += allow_exit
        if deny:
            code += [_Label("deny"), (JMP_EXIT, 0, 0, 0, 0)]
    else:
        code += _section(allow, "allow", "allow_skip", deny=False)
        code += [_Label("deny"), (JMP_EXIT, 0, 0, 0, 0)]
        code += allow_exit
    return _resolve(code)


def _resolve(code: Iterable[Insn | _Label]) -> list[Insn]:
    positions: dict[str, int] = {}
    insns: list[Insn] = []
    for item in code:
        if isinstance(item, _Label):
            positions[item] = len(insns)
        else:
            insns.append(item)
    resolved: list[Insn] = []
    for index, (op, dst, src, off, imm) in enumerate(insns):
        if isinstance(off, str):
            off = positions[off] - index - 1
        if not -(1 << 15) <= off < (1 << 15):
            raise ValueError(f"device program too long: jump of {off} instructions")
        resolved.append((op, dst, src, off, imm))
    return resolved


def encode(insns: Sequence[Insn]) -> bytes:
    """``struct bpf_insn`` array: u8 code, u8 dst:4|src:4, s16 off, s32 imm."""
    return b"".join(struct.pack("<BBhi", op, dst | (src << 4), off, imm) for op, dst, src, off, imm in insns)


def build_device_program(access: "Policy") -> bytes:
    """The encoded program enforcing ``access``."""
    return encode(program_instructions(access))
