"""The cgroups v1 devices controller's semantics, emulated (pure).

What the kernel holds for a v1 cgroup is an exception list: selectors
``(type, major, minor)`` with access bits. This module models how writes to
``devices.allow`` / ``devices.deny`` change that list, so the backend
(``_cgroups_v1``) can plan its writes and say what the kernel enforces,
and tests can check the model without a kernel (as runc keeps its
emulator apart from the code that applies).

Kernel rules (SPEC R-DV-1, measured on 6.x):
- A cgroup is created allowing what its parent allows. ``a`` written to
  ``devices.deny`` switches it to deny-by-default with an empty list; ``a``
  written to ``devices.allow`` switches it to allow-all, and
  ``devices.list`` then reads ``a *:* rwm``.
- An allow rule adds an exception, or-ing access bits into an existing one
  with the same selector; a deny rule takes access bits off the exception
  with exactly the same selector and nothing else (``deny c 195:* rwm``
  leaves ``c 195:3 rwm``). So a GPU is revoked by denying its exact rule,
  and a deny can never carve a device out of a wildcard allow.
- A rule of type ``a`` is written as its ``c`` and ``b`` rules. Beside a
  ``c *:*`` / ``b *:*`` rule with other access bits the kernel would merge
  the two into one exception granting more than either (``a *:* r`` and
  ``b *:* w`` would allow ``rw``): such a policy is refused.

Everything here is pure: no files, no kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from ._errors import DeviceRuleError
from ._policy import Policy, intern, interned
from ._rules import MAX_MAJOR, MAX_MINOR, DeviceRule

Selector = tuple[str, "int | None", "int | None"]
ExceptionTable = dict[Selector, str]

ALLOW_ALL: Selector = ("a", None, None)


def _merge(a: str, b: str) -> str:
    return "".join(ch for ch in "rwm" if ch in a or ch in b)


def _minus(a: str, b: str) -> str:
    return "".join(ch for ch in a if ch not in b)


def line(key: Selector, access: str) -> str:
    """The v1 line of one exception."""
    kind, major, minor = key
    return f"{kind} {'*' if major is None else major}:{'*' if minor is None else minor} {access}"


def v1_exceptions(access: Policy) -> ExceptionTable:
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
                    f"cgroups v1 cannot hold '{rule}' beside '{line(key, seen)}': the kernel would merge them"
                    f" into '{line(key, merged)}', granting more than either rule"
                )
            table[key] = merged
    return apply_rules(table, (), access.deny)


def apply_rules(table: ExceptionTable, allow: tuple[DeviceRule, ...], deny: tuple[DeviceRule, ...]) -> ExceptionTable:
    """The list after writing ``allow`` rules and then ``deny`` rules (exact
    selectors, as ``reconfigure`` writes them) to one holding ``table``."""
    table = dict(table)
    for rule in allow:
        table[rule.selector] = _merge(table.get(rule.selector, ""), rule.access)
    for rule in deny:
        key = rule.selector
        if key in table:
            left = _minus(table[key], rule.access)
            if left:
                table[key] = left
            else:
                del table[key]
    return table


_CANONICAL = {
    "".join(order): "".join(ch for ch in "rwm" if ch in order)
    for order in ("r", "w", "m", "rw", "wr", "rm", "mr", "wm", "mw", "rwm", "rmw", "wrm", "wmr", "mrw", "mwr")
}
"""Every access string the kernel could print, and its canonical (``rwm``) order."""


_NOT_A_NUMBER = -1


def _number(text: str, limit: int) -> int | None:
    """``*`` -> None, a number within ``limit`` -> it, anything else -> ``_NOT_A_NUMBER``."""
    if text == "*":
        return None
    if text.isdigit() and text.isascii() and int(text) <= limit:
        return int(text)
    return _NOT_A_NUMBER


def _exception(text_line: str) -> tuple[Selector, str]:
    """One ``devices.list`` line as ``(selector, access)``: read directly in
    the common case, through ``DeviceRule.parse`` (and its error) otherwise."""
    fields = text_line.split()
    if len(fields) == 3:
        kind, numbers, access = fields
        major_text, _, minor_text = numbers.partition(":")
        major, minor, canonical = _number(major_text, MAX_MAJOR), _number(minor_text, MAX_MINOR), _CANONICAL.get(access)
        if (
            canonical is not None
            and major != _NOT_A_NUMBER
            and minor != _NOT_A_NUMBER
            and (kind in ("b", "c") or (kind == "a" and major is None and minor is None))
        ):
            return (kind, major, minor), canonical
    rule = DeviceRule.parse(text_line)
    return rule.selector, rule.access


def parse_devices_list(text: str) -> ExceptionTable:
    """``devices.list`` as a table ``selector -> access`` (in list order)."""
    table: ExceptionTable = {}
    for text_line in text.splitlines():
        if text_line.strip():
            key, access = _exception(text_line)
            seen = table.get(key)
            table[key] = access if seen is None else _merge(seen, access)
    return table


def table_access(table: ExceptionTable) -> Policy:
    """What the kernel enforces for this exception list, as a policy (found
    by its text: lists repeat from cgroup to cgroup)."""
    return Policy.from_text(";".join(line(key, access) for key, access in table.items()) + " | ")


def plan_writes(current: ExceptionTable | None, target: ExceptionTable) -> list[tuple[str, str]]:
    """The ``(file, line)`` writes that turn ``current`` into ``target``.

    ``current`` None (a new cgroup) or allow-all starts with ``a`` to
    devices.deny; otherwise only the difference is written, allows first."""
    if current is None or ALLOW_ALL in current:
        return [("devices.deny", "a")] + [("devices.allow", line(key, access)) for key, access in target.items()]
    writes: list[tuple[str, str]] = []
    for key, access in target.items():
        if _minus(access, current.get(key, "")):
            writes.append(("devices.allow", line(key, access)))
    for key, access in current.items():
        extra = _minus(access, target.get(key, ""))
        if extra:
            writes.append(("devices.deny", line(key, extra)))
    return writes


Groups = tuple[tuple[str, tuple[bytes, ...]], ...]
"""Writes as runs of ``(file, lines)``, in order."""

TRANSITIONS = 64
"""Transitions a plan keeps (``transition``), at most: sources beyond are computed again."""


def group_writes(writes: list[tuple[str, str]]) -> Groups:
    """``plan_writes``' ``(file name, rule line)`` pairs as runs of lines to one file, in order."""
    groups: list[tuple[str, list[bytes]]] = []
    for name, text_line in writes:
        if not groups or groups[-1][0] != name:
            groups.append((name, []))
        groups[-1][1].append(text_line.encode())
    return tuple((name, tuple(lines)) for name, lines in groups)


class V1Plan(NamedTuple):
    """How a policy is written to a new cgroup (computed once per policy:
    ``Policy.v1_plan``)."""

    target: ExceptionTable
    """The exception list the kernel then holds."""
    listing: str
    """What ``devices.list`` then reads (the list in the order written)."""
    groups: tuple[tuple[str, tuple[bytes, ...]], ...]
    """The writes from nothing as runs of ``(file, lines)``, in order."""
    enforced: Policy
    """What the kernel then enforces, as a policy."""
    transitions: dict
    """Source policy -> the writes from its plan's list to this one (``transition``)."""


def fresh_plan(access: Policy) -> V1Plan:
    """The ``V1Plan`` of ``access`` (see ``V1Plan``)."""
    target = v1_exceptions(access)
    groups = group_writes(plan_writes(None, target))
    if not access.deny and all(rule.type != "a" for rule in access.allow):
        enforced = access  # the kernel holds exactly these rules
    else:
        enforced = table_access(target)
    listing = "".join(line(key, bits) + "\n" for key, bits in target.items())
    intern(("devices.list", listing), access)  # reading it back finds this plan (read_listing)
    return V1Plan(target, listing, groups, enforced, {})


def listed_policy(text: str) -> Policy | None:
    """The policy whose plan lists exactly ``text`` (``devices.list`` after it
    was written to a new cgroup), None when no known plan does."""
    return interned(("devices.list", text))


def transition(source: Policy, target: Policy) -> Groups:
    """The writes that turn a cgroup listing ``source``'s plan into one listing
    ``target``'s (``plan_writes``: allows first): computed once per pair and
    kept on the target's plan (at most ``TRANSITIONS`` sources)."""
    plan = target.v1_plan
    groups = plan.transitions.get(source)
    if groups is None:
        groups = group_writes(plan_writes(source.v1_plan.target, plan.target))
        if len(plan.transitions) >= TRANSITIONS:
            plan.transitions.clear()
        plan.transitions[source] = groups
    return groups


def listed_access(text: str) -> Policy:
    """What the kernel enforces for a ``devices.list`` text (see ``read_listing``)."""
    policy = interned(("devices.list", text))
    if policy is not None:
        return policy.v1_plan.enforced
    return table_access(parse_devices_list(text))


def read_listing(text: str) -> ExceptionTable:
    """``devices.list`` as a table: the target of a known plan when the text is
    what that plan lists (no parsing), else ``parse_devices_list``."""
    policy = interned(("devices.list", text))
    if policy is not None:
        return dict(policy.v1_plan.target)
    return parse_devices_list(text)
