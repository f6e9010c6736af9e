"""cgroups v2 device backend: one eBPF device program per cgroup (SPEC R-DV-2).

Rules:
- The policy of every managed cgroup is kept in memory and in the
  checkpoint (``DeviceCheckpoint``); a new backend reads it back, so state
  survives a restart. A checkpoint that cannot be read stops construction.
- Checkpoint first: a batch of operations computes every new policy, writes
  the checkpoint once, and only then builds, loads and attaches programs.
  After a crash the checkpoint may be ahead of the kernel, never behind an
  attach it did not record: recovery must ``reconcile`` each cgroup to its
  checkpointed policy before trusting the kernel.
- Each cgroup carries exactly one program of its own, recognised by its
  name (``gpuiso_dev``) through ``BPF_PROG_QUERY``. It is attached with
  ``BPF_F_ALLOW_MULTI``; a new policy replaces the old program in place
  (``BPF_F_REPLACE``), so there is never a moment with none or two. After
  attaching, the backend checks that exactly one own program is attached.
  Programs of others on the same cgroup are left alone (the kernel runs them
  all; every one must allow).
- A failed operation restores the cgroup's previous program (or removes the
  cgroup it created) and its checkpoint entry, then raises. Later
  operations on the same cgroup in the same batch are refused with an error
  that names the first failure; other cgroups are unaffected.
- ``remove`` is ``rmdir`` alone: the kernel frees a removed cgroup's
  programs with it, while detaching first would leave a cgroup that still
  has processes (rmdir EBUSY) with no device rules. The checkpoint entry is
  dropped in memory at once and on disk with the next checkpoint write (no
  fsync per removal; a leftover entry names a cgroup that no longer exists
  and is pruned when a backend loads the file).
- A loaded program is kept (up to ``PROGRAM_CACHE_SIZE``, least recently
  used out) and attached again to every cgroup whose policy compiles to the
  same instructions: one load per distinct policy, not per cgroup. The
  instructions themselves are compiled once per policy (``Policy.program``).
- ``reconcile`` makes the kernel match the given policy: it re-attaches a
  missing program, replaces one whose instructions differ (by tag), detaches
  leaked extra own programs, recreates a missing cgroup, and records the
  policy in the checkpoint. Programs of others found attached beside its own
  then fail it with ``ForeignProgramsError`` (its own part done and kept):
  the kernel runs them too, so the cgroup may lack devices its policy
  grants; they are reported, never detached on a guess.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections import OrderedDict
from typing import Any, Iterable, NamedTuple, Sequence

from . import _bpf
from ._backend import (
    BackendBase,
    DeviceOperation,
    apply_one,
    list_cgroup_dirs,
    validate_cgroup,
    validate_cgroups_root,
)
from ._checkpoint import DeviceCheckpoint
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

_CHANGES = ("configure", "reconfigure", "reconcile")
_PENDING: Any = object()


class _Attached(NamedTuple):
    id: int
    fd: int
    tag: bytes


def checkpoint_file(work_dir: str) -> str:
    """Where the v2 checkpoint lives under ``work_dir``."""
    return os.path.join(work_dir, "devices", "cgroups_v2.json")


class CgroupsV2Backend(BackendBase):
    """Device rules as eBPF programs on a cgroup2 hierarchy (see module rules)."""

    name = "cgroups_v2"

    def __init__(
        self,
        hierarchy: str,
        cgroups_root: str = "gpu-isolator",
        work_dir: str = "/var/lib/gpu-isolator",
        program_name: str = PROGRAM_NAME,
    ) -> None:
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
        self.checkpoint = DeviceCheckpoint(checkpoint_file(work_dir), self.root)
        self._states: dict[str, Policy] = self.checkpoint.load()
        self._on_disk: dict[str, Policy] = dict(self._states)
        self._programs: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        weakref.finalize(self, _close_programs, self._programs)
        for cgroup in [c for c in self._states if not os.path.isdir(os.path.join(self.root, c))]:
            logger.info("Dropping checkpoint entry of %s: the cgroup no longer exists", self.path(cgroup))
            del self._states[cgroup]

    def path(self, cgroup: str) -> str:
        return self._prefix + validate_cgroup(cgroup)  # os.path.join's result, on the hot path

    # -- the port ------------------------------------------------------------

    def configure(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule], deny: Iterable[DeviceRule] = ()
    ) -> Policy:
        return _unwrap(self.apply_batch([DeviceOperation("configure", (cgroup, allow, deny))])[0])

    def reconfigure(self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]) -> Policy:
        return _unwrap(self.apply_batch([DeviceOperation("reconfigure", (cgroup, add, remove))])[0])

    def reconcile(self, cgroup: str, desired: Policy) -> list[str]:
        return _unwrap(self.apply_batch([DeviceOperation("reconcile", (cgroup, desired))])[0])

    def remove(self, cgroup: str) -> bool:
        return _unwrap(self.apply_batch([DeviceOperation("remove", (cgroup,))])[0])

    def state(self, cgroup: str) -> Policy | None:
        return self._states.get(validate_cgroup(cgroup))

    def exists(self, cgroup: str) -> bool:
        return os.path.isdir(self.path(cgroup))

    def list_cgroups(self) -> list[str]:
        return list_cgroup_dirs(self.root)

    # -- batches ---------------------------------------------------------------

    def apply_batch(self, ops: Sequence[DeviceOperation]) -> list[Any]:
        results: list[Any] = [_PENDING] * len(ops)
        plans: dict[int, Policy] = {}
        scratch: dict[str, Policy] = {}
        for index, op in enumerate(ops):
            if op.kind in _CHANGES:
                try:
                    plans[index] = scratch[op.cgroup] = self._plan(op, scratch)
                except Exception as error:
                    results[index] = error
        fence = self.fence
        if plans:
            snapshot = {**self._states, **scratch}
            if snapshot != self._on_disk:
                if fence is not None:
                    fence()
                try:
                    self._write_checkpoint(snapshot)
                except Exception as error:
                    for index in plans:
                        results[index] = error
                    plans = {}
        broken: dict[str, Exception] = {}
        for index, op in enumerate(ops):
            if results[index] is not _PENDING:
                continue
            if fence is not None:
                fence()
            if op.kind in _CHANGES:
                cgroup = op.cgroup
                if cgroup in broken:
                    results[index] = DeviceControlError(
                        f"Not applied to cgroup '{cgroup}': an earlier operation on it in the same"
                        f" batch failed: {broken[cgroup]}"
                    )
                    continue
                try:
                    results[index] = self._enforce(op, plans[index])
                except Exception as error:
                    results[index] = error
                    broken[cgroup] = error
            elif op.kind == "remove":
                try:
                    results[index] = self._remove(op.cgroup)
                except Exception as error:
                    results[index] = error
            else:
                results[index] = apply_one(self, op)
        if broken and self._states != self._on_disk:
            if fence is not None:
                fence()
            try:
                self._write_checkpoint(dict(self._states))
            except Exception as error:
                logger.error("Could not rewrite the device checkpoint %s: %s", self.checkpoint.file, error)
        return results

    def _plan(self, op: DeviceOperation, scratch: dict[str, Policy]) -> Policy:
        cgroup = validate_cgroup(op.cgroup)
        if op.kind == "configure":
            return as_policy(*op.args[1:])
        if op.kind == "reconcile":
            desired = op.args[1]
            if not isinstance(desired, Policy):
                raise DeviceControlError(f"reconcile needs a Policy, got {desired!r}")
            return desired
        add, remove = check_diff(op.args[1], op.args[2])
        current = scratch.get(cgroup, self._states.get(cgroup))
        if current is None:
            raise DeviceControlError(
                f"Cannot reconfigure cgroup '{cgroup}': it has no device state (configure it first)"
            )
        return apply_diff(current, add, remove)

    def _write_checkpoint(self, snapshot: dict[str, Policy]) -> None:
        self._kernel_op("write checkpoint", self.checkpoint.file, self.checkpoint.write, snapshot)
        self._on_disk = snapshot

    # -- applying one cgroup -----------------------------------------------------

    def _enforce(self, op: DeviceOperation, access: Policy) -> Any:
        cgroup = op.cgroup
        path = self.path(cgroup)
        previous = self._states.get(cgroup)
        repairs: list[str] = []
        if op.kind == "reconcile" and previous != access:
            repairs.append(f"{path}: recorded the desired device rules in the checkpoint")
        created = False
        if op.kind == "configure" and previous is None and self.kernel_hook is None:
            # A new container's cgroup, the common case: mkdir first, no stat.
            created = self._create(path)
        elif not os.path.isdir(path):
            if op.kind == "reconfigure":
                raise DeviceControlError(f"Cannot reconfigure cgroup '{cgroup}': {path} does not exist")
            self._ensure_root()
            self._mkdir(path)
            created = True
            if op.kind == "reconcile":
                repairs.append(f"{path}: recreated the missing cgroup")
        foreign: list[int] = []
        try:
            repairs += self._attach(path, access, fresh=created, foreign_out=foreign)
        except Exception as error:  # not a simulated crash: nothing runs after one
            self._rollback(path, created, previous, error)
            raise
        self._states[cgroup] = access
        if op.kind == "reconcile":
            if foreign:
                done = f" (done: {'; '.join(repairs)})" if repairs else ""
                raise ForeignProgramsError(
                    f"{path}: device programs {sorted(foreign)} that are not device control's are attached beside"
                    " its own; the kernel runs them too, so the container may be denied devices its policy"
                    f" grants; detach them{done}", tuple(sorted(foreign)))
            return repairs
        return access

    def _rollback(self, path: str, created: bool, previous: Policy | None, error: Exception) -> None:
        try:
            if created:
                self._kernel_op("rmdir", path, os.rmdir, path)
            elif previous is not None:
                self._attach(path, previous, fresh=False)
        except Exception as rollback_error:
            logger.error("Rollback of %s after '%s' failed too: %s", path, error, rollback_error)
            error.add_note(f"Rollback failed too, {path} may be left part-way: {rollback_error}")

    def _attach(self, path: str, access: Policy, fresh: bool, foreign_out: list[int] | None = None) -> list[str]:
        """Leave exactly one own program, compiled from ``access``, on ``path``.

        Returns what it had to change beyond the normal replace, in words;
        ``foreign_out`` gets the ids of the programs of others attached."""
        code, tags = access.program
        op = self._kernel_op
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

    def _program(self, path: str, code: bytes) -> tuple[int, int, bool]:
        """``(fd, id, cached)`` of a loaded program of ``code``: from the cache, or loaded now."""
        hit = self._programs.get(code)
        if hit is not None:
            self._programs.move_to_end(code)
            return hit[0], hit[1], True
        fd = self._kernel_op("load device program for", path, _bpf.prog_load, code, self.program_name)
        try:
            prog_id = self._kernel_op("read program info for", path, _bpf.prog_info, fd).id
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
            fd = self._kernel_op("open device program", str(prog_id), _bpf.prog_get_fd_by_id, prog_id)
        except KernelOperationError as error:
            if error.errno == errno.ENOENT:
                return None, -1
            raise
        fds.append(fd)
        return self._kernel_op("read info of device program", str(prog_id), _bpf.prog_info, fd), fd

    def _remove(self, cgroup: str) -> bool:
        path = self.path(cgroup)
        try:
            self._kernel_op("rmdir", path, os.rmdir, path)
        except KernelOperationError as error:
            if error.errno == errno.EBUSY:
                logger.warning(
                    "Cgroup %s still has processes or child cgroups; keeping it and its device program",
                    path,
                )
                return False
            if error.errno != errno.ENOENT:
                raise
        self._states.pop(cgroup, None)
        return True


def _close_programs(programs: "OrderedDict[bytes, tuple[int, int]]") -> None:
    while programs:
        _code, (fd, _id) = programs.popitem()
        os.close(fd)


def _unwrap(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result
