"""Device programs shaped as other agents write them, for tests.

Rules:
- ``runc_style_program(rules, default_allow)`` encodes rules the way runc's
  device filter does (``libcontainer/cgroups/devices``' emitter, from its
  documented shape): r2 = type, r3 = access bits, r4 = major, r5 = minor
  loaded once; then per rule, in order, a block that compares type, the
  access (``r1 = r3; r1 &= access; if r1 != r3`` skip), major and minor,
  each skipped for a wildcard, and returns the rule's verdict; the default
  verdict at the end. ``rules`` are ``(DeviceRule, allow)`` pairs, the
  first match deciding. Its layout is not this project's
  (``read_policy`` does not read it), as runc's and systemd's are not.
- ``SystemdDevicePrograms`` does to a scope's cgroup what systemd does
  when it applies the scope's device rules on cgroup v2
  (``cgroup_apply_devices`` -> ``bpf_devices_apply_policy``): it compiles
  a program of the rules (runc's shape, which systemd's emitter shares:
  the same four registers, one block per rule, deny by default), named
  ``sd_devices`` as systemd names it, attaches it with
  ``BPF_F_ALLOW_MULTI`` beside whatever is there, then detaches the
  program it attached before (by the fd it kept: a program replaced in
  place meanwhile cannot be detached, and ENOENT is ignored, as systemd
  ignores it). ``apply(directory, rules)``; ``close()`` closes the fds it
  keeps (the programs stay attached).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from actors.devices import DeviceRule, bpf
from actors.devices._device_program import (ACCESS_BITS, ALU32_AND_K, ALU32_RSH_K, DEVICE_TYPES, JMP_EXIT,
                                            JMP_JNE_K, LDX_MEM_W, encode)

ALU32_MOV_K = 0xB4
ALU32_MOV_X = 0xBC
JMP_JNE_X = 0x5D


def runc_style_program(rules: Iterable[tuple[DeviceRule, bool]], default_allow: bool = False) -> bytes:
    """A program of ``rules`` in runc's shape (see module rules)."""
    insns = [
        (LDX_MEM_W, 2, 1, 0, 0), (ALU32_AND_K, 2, 0, 0, 0xFFFF),
        (LDX_MEM_W, 3, 1, 0, 0), (ALU32_RSH_K, 3, 0, 0, 16),
        (LDX_MEM_W, 4, 1, 4, 0), (LDX_MEM_W, 5, 1, 8, 0),
    ]
    for rule, allow in rules:
        block = []
        if rule.type != "a":
            block.append(("type", DEVICE_TYPES[rule.type]))
        mask = sum(ACCESS_BITS[bit] for bit in rule.access)
        if mask != 7:
            block.append(("access", mask))
        if rule.major is not None:
            block.append(("major", rule.major))
        if rule.minor is not None:
            block.append(("minor", rule.minor))
        length = sum(3 if kind == "access" else 1 for kind, _ in block) + 2
        emitted = 0
        for kind, value in block:
            if kind == "access":
                emitted += 3
                insns += [(ALU32_MOV_X, 1, 3, 0, 0), (ALU32_AND_K, 1, 0, 0, value),
                          (JMP_JNE_X, 1, 3, length - emitted, 0)]
            else:
                emitted += 1
                register = {"type": 2, "major": 4, "minor": 5}[kind]
                insns.append((JMP_JNE_K, register, 0, length - emitted, value))
        insns += [(ALU32_MOV_K, 0, 0, 0, int(allow)), (JMP_EXIT, 0, 0, 0, 0)]
    insns += [(ALU32_MOV_K, 0, 0, 0, int(default_allow)), (JMP_EXIT, 0, 0, 0, 0)]
    return encode(insns)


class SystemdDevicePrograms:
    """systemd's device programs on scopes' cgroups (see module rules)."""

    def __init__(self) -> None:
        self.attached: dict[str, int] = {}
        """cgroup directory -> the fd of the program systemd attached last."""

    def apply(self, directory: str, rules: Iterable[DeviceRule]) -> int:
        """Attach a program of ``rules``, then detach the previous one; the new program's id."""
        new_fd = bpf.prog_load(runc_style_program([(rule, True) for rule in rules]), "sd_devices")
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            bpf.prog_attach(dir_fd, new_fd, bpf.BPF_F_ALLOW_MULTI)
            old_fd = self.attached.pop(directory, None)
            if old_fd is not None:
                try:
                    bpf.prog_detach(dir_fd, old_fd)
                except OSError as error:
                    if error.errno != errno.ENOENT:
                        raise
                finally:
                    os.close(old_fd)
        except BaseException:
            os.close(new_fd)
            raise
        finally:
            os.close(dir_fd)
        self.attached[directory] = new_fd
        return bpf.prog_info(new_fd).id

    def close(self) -> None:
        for fd in self.attached.values():
            os.close(fd)
        self.attached.clear()
