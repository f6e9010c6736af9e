"""Device rules: the pure model of which devices a cgroup may use.

Rules of the model (cgroups v1 line format, Mesos' ``CgroupDeviceAccess``;
the policy value itself is ``_policy.Policy``):
- A ``DeviceRule`` is ``{a|b|c} <major|*>:<minor|*> <access>``; access is a
  non-empty subset of ``rwm`` (read, write, mknod), kept in ``rwm`` order.
  Bare ``a`` means ``a *:* rwm``; type ``a`` (all types) takes no numbers.
  ``None`` stands for ``*``. Majors are 0..4095, minors 0..1048575 (Linux).
- A rule *encompasses* a query when its type is ``a`` or equal, each of its
  numbers is ``*`` or equal, and the query's access is a subset of its own.
- A policy is a pair of normalised lists ``(allow, deny)``. Nothing is
  granted by default ("deny all"). An access is granted when ONE allow rule
  encompasses it (type, numbers and every requested bit; as the kernel
  does, two rules do not add up) and no deny rule's selector covers the
  device with an overlapping access bit: deny overrides allow.
- Deny rules name exact devices (no ``a``, no ``*``), as in Mesos.
- Normalising a list merges rules with the same selector (access bits
  or-ed), drops every rule another rule encompasses, and sorts the rest
  (type, then major, then minor; ``*`` first), so equal policies compare
  equal whatever order they were given in. It never changes a verdict of
  the merged list.
- Reconfigure takes exact rules only (``check_diff``); a removal that
  encompasses an addition is an error.

Everything here is pure: no files, no kernel, no clock.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import msgspec
from msgspec.structs import force_setattr

from ._errors import DeviceRuleError

MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1
_ACCESS_ORDER = "rwm"
_TYPES = ("a", "b", "c")


def _canonical_access(access: str, source: object) -> str:
    if not isinstance(access, str) or not access:
        raise DeviceRuleError(f"Invalid device rule {source!r}: access must be a non-empty subset of 'rwm'")
    if any(ch not in _ACCESS_ORDER for ch in access) or len(set(access)) != len(access):
        raise DeviceRuleError(
            f"Invalid device rule {source!r}: access {access!r} must be a subset of 'rwm' without repeats"
        )
    return "".join(ch for ch in _ACCESS_ORDER if ch in access)


# Access strings in canonical order, and their bits (read 2, write 4, mknod 1).
_ACCESS_BITS = {
    "".join(ch for ch in _ACCESS_ORDER if ch in combo): sum({"r": 2, "w": 4, "m": 1}[ch] for ch in combo)
    for combo in ("r", "w", "m", "rw", "rm", "wm", "rwm")
}


def _fits(value: object, limit: int) -> bool:
    return value is None or (type(value) is int and 0 <= value <= limit)


class DeviceRule(msgspec.Struct, frozen=True):
    """One device rule, ``{a|b|c} <major|*>:<minor|*> <access>`` (see module rules)."""

    type: str
    major: int | None = None
    minor: int | None = None
    access: str = "rwm"

    def __post_init__(self) -> None:
        kind, major, minor, access = self.type, self.major, self.minor, self.access
        if (
            (kind == "b" or kind == "c" or (kind == "a" and major is None and minor is None))
            and _fits(major, MAX_MAJOR)
            and _fits(minor, MAX_MINOR)
            and access in _ACCESS_BITS
        ):
            return  # the common case: valid and canonical
        source = f"{kind} {_number(major)}:{_number(minor)} {access}"
        if kind not in _TYPES:
            raise DeviceRuleError(f"Invalid device rule {source!r}: type must be 'a', 'b' or 'c'")
        for name, value, limit in (("major", major, MAX_MAJOR), ("minor", minor, MAX_MINOR)):
            if not _fits(value, limit):
                raise DeviceRuleError(f"Invalid device rule {source!r}: {name} must be '*' or 0..{limit}")
        if kind == "a" and (major is not None or minor is not None):
            raise DeviceRuleError(f"Invalid device rule {source!r}: type 'a' takes '*:*' only")
        force_setattr(self, "access", _canonical_access(access, source))

    @classmethod
    def parse(cls, text: str) -> "DeviceRule":
        """Parse one line of the v1 format, e.g. ``"c 195:0 rwm"`` or ``"a"``."""
        if not isinstance(text, str):
            raise DeviceRuleError(f"Invalid device rule {text!r}: expected a string")
        fields = text.split()
        if fields == ["a"]:
            return cls("a")
        if len(fields) != 3:
            raise DeviceRuleError(
                f"Invalid device rule {text!r}: expected '{{a|b|c}} <major|*>:<minor|*> <access>' or 'a'"
            )
        kind, numbers, access = fields
        major_text, sep, minor_text = numbers.partition(":")
        if not sep:
            raise DeviceRuleError(f"Invalid device rule {text!r}: expected '<major|*>:<minor|*>'")
        return cls(kind, _parse_number(major_text, text), _parse_number(minor_text, text), access)

    def __str__(self) -> str:
        return f"{self.type} {_number(self.major)}:{_number(self.minor)} {self.access}"

    @property
    def selector(self) -> tuple[str, int | None, int | None]:
        """``(type, major, minor)``: which devices the rule names."""
        return (self.type, self.major, self.minor)

    @property
    def has_wildcard(self) -> bool:
        """True when the rule names more than one device (``a`` or a ``*``)."""
        return self.type == "a" or self.major is None or self.minor is None

    def covers_device(self, type: str, major: int | None, minor: int | None) -> bool:
        """True when every device the selector ``(type, major, minor)`` names is named by this rule."""
        return (
            (self.type == "a" or self.type == type)
            and (self.major is None or self.major == major)
            and (self.minor is None or self.minor == minor)
        )

    def selector_encompasses(self, other: "DeviceRule") -> bool:
        """True when this rule's selector names every device ``other`` names."""
        return self.covers_device(other.type, other.major, other.minor)

    def encompasses(self, other: "DeviceRule") -> bool:
        """True when this rule grants everything ``other`` grants."""
        mine = _ACCESS_BITS[self.access]
        return (
            _ACCESS_BITS[other.access] & ~mine == 0
            and (self.type == "a" or self.type == other.type)
            and (self.major is None or self.major == other.major)
            and (self.minor is None or self.minor == other.minor)
        )


def _number(value: int | None) -> str:
    return "*" if value is None else str(value)


def _parse_number(text: str, source: str) -> int | None:
    if text == "*":
        return None
    if not text.isdigit() or not text.isascii():
        raise DeviceRuleError(f"Invalid device rule {source!r}: {text!r} is not a number or '*'")
    return int(text)


def as_rules(rules: Iterable[DeviceRule | str]) -> tuple[DeviceRule, ...]:
    """Rules from rules or v1 lines (``"c 195:0 rwm"``)."""
    if isinstance(rules, (str, DeviceRule)):
        raise DeviceRuleError(f"Expected a list of device rules, got {rules!r}")
    return tuple(rule if isinstance(rule, DeviceRule) else DeviceRule.parse(rule) for rule in rules)


def normalize(rules: Iterable[DeviceRule | str]) -> tuple[DeviceRule, ...]:
    """Merge rules with the same selector, drop rules another encompasses, sort."""
    merged: dict[tuple, DeviceRule] = {}
    for rule in as_rules(rules):
        key = (rule.type, rule.major, rule.minor)
        seen = merged.get(key)
        if seen is None:
            merged[key] = rule
        elif seen.access != rule.access:
            merged[key] = DeviceRule(rule.type, rule.major, rule.minor, _merge_access(seen.access, rule.access))
    combined = list(merged.values())
    # Only a rule naming several devices can encompass a rule with another selector.
    wide = [rule for rule in combined if rule.type == "a" or rule.major is None or rule.minor is None]
    if wide:
        combined = [rule for rule in combined if not any(w is not rule and w.encompasses(rule) for w in wide)]
    combined.sort(key=_order)
    return tuple(combined)


def _merge_access(a: str, b: str) -> str:
    return "".join(ch for ch in _ACCESS_ORDER if ch in a or ch in b)


def _order(rule: DeviceRule) -> tuple[str, int, int]:
    return (rule.type, -1 if rule.major is None else rule.major, -1 if rule.minor is None else rule.minor)


def query_access(type: str, major: int, minor: int, access: str) -> str:
    if type not in ("b", "c"):
        raise DeviceRuleError(f"Invalid device query type {type!r}: expected 'b' or 'c'")
    if not isinstance(major, int) or not isinstance(minor, int):
        raise DeviceRuleError(f"Invalid device query {type} {major}:{minor}: numbers must be integers")
    return _canonical_access(access, f"{type} {major}:{minor} {access}")


def is_granted(
    allow: Iterable[DeviceRule | str],
    deny: Iterable[DeviceRule | str],
    type: str,
    major: int,
    minor: int,
    access: str,
) -> bool:
    """Whether the policy ``(allow, deny)`` grants ``access`` to device ``type major:minor``.

    ``allow`` and ``deny`` are normalised first. One allow rule must cover the
    device and every requested bit; a deny rule covering the device with any
    requested bit refuses it (see module rules).
    """
    return granted(normalize(allow), normalize(deny), type, major, minor, query_access(type, major, minor, access))


def granted(
    allow: Sequence[DeviceRule], deny: Sequence[DeviceRule], type: str, major: int, minor: int, access: str
) -> bool:
    wanted = set(access)
    allowed = any(rule.covers_device(type, major, minor) and wanted <= set(rule.access) for rule in allow)
    if not allowed:
        return False
    return not any(rule.covers_device(type, major, minor) and wanted & set(rule.access) for rule in deny)


def _exact(rules: Iterable[DeviceRule | str], what: str) -> tuple[DeviceRule, ...]:
    result = as_rules(rules)
    for rule in result:
        if rule.has_wildcard:
            raise DeviceRuleError(
                f"Invalid {what} '{rule}': reconfigure takes exact devices only (no 'a', no '*')"
            )
    return result


def check_diff(
    add: Iterable[DeviceRule | str], remove: Iterable[DeviceRule | str]
) -> tuple[tuple[DeviceRule, ...], tuple[DeviceRule, ...]]:
    """Check the arguments of a reconfigure: exact rules only, and no removal
    that encompasses an addition. Returns them as rules."""
    additions = _exact(add, "addition")
    removals = _exact(remove, "removal")
    for addition in additions:
        for removal in removals:
            if removal.encompasses(addition):
                raise DeviceRuleError(
                    f"Failed to configure allow and deny devices: addition '{addition}'"
                    f" cannot be encompassed by removal '{removal}'"
                )
    return additions, removals
