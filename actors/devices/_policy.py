"""The device policy of a cgroup: one frozen, interned value.

Rules:
- A ``Policy`` is a pair of normalised rule lists ``(allow, deny)`` (the
  model of ``_rules``: nothing is granted by default, deny overrides
  allow). ``Policy(allow, deny)`` normalises the rules it is given;
  ``Policy.create(allow, deny)`` also takes v1 lines and refuses what the
  model forbids (a deny rule with a wildcard, an allow rule a deny rule
  encompasses), with Mesos' wording.
- Frozen and interned: equal policies are normally one object (a table
  keyed by the rules as given and as normalised, by the v1 lines and text,
  and by what ``devices.list`` reads after its v1 plan: reading that back
  finds the policy, with no parsing). The
  table keeps the newest ``INTERN_CAPACITY`` keys; a policy made again after
  it left the table is an equal new object: equality and hashing compare
  the rules, so nothing depends on identity or on callers passing the same
  tuples again.
- What the backends derive from a policy is computed once, on first use,
  and kept on it: ``lines()`` (the v1 line form: the frames to a device
  worker), ``v1_plan`` (how cgroups v1 writes it to a
  new cgroup, ``_v1_emulator``) and ``program`` (the eBPF program and the
  tags the kernel may give it, ``_device_program``). There is no other
  policy cache in device control.
- Its ``text`` (the v1 lines, ``;``-separated, `` | `` between allow and
  deny) is its wire form: frames to and from a device worker carry it, and
  ``Policy.from_text`` interns it again on the other side (pickling the
  rules would cost ~10 µs a frame, the text ~1 µs).
- ``apply_diff`` (reconfigure) and ``container_policy`` build policies.

Pure: no files, no kernel, no clock.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Hashable, Iterable

from ._errors import DeviceRuleError
from ._rules import DeviceRule, as_rules, check_diff, granted, normalize, query_access

if TYPE_CHECKING:
    from ._v1_emulator import V1Plan

INTERN_CAPACITY = 4096
"""Keys the intern table keeps at most (oldest out)."""

_INTERNED: dict[Hashable, "Policy"] = {}
"""Policies by the rules as given, as normalised, by their lines, by their
text, and by the ``devices.list`` text of their v1 plan."""


def interned(key: Hashable) -> "Policy | None":
    """The policy interned under ``key`` (any content key: see module rules)."""
    return _INTERNED.get(key)


def intern(key: Hashable, policy: "Policy") -> None:
    """Intern ``policy`` under one more content key (the v1 listing of its plan)."""
    _intern(key, policy)


def _intern(key: Hashable, policy: "Policy") -> None:
    if len(_INTERNED) >= INTERN_CAPACITY:  # the older half out (a thread may be doing the same)
        for old in list(_INTERNED)[: INTERN_CAPACITY // 2]:
            _INTERNED.pop(old, None)
    _INTERNED[key] = policy


class Policy:
    """The normalised device policy ``(allow, deny)`` of a cgroup (see module rules)."""

    allow: tuple[DeviceRule, ...]
    deny: tuple[DeviceRule, ...]

    def __new__(cls, allow: Iterable[DeviceRule] = (), deny: Iterable[DeviceRule] = ()) -> "Policy":
        key = (allow if type(allow) is tuple else tuple(allow), deny if type(deny) is tuple else tuple(deny))
        policy = _INTERNED.get(key)
        if policy is not None:
            return policy
        normal = (normalize(key[0]), normalize(key[1]))
        policy = _INTERNED.get(normal)
        if policy is None:
            policy = object.__new__(cls)
            object.__setattr__(policy, "allow", normal[0])
            object.__setattr__(policy, "deny", normal[1])
            object.__setattr__(policy, "_hash", hash(normal))
            _intern(normal, policy)
        if key != normal:
            _intern(key, policy)
        return policy

    @classmethod
    def create(cls, allow: Iterable[DeviceRule | str] = (), deny: Iterable[DeviceRule | str] = ()) -> "Policy":
        """Normalise and check a policy: exact deny rules, no allow rule a deny rule swallows."""
        policy = cls(as_rules(allow), as_rules(deny))
        problem = policy._problem
        if problem is not None:
            raise DeviceRuleError(problem)
        return policy

    @classmethod
    def from_lines(cls, allow: tuple[str, ...], deny: tuple[str, ...]) -> "Policy":
        """The policy of v1 lines (as ``lines()`` gives them)."""
        key = (allow, deny)
        policy = _INTERNED.get(key)
        if policy is None:
            policy = cls(as_rules(allow), as_rules(deny))
            _intern(key, policy)
        return policy

    @classmethod
    def from_text(cls, text: str) -> "Policy":
        """The policy whose ``text`` this is."""
        policy = _INTERNED.get(text)
        if policy is None:
            allow, _, deny = text.partition(" | ")
            policy = cls.from_lines(tuple(filter(None, allow.split(";"))), tuple(filter(None, deny.split(";"))))
            _intern(text, policy)
        return policy

    @classmethod
    def container(cls, control_devices: Iterable[DeviceRule | str], gpu_rules: Iterable[DeviceRule | str]) -> "Policy":
        """A container's policy: deny all (the default), then allow the standard
        set, the control devices and the GPUs."""
        return cls.create([*STANDARD_CONTAINER_DEVICES, *as_rules(control_devices), *as_rules(gpu_rules)], ())

    # -- a value ------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Policy is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Policy is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Policy:
            return NotImplemented
        return self._hash == other._hash and self.allow == other.allow and self.deny == other.deny

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Policy(allow={self.allow!r}, deny={self.deny!r})"

    def __reduce__(self) -> tuple[Any, tuple]:
        return (_from_text, (self.text,))

    def __copy__(self) -> "Policy":
        return self

    def __deepcopy__(self, memo: dict) -> "Policy":
        return self

    # -- the model ------------------------------------------------------------------
    def is_granted(self, type: str, major: int, minor: int, access: str) -> bool:
        """Whether this policy grants ``access`` to device ``type major:minor``."""
        return granted(self.allow, self.deny, type, major, minor, query_access(type, major, minor, access))

    def lines(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The allow and deny lists as v1 lines (how a policy crosses a pipe)."""
        return self._lines

    # -- derived once (see module rules) ------------------------------------------
    @functools.cached_property
    def _lines(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(str(rule) for rule in self.allow), tuple(str(rule) for rule in self.deny)

    @functools.cached_property
    def text(self) -> str:
        """The wire form (see module rules): ``"c *:* m;c 1:3 rwm | c 195:0 w"``."""
        allow, deny = self._lines
        return ";".join(allow) + " | " + ";".join(deny)

    @functools.cached_property
    def _problem(self) -> str | None:
        for rule in self.deny:
            if rule.has_wildcard:
                return f"Invalid deny rule '{rule}': deny rules name exact devices (no 'a', no '*')"
        for allowed in self.allow:
            for denied in self.deny:
                if denied.encompasses(allowed):
                    return (
                        f"Failed to configure allow and deny devices: allow entry '{allowed}'"
                        f" cannot be encompassed by deny entry '{denied}'"
                    )
        return None

    @functools.cached_property
    def v1_plan(self) -> "V1Plan":
        """How cgroups v1 writes this policy to a new cgroup (``_v1_emulator``)."""
        from ._v1_emulator import fresh_plan

        return fresh_plan(self)

    @functools.cached_property
    def program(self) -> tuple[bytes, frozenset[bytes]]:
        """The eBPF device program of this policy and the tags the kernel may give it."""
        from ._bpf import program_tags
        from ._device_program import build_device_program

        code = build_device_program(self)
        return code, program_tags(code)


def _from_text(text: str) -> Policy:
    return Policy.from_text(text)


def as_policy(allow: Policy | Iterable[DeviceRule | str], deny: Iterable[DeviceRule | str] = ()) -> Policy:
    """A policy given as one, or as allow and deny rules (``Policy.create``)."""
    if type(allow) is Policy:
        if deny:
            raise DeviceRuleError("Give a Policy alone, or allow and deny rules: not a Policy and deny rules")
        return allow
    return Policy.create(allow, deny)


def _without(rule: DeviceRule, bits: str) -> DeviceRule | None:
    left = "".join(ch for ch in rule.access if ch not in bits)
    return DeviceRule(rule.type, rule.major, rule.minor, left) if left else None


def apply_diff(
    current: Policy,
    add: Iterable[DeviceRule | str] = (),
    remove: Iterable[DeviceRule | str] = (),
) -> Policy:
    """The policy after adding ``add`` and removing ``remove`` (exact rules).

    Each addition is added to allow and its bits leave deny rules of the
    same device; each removal takes its bits off allow rules of the same
    device, and what a wildcard allow rule still grants of it is added to
    deny. A removal that encompasses an addition is an error."""
    additions, removals = check_diff(add, remove)
    allow = list(current.allow)
    deny = list(current.deny)
    for addition in additions:
        deny = [
            kept
            for rule in deny
            if (kept := (_without(rule, addition.access) if rule.selector == addition.selector else rule))
        ]
        allow.append(addition)
    for removal in removals:
        by_wildcards = ""
        revoked: list[DeviceRule] = []
        for rule in allow:
            if rule.has_wildcard:
                if rule.selector_encompasses(removal):
                    by_wildcards += rule.access
                revoked.append(rule)
            elif rule.selector == removal.selector:
                kept = _without(rule, removal.access)
                if kept is not None:
                    revoked.append(kept)
            else:
                revoked.append(rule)
        allow = revoked
        still = "".join(ch for ch in removal.access if ch in by_wildcards)
        if still:
            deny.append(DeviceRule(removal.type, removal.major, removal.minor, still))
    return Policy(tuple(allow), tuple(deny))


STANDARD_CONTAINER_DEVICES: tuple[DeviceRule, ...] = tuple(
    DeviceRule.parse(line)
    for line in (
        "c *:* m",
        "b *:* m",
        "c 1:3 rwm",  # /dev/null
        "c 1:5 rwm",  # /dev/zero
        "c 1:7 rwm",  # /dev/full
        "c 1:8 rwm",  # /dev/random
        "c 1:9 rwm",  # /dev/urandom
        "c 5:0 rwm",  # /dev/tty
        "c 5:1 rwm",  # /dev/console
        "c 5:2 rwm",  # /dev/ptmx
        "c 4:0 rwm",  # /dev/tty0
        "c 4:1 rwm",  # /dev/tty1
        "c 136:* rwm",  # /dev/pts/*
        "c 10:200 rwm",  # /dev/net/tun
    )
)
"""The devices every container may use (Mesos' default whitelist)."""


def container_policy(
    control_devices: Iterable[DeviceRule | str], gpu_rules: Iterable[DeviceRule | str]
) -> tuple[tuple[DeviceRule, ...], tuple[DeviceRule, ...]]:
    """``(allow, deny)`` of a container (``Policy.container``'s rules). The deny
    list is empty: "deny all" is the model's default, which v1 realises by
    writing ``a`` to ``devices.deny`` first."""
    policy = Policy.container(control_devices, gpu_rules)
    return policy.allow, policy.deny
