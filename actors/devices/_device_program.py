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
- ``read_policy(code)`` reads such a program back into its policy (the
  layout above, reversed), None for instructions of any other shape. It
  never guesses: a policy it gives compiles to ``code`` again, and the
  caller proves that by the tag the kernel computed (cgroups v2 keeps no
  other record of a cgroup's policy).
- A kernel that hardens its JIT (``net.core.bpf_jit_harden`` = 2) holds
  the program with its constants blinded (each ``op K`` rewritten to
  ``ax = rnd ^ K; ax ^= rnd; op ax``, and ``r = 0`` to ``r ^= r``):
  ``read_policy`` undoes exactly that rewrite first (``unblind``), so the
  record stays readable there; the proof is the same.
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


# The fixed parts of every program (built from them; read back against them).
_EMPTY: list[Insn] = [(ALU64_MOV_K, R0, 0, 0, 0), (JMP_EXIT, 0, 0, 0, 0)]
_HEADER: list[Insn] = [
    (LDX_MEM_W, R_TYPE, R1, CTX_ACCESS_TYPE, 0),
    (ALU32_AND_K, R_TYPE, 0, 0, 0xFFFF),
    (LDX_MEM_W, R_ACCESS, R1, CTX_ACCESS_TYPE, 0),
    (ALU32_RSH_K, R_ACCESS, 0, 0, 16),
    (LDX_MEM_W, R_MAJOR, R1, CTX_MAJOR, 0),
    (LDX_MEM_W, R_MINOR, R1, CTX_MINOR, 0),
    (ALU64_MOV_K, R0, 0, 0, 0),
]
_ALLOW_EXIT: list[Insn] = [(ALU64_MOV_K, R0, 0, 0, 1), (JMP_EXIT, 0, 0, 0, 0)]
_DENY_EXIT: Insn = (JMP_EXIT, 0, 0, 0, 0)


def program_instructions(access: "Policy") -> list[Insn]:
    """The program for ``access`` as resolved instructions (see module rules)."""
    allow = normalize(access.allow)
    deny = normalize(access.deny)
    if not allow:
        return list(_EMPTY)
    code: list[Insn | _Label] = list(_HEADER)
    code += _section(deny, "deny", "deny_skip", deny=True)
    catch_all = DeviceRule("a") in allow
    allow_exit = [_Label("allow"), *_ALLOW_EXIT]
    if catch_all:
        code += allow_exit
        if deny:
            code += [_Label("deny"), _DENY_EXIT]
    else:
        code += _section(allow, "allow", "allow_skip", deny=False)
        code += [_Label("deny"), _DENY_EXIT]
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


# -- reading a program back (the kernel as the record) ---------------------------

_TYPE_NAMES = {number: name for name, number in DEVICE_TYPES.items()}


class _Unreadable(Exception):
    """The instructions are not a program this module wrote."""


def decode(code: bytes) -> list[Insn]:
    """``struct bpf_insn`` bytes as ``(code, dst, src, off, imm)`` tuples (``encode`` reversed)."""
    if len(code) % 8:
        raise ValueError(f"device program of {len(code)} bytes: not whole instructions")
    return [(op, regs & 0xF, regs >> 4, off, imm) for op, regs, off, imm in struct.iter_unpack("<BBhi", code)]


def _access_of(mask: int) -> str:
    return "".join(ch for ch in "rwm" if mask & ACCESS_BITS[ch])


def _target(insns: list[Insn], pc: int) -> int:
    """Where the compare at ``pc`` jumps (a range check: its upper bound's jump)."""
    if insns[pc][0] == JMP_JLT_K:
        pc += 1
    return pc + 1 + insns[pc][3]


MAX_READ_RULES = 4096
"""Rules a program read back may hold at most (a container's policy holds
about twenty): instructions that would name more are not read, so a
hostile program cannot make the reader build millions of rules."""


def _read_runs(insns: list[Insn], pc: int, end: int, register: int, target: int) -> tuple[list[int], int]:
    """``_runs`` reversed: the values a run of compares on ``register`` jumps
    to ``target`` for, from ``pc`` up to ``end`` (or the first other instruction)."""
    values: list[int] = []
    while pc < end:
        op, dst, _src, off, imm = insns[pc]
        if dst != register:
            break
        if imm < 0:
            raise _Unreadable(f"instruction {pc}: a negative device number")
        if op == JMP_JEQ_K and pc + 1 + off == target:
            values.append(imm)
            pc += 1
        elif op == JMP_JLT_K and off == 1 and pc + 1 < end:
            op2, dst2, _src2, off2, high = insns[pc + 1]
            if op2 != JMP_JLE_K or dst2 != register or pc + 2 + off2 != target or high <= imm:
                raise _Unreadable(f"instruction {pc}: a range check without its upper bound")
            low = imm
            pc += 2
        elif op == JMP_JLE_K and pc + 1 + off == target:
            low, high = 0, imm
            pc += 1
        else:
            break
        if op != JMP_JEQ_K:
            if high - low >= MAX_READ_RULES - len(values):
                raise _Unreadable(f"instruction {pc}: a range of {high - low + 1} device numbers")
            values.extend(range(low, high + 1))
    if len(values) > MAX_READ_RULES:
        raise _Unreadable(f"instruction {pc}: more than {MAX_READ_RULES} device numbers")
    return values, pc


def _read_group(insns: list[Insn], pc: int, end: int, exits: dict[int, str]
                ) -> tuple[str, list[DeviceRule], int]:
    """One group of ``_section`` reversed: ``(section, rules, next pc)``."""
    kind, skip, mask, section = "a", None, ALL_ACCESS, None
    op, dst, _src, off, imm = insns[pc]
    if op == JMP_JNE_K and dst == R_TYPE:
        if imm not in _TYPE_NAMES:
            raise _Unreadable(f"instruction {pc}: unknown device type {imm}")
        kind, skip = _TYPE_NAMES[imm], pc + 1 + off
        pc += 1
    op, dst, _src, off, imm = insns[pc]
    if op == JMP_JSET_K and dst == R_ACCESS:
        follow = insns[pc + 1] if pc + 1 < end else None
        if (off == 1 and follow is not None and follow[0] == JMP_JA and skip is not None
                and pc + 2 + follow[3] == skip):  # deny: no requested bit in the rule -> skip
            mask, section = imm, "deny"
            pc += 2
        else:  # allow: a requested bit outside the rule -> skip
            target = pc + 1 + off
            if skip is not None and target != skip:
                raise _Unreadable(f"instruction {pc}: an access check that skips elsewhere")
            mask, skip, section = ALL_ACCESS & ~imm, target, "allow"
            pc += 1
    if skip is None or not pc < skip <= end:
        raise _Unreadable(f"instruction {pc}: a group without a type or access check")
    access = _access_of(mask)
    if not access:
        raise _Unreadable(f"instruction {pc}: a group granting no access")
    rules: list[DeviceRule] = []
    target = None
    while pc < skip:
        op, dst, _src, off, imm = insns[pc]
        jump = pc + 1 + off
        if op == JMP_JA:
            rules.append(DeviceRule(kind, None, None, access))
            target, pc = jump, pc + 1
        elif op == JMP_JNE_K and dst == R_MAJOR:
            block = pc + 1 + off
            if not pc + 1 < block <= skip:
                raise _Unreadable(f"instruction {pc}: an empty minor block")
            goal = _target(insns, pc + 1)
            minors, after = _read_runs(insns, pc + 1, block, R_MINOR, goal)
            if after != block or not minors:
                raise _Unreadable(f"instruction {pc}: a minor block that is not only compares")
            rules += [DeviceRule(kind, imm, minor, access) for minor in minors]
            target, pc = goal, block
        elif dst in (R_MAJOR, R_MINOR) and op in (JMP_JEQ_K, JMP_JLT_K, JMP_JLE_K):
            goal = _target(insns, pc)
            values, after = _read_runs(insns, pc, skip, dst, goal)
            if after == pc:
                raise _Unreadable(f"instruction {pc}: not a compare of this group")
            if dst == R_MAJOR:
                rules += [DeviceRule(kind, major, None, access) for major in values]
            else:
                rules += [DeviceRule(kind, None, minor, access) for minor in values]
            target, pc = goal, after
        else:
            raise _Unreadable(f"instruction {pc}: opcode {op:#x} is not a device match")
        if len(rules) > MAX_READ_RULES:
            raise _Unreadable(f"instruction {pc}: more than {MAX_READ_RULES} rules")
        if exits.get(target) is None or (section is not None and exits[target] != section):
            raise _Unreadable(f"instruction {pc}: a match that jumps to {target}, not to its exit")
        section = exits[target]
    if section is None or not rules:
        raise _Unreadable(f"instruction {pc}: a group without matches")
    return section, rules, pc


BPF_REG_AX = 11
"""The register the kernel's constant blinding uses (no program may name it)."""
_ALU32, _JMP, _ALU64 = 0x04, 0x05, 0x07
_X = 0x08  # BPF_X: the operand is src_reg, not imm
_MOV_K = {_ALU32: 0xB4, _ALU64: 0xB7}  # BPF_MOV | BPF_K per class
_XOR_K = {_ALU32: 0xA4, _ALU64: 0xA7}
_ALU64_XOR_X = 0xAF
_JMP_CALL = 0x85


def unblind(insns: list[Insn]) -> list[Insn] | None:
    """Instructions as loaded, from the kernel's constant-blinded form
    (``bpf_jit_blind_constants``: ``ax = rnd ^ K; ax ^= rnd; op dst, ax``
    back to ``op dst, K``; ``dst ^= dst`` back to ``dst = 0``; every jump
    re-aimed at the instruction it named); None when the blinded form is
    not what that rewrite makes."""
    out: list[Insn] = []
    origin: list[int] = []  # per instruction kept: the blinded index its jump offset counts from
    start: dict[int, int] = {}  # blinded index of an instruction's first part -> its index in out
    i, n = 0, len(insns)
    while i < n:
        op, dst, src, off, imm = insns[i]
        start[i] = len(out)
        if dst == BPF_REG_AX and op & 0x07 in _MOV_K and op == _MOV_K[op & 0x07] and i + 2 < n:
            op2, dst2, src2, _off2, imm2 = insns[i + 1]
            op3, dst3, src3, off3, _imm3 = insns[i + 2]
            if (op2 != _XOR_K[op & 0x07] or dst2 != BPF_REG_AX or src2 != 0 or src3 != BPF_REG_AX
                    or not op3 & _X or dst3 == BPF_REG_AX or op3 & 0x07 not in (_ALU32, _JMP, _ALU64)):
                return None
            out.append((op3 & ~_X, dst3, 0, off3, imm ^ imm2))
            origin.append(i + 2)
            i += 3
            continue
        if op == _ALU64_XOR_X and dst == src != BPF_REG_AX and off == 0 and imm == 0:
            out.append((ALU64_MOV_K, dst, 0, 0, 0))
        elif dst == BPF_REG_AX or src == BPF_REG_AX:
            return None
        else:
            out.append(insns[i])
        origin.append(i)
        i += 1
    start[n] = len(out)
    for k, (op, dst, src, off, imm) in enumerate(out):
        if op & 0x07 == _JMP and op not in (JMP_EXIT, _JMP_CALL):
            target = start.get(origin[k] + 1 + off)
            if target is None:  # a jump into the middle of a blinded instruction
                return None
            out[k] = (op, dst, src, target - k - 1, imm)
    return out


def read_policy(code: bytes) -> "Policy | None":
    """The policy a device program of this module enforces, read back from its
    instructions (``program_instructions`` reversed); None for instructions
    it did not write. The policy given compiles to exactly ``code``; the
    kernel's tag of the program it loaded proves ``code`` is that program
    (``Policy.program``)."""
    from ._policy import Policy

    try:
        insns = decode(code)
    except ValueError:
        return None
    if any(op == _ALU64_XOR_X or dst == BPF_REG_AX or src == BPF_REG_AX for op, dst, src, _off, _imm in insns):
        unblinded = unblind(insns)
        if unblinded is None:
            return None
        insns, code = unblinded, encode(unblinded)
    if insns == _EMPTY:
        return Policy((), ())  # (the program of any policy that allows nothing)
    n = len(insns)
    if n < len(_HEADER) + 2 or insns[: len(_HEADER)] != _HEADER:
        return None
    catch_all = False
    if n >= len(_HEADER) + 3 and insns[-3:] == [_DENY_EXIT, *_ALLOW_EXIT]:
        end, exits = n - 3, {n - 3: "deny", n - 2: "allow"}
    elif insns[-3:] == [*_ALLOW_EXIT, _DENY_EXIT] and n > len(_HEADER) + 3:
        end, exits, catch_all = n - 3, {n - 1: "deny"}, True
    elif insns[len(_HEADER):] == _ALLOW_EXIT:
        end, exits, catch_all = n - 2, {}, True
    else:
        return None
    allow: list[DeviceRule] = [DeviceRule("a")] if catch_all else []
    deny: list[DeviceRule] = []
    pc, seen_allow = len(_HEADER), False
    try:
        while pc < end:
            section, rules, pc = _read_group(insns, pc, end, exits)
            if section == "deny":
                if seen_allow:
                    raise _Unreadable("a deny group after an allow group")
                deny += rules
            else:
                seen_allow = True
                allow += rules
            if len(allow) + len(deny) > MAX_READ_RULES:
                raise _Unreadable(f"more than {MAX_READ_RULES} rules")
    except (_Unreadable, IndexError, ValueError):
        return None
    try:
        policy = Policy.create(allow, deny)
    except ValueError:
        return None
    return policy if policy.program[0] == code else None  # read, never guessed
