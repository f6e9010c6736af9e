"""cgroups v1 device backend: ``devices.allow``, ``devices.deny``, ``devices.list``.

Kernel rules this backend is written to (SPEC R-DV-1, measured on 6.x):
- One rule per ``write(2)``: a multi-line write applies only its first rule,
  and Python's buffered files merge writes. So each rule is its own
  ``os.write`` on one open fd per file (one open per file per operation).
- A cgroup is created allowing what its parent allows. ``a`` written to
  ``devices.deny`` switches it to deny-by-default with an empty list; ``a``
  written to ``devices.allow`` switches it to allow-all, and ``devices.list``
  then reads ``a *:* rwm`` (what a systemd reload can do: drift).
- An allow rule adds an exception, or-ing access bits into an existing one
  with the same selector; a deny rule takes access bits off the exception
  with exactly the same selector and nothing else (``deny c 195:* rwm``
  leaves ``c 195:3 rwm``). So a GPU is revoked by denying its exact rule,
  and a deny can never carve a device out of a wildcard allow: access a
  wildcard grants (``c *:* m``) stays. The backend applies the model with
  these kernel semantics; ``state`` is what the kernel enforces.
- ``a`` in either file fails with EINVAL while the cgroup has child cgroups.
- A rule of type ``a`` is written as its ``c`` and ``b`` rules. Beside a
  ``c *:*`` / ``b *:*`` rule with other access bits the kernel would merge
  the two into one exception granting more than either (``a *:* r`` and
  ``b *:* w`` would allow ``rw``): such a policy is refused.
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
- Hot path (churn): the writes of a policy to a new cgroup are planned once
  per policy (cached); with no ``kernel_hook`` set, ``configure`` tries
  mkdir first (EEXIST: an existing cgroup) instead of a stat, and writes a
  cached plan without a wrapper call per rule. The syscalls and errors are
  the same; with a hook set every operation is reported in the plain order.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from typing import Iterable, NamedTuple

from ._backend import BackendBase, SimulatedCrash, list_cgroup_dirs, validate_cgroup, validate_cgroups_root
from ._errors import DeviceControlError, DeviceRuleError, KernelOperationError
from ._rules import CgroupDeviceAccess, DeviceRule, check_diff, normalize

logger = logging.getLogger(__name__)

Selector = tuple[str, "int | None", "int | None"]
ExceptionTable = dict[Selector, str]

_ALLOW_ALL = ("a", None, None)


def _merge(a: str, b: str) -> str:
    return "".join(ch for ch in "rwm" if ch in a or ch in b)


def _minus(a: str, b: str) -> str:
    return "".join(ch for ch in a if ch not in b)


def v1_exceptions(access: CgroupDeviceAccess) -> ExceptionTable:
    """The exception list the kernel holds after ``a`` to deny, the allow
    rules and then the deny rules of ``access`` (see kernel rules)."""
    table: ExceptionTable = {}
    for rule in access.allow:
        for kind in ("c", "b") if rule.type == "a" else (rule.type,):
            key = (kind, rule.major, rule.minor)
            seen = table.get(key)
            if seen is None:
                table[key] = rule.access
                continue
            merged = _merge(seen, rule.access)
            if merged not in (seen, rule.access):
                raise DeviceRuleError(
                    f"cgroups v1 cannot hold '{rule}' beside '{_line(key, seen)}': the kernel would merge them"
                    f" into '{_line(key, merged)}', granting more than either rule"
                )
            table[key] = merged
    for rule in access.deny:
        key = rule.selector
        if key in table:
            left = _minus(table[key], rule.access)
            if left:
                table[key] = left
            else:
                del table[key]
    return table


def parse_devices_list(text: str) -> ExceptionTable:
    """``devices.list`` as a table ``selector -> access`` (in list order)."""
    table: ExceptionTable = {}
    for line in text.splitlines():
        if line.strip():
            rule = DeviceRule.parse(line)
            table[rule.selector] = _merge(table.get(rule.selector, ""), rule.access)
    return table


@functools.lru_cache(maxsize=256)
def _parsed_list(text: str) -> ExceptionTable:
    # Cached: containers repeat a few policies, so devices.list texts repeat.
    # Callers get a copy (``_read_table``).
    return parse_devices_list(text)


@functools.lru_cache(maxsize=1024)
def _policy(allow: tuple[DeviceRule, ...], deny: tuple[DeviceRule, ...]) -> CgroupDeviceAccess:
    # Cached: ``CgroupDeviceAccess.create`` (its errors are not cached).
    return CgroupDeviceAccess.create(allow, deny)


class _FreshPlan(NamedTuple):
    """How a policy is written to a new cgroup (see ``_fresh_plan``)."""

    target: ExceptionTable
    writes: list[tuple[str, str]]
    groups: tuple[tuple[str, tuple[bytes, ...]], ...]
    """The same writes as runs of ``(file, lines)``, in order."""
    enforced: CgroupDeviceAccess


@functools.lru_cache(maxsize=1024)
def _fresh_plan(access: CgroupDeviceAccess) -> _FreshPlan:
    """For a new cgroup: the exception table, the writes from nothing, and
    the policy the kernel then enforces (cached: containers repeat policies)."""
    target = v1_exceptions(access)
    writes = plan_writes(None, target)
    groups: list[tuple[str, list[bytes]]] = []
    for name, line in writes:
        if not groups or groups[-1][0] != name:
            groups.append((name, []))
        groups[-1][1].append(line.encode())
    if not access.deny and all(rule.type != "a" for rule in access.allow):
        enforced = access  # the kernel holds exactly these rules
    else:
        enforced = table_access(target)
    return _FreshPlan(target, writes, tuple((name, tuple(lines)) for name, lines in groups), enforced)


@functools.lru_cache(maxsize=1024)
def _table_access(items: tuple[tuple[Selector, str], ...]) -> CgroupDeviceAccess:
    return table_access(dict(items))


def table_rules(table: ExceptionTable) -> list[DeviceRule]:
    """The table as rules, in order."""
    return [DeviceRule(kind, major, minor, access) for (kind, major, minor), access in table.items()]


def table_access(table: ExceptionTable) -> CgroupDeviceAccess:
    """What the kernel enforces for this exception list, as a policy."""
    return CgroupDeviceAccess(normalize(table_rules(table)), ())


def plan_writes(current: ExceptionTable | None, target: ExceptionTable) -> list[tuple[str, str]]:
    """The ``(file, line)`` writes that turn ``current`` into ``target``.

    ``current`` None (a new cgroup) or allow-all starts with ``a`` to
    devices.deny; otherwise only the difference is written, allows first."""
    if current is None or _ALLOW_ALL in current:
        return [("devices.deny", "a")] + [("devices.allow", _line(key, access)) for key, access in target.items()]
    writes: list[tuple[str, str]] = []
    for key, access in target.items():
        if _minus(access, current.get(key, "")):
            writes.append(("devices.allow", _line(key, access)))
    for key, access in current.items():
        extra = _minus(access, target.get(key, ""))
        if extra:
            writes.append(("devices.deny", _line(key, extra)))
    return writes


def _line(key: Selector, access: str) -> str:
    kind, major, minor = key
    return f"{kind} {'*' if major is None else major}:{'*' if minor is None else minor} {access}"


class CgroupsV1Backend(BackendBase):
    """Device rules through the cgroups v1 devices controller (see module rules)."""

    name = "cgroups_v1"
    applies_each = True
    """Operations are independent (no batch-wide write): a device worker may
    apply them one by one and report as it goes."""

    def __init__(self, hierarchy: str, cgroups_root: str = "gpu-isolator") -> None:
        if not os.path.isfile(os.path.join(hierarchy, "devices.allow")):
            raise DeviceControlError(
                f"'{hierarchy}' is not a cgroups v1 devices hierarchy (no devices.allow);"
                " mount the devices controller or choose another device backend"
            )
        super().__init__(os.path.join(hierarchy, validate_cgroups_root(cgroups_root)))
        self.hierarchy = hierarchy
        self._plans: dict[tuple[int, int], tuple[tuple, tuple, _FreshPlan]] = {}
        self._prefix = self.root.rstrip("/") + "/"

    def path(self, cgroup: str) -> str:
        return self._prefix + validate_cgroup(cgroup)  # os.path.join's result, on the hot path

    # -- kernel operations -------------------------------------------------

    def _read_table(self, path: str) -> ExceptionTable:
        file = os.path.join(path, "devices.list")
        text = self._kernel_op("read", file, _read_text, file)
        return dict(_parsed_list(text))

    def _write(self, path: str, writes: list[tuple[str, str]]) -> None:
        fds: dict[str, int] = {}
        op = self._kernel_op
        try:
            for name, line in writes:
                fd = fds.get(name)
                if fd is None:
                    file = path + "/" + name
                    fd = fds[name] = op("open", file, os.open, file, os.O_WRONLY | os.O_CLOEXEC)
                op(f"write '{line}' to", path + "/" + name, os.write, fd, line.encode())
        finally:
            for fd in fds.values():
                os.close(fd)

    def _write_groups(self, path: str, groups: tuple[tuple[str, tuple[bytes, ...]], ...]) -> None:
        """``_write`` for a cached plan with no hook set: the same syscalls,
        the same errors, without a wrapper call per rule."""
        fds: dict[str, int] = {}
        write = os.write
        try:
            for name, lines in groups:
                fd = fds.get(name)
                file = path + "/" + name
                if fd is None:
                    fd = fds[name] = self._kernel_op("open", file, os.open, file, os.O_WRONLY | os.O_CLOEXEC)
                data = b""
                try:
                    for data in lines:
                        write(fd, data)
                except OSError as error:  # reported exactly as _kernel_op does
                    self._kernel_op(f"write '{data.decode()}' to", file, _reraise, error)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _mkdir(self, path: str) -> None:
        self._kernel_op("mkdir", path, os.mkdir, path)

    def _ensure_root(self) -> None:
        if not os.path.isdir(self.root):
            try:
                self._mkdir(self.root)
            except KernelOperationError as error:
                if not os.path.isdir(self.root):
                    raise error

    def _apply(self, path: str, current: ExceptionTable | None, target: ExceptionTable) -> None:
        """Write ``target`` over ``current``; on failure converge back and re-raise."""
        created = current is None
        if created:
            self._ensure_root()
            self._mkdir(path)
        try:
            self._write(path, plan_writes(current, target))
        except BaseException as error:
            if not isinstance(error, SimulatedCrash):
                self._rollback(path, current, error)
            raise

    def _rollback(self, path: str, previous: ExceptionTable | None, error: BaseException) -> None:
        try:
            if previous is None:
                self._kernel_op("rmdir", path, os.rmdir, path)
            else:
                now = self._read_table(path)
                self._write(path, plan_writes(now, previous))
        except Exception as rollback_error:  # the original error is what the caller sees
            logger.error("Rollback of %s after '%s' failed too: %s", path, error, rollback_error)
            if isinstance(error, Exception):
                error.add_note(f"Rollback failed too, {path} may be left part-way: {rollback_error}")

    # -- the port ------------------------------------------------------------

    def configure(self, cgroup: str, allow: Iterable[DeviceRule], deny: Iterable[DeviceRule]) -> CgroupDeviceAccess:
        path = self.path(cgroup)
        plan = self._plan(allow, deny)
        if self.kernel_hook is not None:  # every kernel operation told, in the plain order
            current = self._read_table(path) if os.path.isdir(path) else None
        elif self._create(path):
            # The common case, a new cgroup: mkdir and the writes, nothing else.
            try:
                self._write_groups(path, plan.groups)
            except BaseException as error:
                self._rollback(path, None, error)
                raise
            return plan.enforced
        else:
            current = self._read_table(path)
        self._apply(path, current, plan.target)
        return plan.enforced

    def _plan(self, allow: Iterable[DeviceRule], deny: Iterable[DeviceRule]) -> _FreshPlan:
        """``_fresh_plan`` of the policy; the same tuples (device control
        passes the same ones again and again) are looked up by identity."""
        hit = self._plans.get((id(allow), id(deny)))
        if hit is not None and hit[0] is allow and hit[1] is deny:
            return hit[2]
        plan = _fresh_plan(_policy(tuple(allow), tuple(deny)))
        if type(allow) is tuple and type(deny) is tuple:  # immutable: safe to remember
            if len(self._plans) >= 256:
                self._plans.clear()
            self._plans[(id(allow), id(deny))] = (allow, deny, plan)
        return plan

    def _create(self, path: str) -> bool:
        """mkdir ``path`` (and the root when missing); False if it already exists."""
        try:
            os.mkdir(path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            self._ensure_root()
        except OSError as error:
            self._kernel_op("mkdir", path, _reraise, error)
        try:
            self._mkdir(path)
        except KernelOperationError as error:
            if error.errno == errno.EEXIST:
                return False
            raise
        return True

    def reconfigure(self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]) -> CgroupDeviceAccess:
        path = self.path(cgroup)
        add, remove = check_diff(add, remove)
        if not os.path.isdir(path):
            raise DeviceControlError(f"Cannot reconfigure cgroup '{cgroup}': {path} does not exist")
        current = self._read_table(path)
        target = dict(current)
        for rule in add:
            target[rule.selector] = _merge(target.get(rule.selector, ""), rule.access)
        for rule in remove:
            if rule.selector in target:
                left = _minus(target[rule.selector], rule.access)
                if left:
                    target[rule.selector] = left
                else:
                    del target[rule.selector]
        writes = [("devices.allow", str(rule)) for rule in add] + [("devices.deny", str(rule)) for rule in remove]
        try:
            self._write(path, writes)
        except BaseException as error:
            if not isinstance(error, SimulatedCrash):
                self._rollback(path, current, error)
            raise
        return _table_access(tuple(target.items()))

    def remove(self, cgroup: str) -> bool:
        path = self.path(cgroup)
        try:
            self._kernel_op("rmdir", path, os.rmdir, path)
        except KernelOperationError as error:
            if error.errno == errno.ENOENT:
                return True
            if error.errno == errno.EBUSY:
                logger.warning(
                    "Cgroup %s still has processes or child cgroups; keeping it (remove it once they are gone)",
                    path,
                )
                return False
            raise
        return True

    def state(self, cgroup: str) -> CgroupDeviceAccess | None:
        path = self.path(cgroup)
        if not os.path.isdir(path):
            return None
        return table_access(self._read_table(path))

    def exists(self, cgroup: str) -> bool:
        return os.path.isdir(self.path(cgroup))

    def list_cgroups(self) -> list[str]:
        return list_cgroup_dirs(self.root)

    def reconcile(self, cgroup: str, desired: CgroupDeviceAccess) -> list[str]:
        path = self.path(cgroup)
        target = v1_exceptions(desired)
        if not os.path.isdir(path):
            self._apply(path, None, target)
            return [f"{path}: recreated the missing cgroup with its device rules"]
        current = self._read_table(path)
        if current == target:
            return []
        writes = plan_writes(current, target)
        self._apply(path, current, target)
        repairs = []
        if _ALLOW_ALL in current:
            repairs.append(f"{path}: devices.list read 'a *:* rwm' (allow all); denied all and rewrote the rules")
        else:
            repairs.extend(
                f"{path}: {'allowed' if name == 'devices.allow' else 'denied'} '{line}'" for name, line in writes
            )
        return repairs


def _reraise(error: OSError) -> None:
    raise error


def _read_text(file: str) -> str:
    with open(file, encoding="ascii") as handle:
        return handle.read()
