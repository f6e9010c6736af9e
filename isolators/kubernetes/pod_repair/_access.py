"""What a container's cgroup lets it open, read from the kernel, and access given back (R-PR-4).

Rules:
- ``missing_access(cgroup, rules)`` is the rules (exact devices) the
  kernel does not let the cgroup's processes use, judged from the kernel's
  own record: on v1 the cgroup's ``devices.list`` (``listed_access``: the
  v1 emulator's reading), on v2 every device program the kernel runs for
  the cgroup (``BPF_F_QUERY_EFFECTIVE``: its own and its ancestors'), each
  run on each rule (``program_grants``): a rule is missing when any
  program refuses it, since the kernel allows an access only when every
  one does. A program that cannot be judged (one that
  does more than a device program needs) is an ``AccessError`` naming it:
  nothing is judged, nothing will be touched. A cgroup that is gone is a
  ``CgroupGone``.
- ``give_access(cgroup, rules)`` gives exactly those rules back and
  nothing else: on v1 one ``devices.allow`` write per rule (the kernel's
  file takes one rule a write), reported as one line; on v2 each attached program that refuses
  one of them is replaced in place (``BPF_F_REPLACE`` under
  ``BPF_F_ALLOW_MULTI``; a program attached alone, without it, by a new
  attach of the same flags) by ``allowing(its instructions, the rules it
  refuses)`` under its own name: the cgroup is never without the old
  rules, gets no fewer of its other devices, and no program is added or
  detached; an ancestor's programs are never touched (they are other
  containers' too). ``installed`` (a set the caller keeps per cgroup)
  holds the ids of the replacements it attached: a named one still
  attached with a program of the same name attached after it is a
  replacement its original's owner has superseded (systemd, at a reload
  while the plugin cannot reach it: it attaches its new program and
  cannot detach the one replaced), so it is detached first: no reload
  leaves one more program behind. An unnamed program (runc's) is never
  judged so. Then it reads the kernel again and raises
  ``AccessError`` if anything is still missing (an ancestor refusing it
  says so). Returns what it did, one line each (for
  the log).
- Every bpf(2) call and every write goes through the devices' kernel seam
  (``KERNEL.run``, ``KERNEL.write_lines``), so an ``OSError`` arrives as a
  ``KernelOperationError`` naming the operation; ENOENT on the cgroup
  itself (opening it, or its ``devices.*`` files) is ``CgroupGone``. Blocking: one
  executor job per container.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence

from actors.devices import KERNEL, DeviceRule, allowing, bpf, kernel_error, listed_access, program_grants
from runtime import Failure

from ._cgroups import ContainerCgroup

__all__ = ["AccessError", "CgroupGone", "missing_access", "give_access"]

REPAIR_PROGRAM_NAME = "gpuiso_repair"
"""The name of a replacement whose original had none."""


class AccessError(Failure):
    """The container's device access could not be judged or given back."""


class CgroupGone(AccessError):
    """The cgroup vanished (the container ended) before or while it was read or written."""


def _gone(cgroup: ContainerCgroup) -> CgroupGone:
    return CgroupGone(f"cgroup {cgroup.directory} is gone (the container ended): nothing was granted")


def _accesses(rule: DeviceRule) -> list[str]:
    return [rule.access] + (list(rule.access) if len(rule.access) > 1 else [])


def _v1_missing(cgroup: ContainerCgroup, rules: Sequence[DeviceRule]) -> list[DeviceRule]:
    path = os.path.join(cgroup.directory, "devices.list")
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        raise _gone(cgroup) from None
    except OSError as error:
        raise AccessError(f"cannot read {path}: {error}") from error
    policy = listed_access(text)
    return [rule for rule in rules
            if not all(policy.is_granted(rule.type, rule.major, rule.minor, access) for access in _accesses(rule))]


class _Program:
    __slots__ = ("fd", "info", "code")

    def __init__(self, fd: int, info: bpf.ProgInfo, code: bytes) -> None:
        self.fd, self.info, self.code = fd, info, code


def _open_cgroup(cgroup: ContainerCgroup) -> int:
    try:
        return os.open(cgroup.directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise _gone(cgroup) from None
    except OSError as error:
        raise AccessError(f"cannot open cgroup {cgroup.directory}: {error}") from error


def _programs(cgroup: ContainerCgroup, cgroup_fd: int, effective: bool = False) -> tuple[int, list[_Program]]:
    flags, ids = KERNEL.run("BPF_PROG_QUERY", cgroup.directory, bpf.prog_query, cgroup_fd, effective)
    programs: list[_Program] = []
    try:
        for prog_id in ids:
            try:
                fd = bpf.prog_get_fd_by_id(prog_id)
            except OSError as error:
                if error.errno == errno.ENOENT:  # detached and freed meanwhile: no longer enforced
                    continue
                raise kernel_error(f"open device program {prog_id} of", cgroup.directory, error) from error
            try:
                info = KERNEL.run("BPF_OBJ_GET_INFO_BY_FD", cgroup.directory, bpf.prog_info, fd)
                code = KERNEL.run("BPF_OBJ_GET_INFO_BY_FD", cgroup.directory, bpf.prog_xlated, fd, info.xlated_len)
            except BaseException:
                os.close(fd)  # not in programs yet: closed here
                raise
            programs.append(_Program(fd, info, code))
    except BaseException:
        for program in programs:
            os.close(program.fd)
        raise
    return flags, programs


def _refused(cgroup: ContainerCgroup, program: _Program, rules: Sequence[DeviceRule]) -> list[DeviceRule]:
    refused = []
    for rule in rules:
        verdict = program_grants(program.code, rule)
        if verdict is None:
            raise AccessError(f"device program {program.info.id} ({program.info.name or 'unnamed'}) on"
                              f" {cgroup.directory} cannot be read as a device program; it was not judged and"
                              " nothing was changed")
        if not verdict:
            refused.append(rule)
    return refused


def missing_access(cgroup: ContainerCgroup, rules: Iterable[DeviceRule]) -> list[DeviceRule]:
    """The rules the kernel does not let the cgroup use (see module rules)."""
    rules = list(rules)
    if cgroup.version == 1:
        return _v1_missing(cgroup, rules)
    fd = _open_cgroup(cgroup)
    try:
        _flags, programs = _programs(cgroup, fd, effective=True)
        try:
            refused = {rule for program in programs for rule in _refused(cgroup, program, rules)}
        finally:
            for program in programs:
                os.close(program.fd)
    finally:
        os.close(fd)
    return [rule for rule in rules if rule in refused]


def give_access(cgroup: ContainerCgroup, rules: Iterable[DeviceRule], installed: set[int] | None = None) -> list[str]:
    """Give the rules back, nothing else (see module rules); what was done, one line each."""
    rules = list(rules)
    installed = set() if installed is None else installed
    done: list[str] = []
    if cgroup.version == 1:
        path = os.path.join(cgroup.directory, "devices.allow")
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            raise _gone(cgroup) from None
        except OSError as error:
            raise AccessError(f"cannot open {path} to give the devices back: {error}; the plugin needs to write"
                              " the pods' cgroups (run it as root with /sys/fs/cgroup mounted read-write)") from error
        try:
            KERNEL.write_lines(fd, path, [str(rule).encode() for rule in rules])
        finally:
            os.close(fd)
        done.append("devices.allow " + ", ".join(str(rule) for rule in rules))
    else:
        cgroup_fd = _open_cgroup(cgroup)
        try:
            flags, programs = _programs(cgroup, cgroup_fd)
            try:
                detached: set[int] = set()
                for index, program in enumerate(programs):
                    successor = next((p for p in programs[index + 1:] if p.info.id not in installed
                                      and p.info.name == program.info.name), None)
                    if program.info.id in installed and program.info.name and successor is not None:
                        KERNEL.run("BPF_PROG_DETACH", cgroup.directory, bpf.prog_detach, cgroup_fd, program.fd)
                        installed.discard(program.info.id)
                        detached.add(program.info.id)
                        done.append(f"program {program.info.id} ({program.info.name}) detached: a replacement of"
                                    f" ours that its owner superseded with {successor.info.id}")
                for program in programs:
                    if program.info.id in detached:
                        continue
                    refused = _refused(cgroup, program, rules)
                    if not refused:
                        continue
                    code = allowing(program.code, refused)
                    name = program.info.name or REPAIR_PROGRAM_NAME
                    new_fd = KERNEL.run("BPF_PROG_LOAD", cgroup.directory, bpf.prog_load, code, name)
                    try:
                        if flags & bpf.BPF_F_ALLOW_MULTI:
                            KERNEL.run("BPF_PROG_ATTACH", cgroup.directory, bpf.prog_attach, cgroup_fd, new_fd,
                                       bpf.BPF_F_ALLOW_MULTI | bpf.BPF_F_REPLACE, program.fd)
                        else:
                            KERNEL.run("BPF_PROG_ATTACH", cgroup.directory, bpf.prog_attach, cgroup_fd, new_fd, flags)
                        new_id = KERNEL.run("BPF_OBJ_GET_INFO_BY_FD", cgroup.directory, bpf.prog_info, new_fd).id
                    finally:
                        os.close(new_fd)
                    installed.add(new_id)
                    done.append(f"program {program.info.id} ({name}) replaced by {new_id}: the same rules plus "
                                + ", ".join(str(rule) for rule in refused))
            finally:
                for program in programs:
                    os.close(program.fd)
        finally:
            os.close(cgroup_fd)
    still = missing_access(cgroup, rules)
    if still:
        where = " (a program of an ancestor cgroup refuses it; those are left alone)" if cgroup.version == 2 else ""
        raise AccessError(f"after the repair the kernel still refuses {', '.join(map(str, still))} on"
                          f" {cgroup.directory}{where}")
    return done
