"""cgroups v1 device backend: ``devices.allow``, ``devices.deny``, ``devices.list``.

Kernel rules this backend is written to (SPEC R-DV-1, measured on 6.x; the
semantics of the rules themselves are emulated in ``_v1_emulator``):
- One rule per ``write(2)``: a multi-line write applies only its first rule,
  and Python's buffered files merge writes. So each rule is its own
  ``os.write`` on one open fd per file (one open per file per operation).
- ``a`` in either file fails with EINVAL while the cgroup has child cgroups.
- ``rmdir`` fails with EBUSY while processes (or child cgroups) remain: the
  cgroup is kept and a warning logged.

Backend rules:
- ``configure`` on a new cgroup: mkdir, ``a`` to devices.deny, each allow
  rule (type ``a`` is written as its ``c`` and ``b`` rules), then each deny
  rule. On an existing cgroup (and in ``reconcile``) only the difference
  is written, allows before denies, so running processes never lose a
  device they keep; a full rewrite happens only when the list reads
  ``a *:* rwm``.
- A failed operation converges the cgroup back to the list it had (or
  removes the cgroup it created) and re-raises.
- One path for every operation (the kernel seam, ``_kernel``: faults are
  injected there, never by another path). Hot path (churn): the writes of
  a policy to a new cgroup are planned once per policy
  (``Policy.v1_plan``); a ``devices.list`` text that a plan wrote is found
  by its text (``listed_policy``: an update reads what its prepare wrote),
  and the writes from one plan's list to another's are worked out once per
  pair (``transition``); any other list is read line by line without
  building rules;
  ``configure`` tries mkdir first (EEXIST: an existing cgroup) instead of a
  stat; the rules to one file are written in one loop
  (``Kernel.write_lines``), one ``write(2)`` each.
- ``confine`` (the port's exception to "below the root") writes deny rules
  only, never ``a``: a confined cgroup such as ``user.slice`` has children
  and live sessions, which keep every other device.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

from ._backend import BackendBase, list_cgroup_dirs, validate_cgroup, validate_cgroups_root, validate_confined
from ._errors import DeviceControlError
from ._policy import Policy, as_policy
from ._rules import DeviceRule, check_diff
from ._v1_emulator import (
    ALLOW_ALL,
    ExceptionTable,
    apply_rules,
    group_writes,
    listed_access,
    listed_policy,
    plan_writes,
    read_listing,
    table_access,
    transition,
)

logger = logging.getLogger(__name__)

class CgroupsV1Backend(BackendBase):
    """Device rules through the cgroups v1 devices controller (see module rules)."""

    name = "cgroups_v1"

    def __init__(self, hierarchy: str, cgroups_root: str = "gpu-isolator") -> None:
        if not os.path.isfile(os.path.join(hierarchy, "devices.allow")):
            raise DeviceControlError(
                f"'{hierarchy}' is not a cgroups v1 devices hierarchy (no devices.allow);"
                " mount the devices controller or choose another device backend"
            )
        super().__init__(os.path.join(hierarchy, validate_cgroups_root(cgroups_root)))
        self.hierarchy = hierarchy
        self._prefix = self.root.rstrip("/") + "/"

    def path(self, cgroup: str) -> str:
        return self._prefix + validate_cgroup(cgroup)  # os.path.join's result, on the hot path

    # -- kernel operations -------------------------------------------------

    def _read_list(self, path: str) -> str:
        file = path + "/devices.list"
        return self.kernel.run("read", file, _read_text, file)

    def _read_table(self, path: str) -> ExceptionTable:
        return read_listing(self._read_list(path))

    def _write(self, path: str, writes: list[tuple[str, str]]) -> None:
        """The writes ``(file name, rule line)``, in order (``_write_groups``)."""
        self._write_groups(path, group_writes(writes))

    def _write_groups(self, path: str, groups: Iterable[tuple[str, Iterable[bytes]]]) -> None:
        """Each group's lines to its file, in order: one open per file, one
        ``write(2)`` per line (see the module's kernel rules)."""
        fds: dict[str, int] = {}
        kernel = self.kernel
        try:
            for name, lines in groups:
                file = path + "/" + name
                fd = fds.get(name)
                if fd is None:
                    fd = fds[name] = kernel.run("open", file, os.open, file, os.O_WRONLY | os.O_CLOEXEC)
                kernel.write_lines(fd, file, lines)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _apply(self, path: str, current: ExceptionTable | None, target: ExceptionTable) -> None:
        """Write ``target`` over ``current``; on failure converge back and re-raise."""
        created = current is None
        if created:
            self._ensure_root()
            self._mkdir(path)
        try:
            self._write(path, plan_writes(current, target))
        except Exception as error:  # not a simulated crash: nothing runs after one
            self._rollback(path, current, error)
            raise

    def _rollback(self, path: str, previous: ExceptionTable | None, error: Exception) -> None:
        try:
            if previous is None:
                self.kernel.run("rmdir", path, os.rmdir, path)
            else:
                now = self._read_table(path)
                self._write(path, plan_writes(now, previous))
        except Exception as rollback_error:  # the original error is what the caller sees
            logger.error("Rollback of %s after '%s' failed too: %s", path, error, rollback_error)
            error.add_note(f"Rollback failed too, {path} may be left part-way: {rollback_error}")

    # -- the port ------------------------------------------------------------

    def configure(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule], deny: Iterable[DeviceRule] = ()
    ) -> Policy:
        path = self.path(cgroup)
        policy = as_policy(allow, deny)
        plan = policy.v1_plan
        if self._create(path):
            # The common case, a new cgroup: mkdir and the writes, nothing else.
            try:
                self._write_groups(path, plan.groups)
            except Exception as error:  # not a simulated crash: nothing runs after one
                self._rollback(path, None, error)
                raise
            return plan.enforced
        text = self._read_list(path)
        source = listed_policy(text)
        if source is None:  # a list no plan of ours wrote: the difference, worked out
            self._apply(path, read_listing(text), plan.target)
            return plan.enforced
        # An update: the list one of our plans wrote, to another plan's (its writes known).
        try:
            self._write_groups(path, transition(source, policy))
        except Exception as error:
            self._rollback(path, source.v1_plan.target, error)
            raise
        return plan.enforced

    def reconfigure(self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]) -> Policy:
        path = self.path(cgroup)
        add, remove = check_diff(add, remove)
        if not os.path.isdir(path):
            raise DeviceControlError(f"Cannot reconfigure cgroup '{cgroup}': {path} does not exist")
        current = self._read_table(path)
        target = apply_rules(current, add, remove)
        writes = [("devices.allow", str(rule)) for rule in add] + [("devices.deny", str(rule)) for rule in remove]
        try:
            self._write(path, writes)
        except Exception as error:
            self._rollback(path, current, error)
            raise
        return table_access(target)

    def remove(self, cgroup: str) -> bool:
        return self._rmdir_unless_busy(self.path(cgroup), "it (remove it once they are gone)", logger)

    def state(self, cgroup: str) -> Policy | None:
        path = self.path(cgroup)
        if not os.path.isdir(path):
            return None
        return listed_access(self._read_list(path))

    def exists(self, cgroup: str) -> bool:
        return os.path.isdir(self.path(cgroup))

    def list_cgroups(self) -> list[str]:
        return list_cgroup_dirs(self.root)

    def reconcile(self, cgroup: str, desired: Policy) -> list[str]:
        path = self.path(cgroup)
        target = desired.v1_plan.target
        if not os.path.isdir(path):
            self._apply(path, None, target)
            return [f"{path}: recreated the missing cgroup with its device rules"]
        current = self._read_table(path)
        if current == target:
            return []
        writes = plan_writes(current, target)
        self._apply(path, current, target)
        repairs = []
        if ALLOW_ALL in current:
            repairs.append(f"{path}: devices.list read 'a *:* rwm' (allow all); denied all and rewrote the rules")
        else:
            repairs.extend(
                f"{path}: {'allowed' if name == 'devices.allow' else 'denied'} '{line}'" for name, line in writes
            )
        return repairs

    def confine(self, path: str, access: Policy) -> list[str]:
        """Each deny rule written to ``devices.deny`` of ``path`` (see the
        port): in an allow-all cgroup it becomes an exception the kernel
        also gives every cgroup below, and one that denies by default loses
        those devices (its children with it). ``devices.list`` of an
        allow-all cgroup does not show such exceptions, so the rules are
        written again on every call; what was written, in words."""
        directory = os.path.join(self.hierarchy, validate_confined(path, self.root, os.path.relpath(self.root, self.hierarchy)))
        if not os.path.isdir(directory):
            raise DeviceControlError(f"Cannot confine cgroup '{path}': {directory} does not exist")
        writes = [("devices.deny", str(rule)) for rule in access.deny]
        self._write(directory, writes)
        return [f"{directory}: denied '{line}'" for _name, line in writes]


def _read_text(file: str) -> str:
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("ascii")
