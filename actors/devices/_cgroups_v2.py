"""cgroups v2 device backend: one eBPF device program per cgroup (SPEC R-DV-2).

Rules:
- The kernel is the record. A cgroup's policy is the program of ours
  attached to it, read back when it is needed (``state``): its translated
  instructions (``BPF_OBJ_GET_INFO_BY_FD``) are read as a policy
  (``_device_program.read_policy``), and that policy is proven to be the
  program's by its tag (the kernel's hash of the instructions it was
  given, ``Policy.program``). So no file is written on the way, and there
  is no moment when a file and the kernel disagree: after a crash, what
  the kernel enforces is what a new backend reads.
- What ``state`` says of a cgroup: None when it does not exist; with no
  program of ours attached, ``a *:* rwm`` (nothing of ours restricts it:
  a crash between mkdir and attach, a program someone detached); with
  one, its policy (with several, the first: it grants at least what they
  grant together); None (unknown) when a program of our name cannot be
  read back as one of ours.
- Each cgroup carries exactly one program of its own, recognised by its
  name (``gpuiso_dev``) through ``BPF_PROG_QUERY``. It is attached with
  ``BPF_F_ALLOW_MULTI``; a new policy replaces the old program in place
  (``BPF_F_REPLACE``), so there is never a moment with none or two. After
  attaching, the backend checks that exactly one own program is attached
  (not on a cgroup the same call made with mkdir: it had no program, so
  the attach that succeeded left one).
  Programs of others on the same cgroup are left alone (the kernel runs them
  all; every one must allow).
- A new cgroup (mkdir) gets its program attached at once; replacing the
  program this backend attached last goes straight to the replace (its
  loaded program is the one to swap out), and only when that fails, or
  the check after it finds more than it expects, does it look the
  cgroup's programs up one by one.
- A failed operation restores the cgroup's previous program (or removes the
  cgroup it created), then raises. Operations are independent: each one
  of a batch is applied on its own (a device worker reports them as it
  goes).
- One path for every operation: each syscall goes through the kernel seam
  (``_kernel``), where faults are injected, never by another path.
- ``remove`` is ``rmdir`` alone: the kernel frees a removed cgroup's
  programs with it, while detaching first would leave a cgroup that still
  has processes (rmdir EBUSY) with no device rules.
- A loaded program is kept (up to ``PROGRAM_CACHE_SIZE``, least recently
  used out) and attached again to every cgroup whose policy compiles to the
  same instructions: one load per distinct policy, not per cgroup. The
  instructions themselves are compiled once per policy (``Policy.program``).
- ``reconcile`` makes the kernel match the given policy: it re-attaches a
  missing program, replaces one whose instructions differ (by tag), detaches
  leaked extra own programs and recreates a missing cgroup. Programs of
  others found attached beside its own then fail it with
  ``ForeignProgramsError`` (its own part done and kept): the kernel runs
  them too, so the cgroup may lack devices its policy grants; they are
  reported, never detached on a guess.
- ``confine`` puts one program of ours (allow all but the GPU rules) on a
  cgroup outside the root, found and replaced by name as above, beside
  whatever others attached there.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections import OrderedDict
from typing import Any, Iterable, NamedTuple

from . import _bpf
from ._backend import BackendBase, list_cgroup_dirs, validate_cgroup, validate_cgroups_root, validate_confined
from ._device_program import read_policy
from ._errors import DeviceControlError, ForeignProgramsError, KernelOperationError
from ._policy import Policy, apply_diff, as_policy
from ._rules import DeviceRule, check_diff

logger = logging.getLogger(__name__)

PROGRAM_NAME = "gpuiso_dev"
"""The name every device program of this library carries (at most 15 bytes)."""

PROGRAM_CACHE_SIZE = 64
"""Loaded programs kept open by instruction bytes: containers repeat a few
policies, and attaching a loaded program skips the verifier (most of a
configure's kernel time)."""

ALLOW_ALL = Policy.create(["a"])
"""What a cgroup with no program of ours lets its processes use."""


class _Attached(NamedTuple):
    id: int
    fd: int
    tag: bytes


class _Recheck(Exception):
    """The quick replace did not leave what it expected: look the programs up."""


class CgroupsV2Backend(BackendBase):
    """Device rules as eBPF programs on a cgroup2 hierarchy (see module rules)."""

    name = "cgroups_v2"

    def __init__(self, hierarchy: str, cgroups_root: str = "gpu-isolator", program_name: str = PROGRAM_NAME) -> None:
        if not os.path.isfile(os.path.join(hierarchy, "cgroup.controllers")):
            raise DeviceControlError(
                f"'{hierarchy}' is not a cgroup2 hierarchy (no cgroup.controllers);"
                " mount cgroup2 there or choose another device backend"
            )
        if not program_name or len(program_name.encode()) >= _bpf.BPF_OBJ_NAME_LEN:
            raise DeviceControlError(f"Invalid program name {program_name!r}: 1 to 15 bytes")
        super().__init__(os.path.join(hierarchy, validate_cgroups_root(cgroups_root)))
        self.hierarchy = hierarchy
        self.program_name = program_name
        self._prefix = self.root.rstrip("/") + "/"
        self._attached: dict[str, Policy] = {}
        """Per cgroup: the policy this backend attached last (the kernel stays the record)."""
        self._programs: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        weakref.finalize(self, _close_programs, self._programs)

    def path(self, cgroup: str) -> str:
        return self._prefix + validate_cgroup(cgroup)  # os.path.join's result, on the hot path

    # -- the port ------------------------------------------------------------

    def configure(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule], deny: Iterable[DeviceRule] = ()
    ) -> Policy:
        access = as_policy(allow, deny)
        self._enforce("configure", cgroup, access)
        return access

    def reconfigure(self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]) -> Policy:
        add, remove = check_diff(add, remove)
        path = self.path(cgroup)
        if not os.path.isdir(path):
            raise DeviceControlError(f"Cannot reconfigure cgroup '{cgroup}': {path} does not exist")
        current = self._attached.get(cgroup)
        if current is None:
            current = self._read_state(path)
            if current is None or current is ALLOW_ALL:
                raise DeviceControlError(
                    f"Cannot reconfigure cgroup '{cgroup}': no device program of ours can be read back"
                    " from it (configure it first)"
                )
        access = apply_diff(current, add, remove)
        self._enforce("reconfigure", cgroup, access, current)
        return access

    def reconcile(self, cgroup: str, desired: Policy) -> list[str]:
        if not isinstance(desired, Policy):
            raise DeviceControlError(f"reconcile needs a Policy, got {desired!r}")
        return self._enforce("reconcile", cgroup, desired)

    def remove(self, cgroup: str) -> bool:
        if not self._rmdir_unless_busy(self.path(cgroup), "it and its device program", logger):
            return False
        self._attached.pop(cgroup, None)
        return True

    def state(self, cgroup: str) -> Policy | None:
        """What the kernel holds for ``cgroup``, read back (see module rules)."""
        path = self.path(cgroup)
        if not os.path.isdir(path):
            return None
        return self._read_state(path)

    def exists(self, cgroup: str) -> bool:
        return os.path.isdir(self.path(cgroup))

    def list_cgroups(self) -> list[str]:
        return list_cgroup_dirs(self.root)

    def confine(self, path: str, access: Policy) -> list[str]:
        """Leave exactly one program of ours on ``path`` (from the hierarchy's
        root), compiled from ``access`` (allow all but its deny rules): the
        kernel runs it for that cgroup and every cgroup below, beside any
        program of others (every one must allow). Attached when missing,
        replaced when its instructions differ; the repairs, in words."""
        directory = os.path.join(self.hierarchy, validate_confined(path, self.root, os.path.relpath(self.root, self.hierarchy)))
        if not os.path.isdir(directory):
            raise DeviceControlError(f"Cannot confine cgroup '{path}': {directory} does not exist")
        return self._attach(directory, access, fresh=False, foreign_out=[])

    # -- applying one cgroup -----------------------------------------------------

    def _enforce(self, kind: str, cgroup: str, access: Policy, previous: Policy | None = None) -> Any:
        """Make ``access`` the policy of ``cgroup``; on failure put back what was
        there (``previous``: what this backend attached last, else what the
        kernel holds) or remove the cgroup made for it."""
        path = self.path(cgroup)
        if previous is None:
            previous = self._attached.get(cgroup)
        repairs: list[str] = []
        created = False
        if kind == "configure" and previous is None:
            # A new container's cgroup, the common case: mkdir first, no stat.
            created = self._create(path)
        elif not os.path.isdir(path):
            if kind == "reconfigure":
                raise DeviceControlError(f"Cannot reconfigure cgroup '{cgroup}': {path} does not exist")
            self._ensure_root()
            self._mkdir(path)
            created = True
            if kind == "reconcile":
                repairs.append(f"{path}: recreated the missing cgroup")
        if not created and previous is None and kind != "reconcile":
            held = self._read_state(path)  # a cgroup of an earlier agent: what to put back on failure
            previous = held if held is not ALLOW_ALL else None
        foreign: list[int] = []
        try:
            if created:
                self._attach(path, access, fresh=True)
            elif kind == "reconcile":
                repairs += self._attach(path, access, fresh=False, foreign_out=foreign)
            else:
                self._replace(path, access, previous)
        except Exception as error:  # not a simulated crash: nothing runs after one
            self._rollback(path, created, previous, error)
            raise
        self._attached[cgroup] = access
        if kind != "reconcile":
            return access
        if foreign:
            done = f" (done: {'; '.join(repairs)})" if repairs else ""
            raise ForeignProgramsError(
                f"{path}: device programs {sorted(foreign)} that are not device control's are attached beside"
                " its own; the kernel runs them too, so the container may be denied devices its policy"
                f" grants; detach them{done}", tuple(sorted(foreign)))
        return repairs

    def _rollback(self, path: str, created: bool, previous: Policy | None, error: Exception) -> None:
        try:
            if created:
                self.kernel.run("rmdir", path, os.rmdir, path)
            elif previous is not None:
                self._attach(path, previous, fresh=False)
        except Exception as rollback_error:
            logger.error("Rollback of %s after '%s' failed too: %s", path, error, rollback_error)
            error.add_note(f"Rollback failed too, {path} may be left part-way: {rollback_error}")

    def _replace(self, path: str, access: Policy, previous: Policy | None) -> None:
        """An existing cgroup: when this backend attached ``previous`` there last
        and its program is still loaded, swap it for ``access``'s straight away;
        otherwise (or when the check after finds anything else) look every
        program up (``_attach``)."""
        if previous is not None:
            old = self._programs.get(previous.program[0])
            if old is not None:
                try:
                    self._quick_replace(path, access, previous, old[0])
                    return
                except _Recheck:
                    pass
        self._attach(path, access, fresh=False)

    def _quick_replace(self, path: str, access: Policy, previous: Policy, old_fd: int) -> None:
        code, _tags = access.program
        op = self.kernel.run
        fds = [op("open", path, os.open, path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            cgroup_fd = fds[0]
            if access is previous or code == previous.program[0]:
                keep_id = self._programs[code][1]
            else:
                prog_fd, keep_id, cached = self._program(path, code)
                if not cached:
                    fds.append(prog_fd)
                try:
                    op("attach (replace) device program to", path, _bpf.prog_attach, cgroup_fd, prog_fd,
                       _bpf.BPF_F_ALLOW_MULTI | _bpf.BPF_F_REPLACE, old_fd)
                except KernelOperationError:  # not attached there any more (or not ours): look it up
                    raise _Recheck() from None
                if not cached:
                    fds.remove(prog_fd)  # now owned by the cache
                    self._remember(code, prog_fd, keep_id)
            _flags, ids = op("query device programs of", path, _bpf.prog_query, cgroup_fd)
            if ids != [keep_id]:
                for prog_id in ids:  # others' programs are fine; a second of ours is not
                    if prog_id != keep_id:
                        info, _fd = self._open_program(prog_id, fds)
                        if info is not None and info.name == self.program_name:
                            raise _Recheck()
                if keep_id not in ids:
                    raise _Recheck()
        finally:
            for fd in fds:
                os.close(fd)

    def _attach(self, path: str, access: Policy, fresh: bool, foreign_out: list[int] | None = None) -> list[str]:
        """Leave exactly one own program, compiled from ``access``, on ``path``.

        Returns what it had to change beyond the normal replace, in words;
        ``foreign_out`` gets the ids of the programs of others attached."""
        code, tags = access.program
        op = self.kernel.run
        fds: list[int] = []
        repairs: list[str] = []
        cgroup_fd = op("open", path, os.open, path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fds.append(cgroup_fd)
        try:
            own: list[_Attached] = []
            foreign: set[int] = set()
            flags = 0
            if not fresh:
                flags, ids = op("query device programs of", path, _bpf.prog_query, cgroup_fd)
                for prog_id in ids:
                    info, fd = self._open_program(prog_id, fds)
                    if info is None:
                        continue
                    if info.name == self.program_name:
                        own.append(_Attached(prog_id, fd, info.tag))
                    else:
                        foreign.add(prog_id)
            keep = next((program for program in own if program.tag in tags), None)
            if keep is not None:
                keep_id = keep.id
                leaked = [program for program in own if program is not keep]
            else:
                prog_fd, keep_id, cached = self._program(path, code)
                if not cached:
                    fds.append(prog_fd)
                try:
                    if own:
                        op("attach (replace) device program to", path, _bpf.prog_attach, cgroup_fd, prog_fd,
                           _bpf.BPF_F_ALLOW_MULTI | _bpf.BPF_F_REPLACE, own[0].fd)
                        repairs.append(f"{path}: replaced device program {own[0].id}, whose rules differed")
                        leaked = own[1:]
                    else:
                        op("attach device program to", path, _bpf.prog_attach, cgroup_fd, prog_fd,
                           _bpf.BPF_F_ALLOW_MULTI)
                        if not fresh:
                            repairs.append(f"{path}: attached the missing device program")
                        leaked = []
                except KernelOperationError as error:
                    if error.errno == errno.EPERM and foreign and not flags & _bpf.BPF_F_ALLOW_MULTI:
                        error.add_note(
                            f"Programs {sorted(foreign)} are attached to {path} without BPF_F_ALLOW_MULTI"
                            " (attach flags %d); device control needs multi-attach." % flags
                        )
                    raise
            if fresh:
                # A cgroup this call made (its mkdir succeeded) had no program:
                # the attach that succeeded left exactly one, ours.
                if not cached:
                    fds.remove(prog_fd)  # now owned by the cache
                    self._remember(code, prog_fd, keep_id)
                return repairs
            for program in leaked:
                op("detach device program from", path, _bpf.prog_detach, cgroup_fd, program.fd)
                repairs.append(f"{path}: detached leaked extra device program {program.id}")
            _flags, ids = op("query device programs of", path, _bpf.prog_query, cgroup_fd)
            mine = [keep_id] if keep_id in ids else []
            for prog_id in ids:
                if prog_id != keep_id and prog_id not in foreign:
                    info, _fd = self._open_program(prog_id, fds)
                    if info is not None and info.name == self.program_name:
                        mine.append(prog_id)
            if mine != [keep_id]:
                raise DeviceControlError(
                    f"After attaching, {path} has device programs {sorted(mine)} named"
                    f" '{self.program_name}' attached; expected exactly one ({keep_id})"
                )
            if keep is None and not cached:
                fds.remove(prog_fd)  # now owned by the cache
                self._remember(code, prog_fd, keep_id)
            if foreign_out is not None:
                foreign_out.extend(prog_id for prog_id in ids if prog_id in foreign)
            return repairs
        finally:
            for fd in fds:
                os.close(fd)

    # -- reading the kernel back ----------------------------------------------------

    def _read_state(self, path: str) -> Policy | None:
        """The policy of the first program of ours on ``path`` (see module rules)."""
        op = self.kernel.run
        fds = [op("open", path, os.open, path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            _flags, ids = op("query device programs of", path, _bpf.prog_query, fds[0])
            for prog_id in ids:
                info, fd = self._open_program(prog_id, fds)
                if info is None or info.name != self.program_name:
                    continue
                code = op("read the instructions of device program", str(prog_id), _bpf.prog_xlated, fd,
                          info.xlated_len)
                policy = read_policy(code)
                if policy is None or info.tag not in policy.program[1]:
                    logger.warning("Device program %d on %s is named '%s' but is not one this library wrote;"
                                   " the cgroup's device state is unknown", prog_id, path, self.program_name)
                    return None
                return policy
            return ALLOW_ALL
        finally:
            for fd in fds:
                os.close(fd)

    # -- loaded programs ------------------------------------------------------------

    def _program(self, path: str, code: bytes) -> tuple[int, int, bool]:
        """``(fd, id, cached)`` of a loaded program of ``code``: from the cache, or loaded now."""
        hit = self._programs.get(code)
        if hit is not None:
            self._programs.move_to_end(code)
            return hit[0], hit[1], True
        fd = self.kernel.run("load device program for", path, _bpf.prog_load, code, self.program_name)
        try:
            prog_id = self.kernel.run("read program info for", path, _bpf.prog_info, fd).id
        except BaseException:
            os.close(fd)
            raise
        return fd, prog_id, False

    def _remember(self, code: bytes, fd: int, prog_id: int) -> None:
        self._programs[code] = (fd, prog_id)
        while len(self._programs) > PROGRAM_CACHE_SIZE:
            _code, (old_fd, _id) = self._programs.popitem(last=False)
            os.close(old_fd)

    def close(self) -> None:
        """Close the cached program fds (attached programs stay attached)."""
        _close_programs(self._programs)

    def _open_program(self, prog_id: int, fds: list[int]) -> tuple[_bpf.ProgInfo | None, int]:
        """Open an attached program by id and read its info (None if it just went away)."""
        try:
            fd = self.kernel.run("open device program", str(prog_id), _bpf.prog_get_fd_by_id, prog_id)
        except KernelOperationError as error:
            if error.errno == errno.ENOENT:
                return None, -1
            raise
        fds.append(fd)
        return self.kernel.run("read info of device program", str(prog_id), _bpf.prog_info, fd), fd


def _close_programs(programs: "OrderedDict[bytes, tuple[int, int]]") -> None:
    while programs:
        _code, (fd, _id) = programs.popitem()
        os.close(fd)
