"""Device rules for exhaustive and property tests of the rule model.

Rules:
- ``ACCESSES`` is every non-empty access string in the model's order.
- ``every_rule(majors, minors)`` is every rule of types ``a``, ``b`` and
  ``c`` over the given majors and minors (None: ``*``) and every access,
  ``a`` only as ``a *:*``; ``exact(rules)`` keeps those without a wildcard
  (what a deny or a reconfigure takes).
- ``policies(allow, deny)`` is a Hypothesis strategy of the Policies
  ``Policy.create`` makes of a drawn allow and a drawn deny list; lists it
  refuses (DeviceRuleError) are not drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hypothesis import strategies as st

from actors.devices import DeviceRule, DeviceRuleError, Policy

__all__ = ["ACCESSES", "every_rule", "exact", "policies"]

ACCESSES = ["r", "w", "m", "rw", "rm", "wm", "rwm"]


def every_rule(majors: Sequence[int | None], minors: Sequence[int | None]) -> list[DeviceRule]:
    """Every rule over ``majors`` and ``minors`` (see the module rules)."""
    return [
        DeviceRule(kind, major, minor, access)
        for kind in ("a", "b", "c")
        for major in majors
        for minor in minors
        for access in ACCESSES
        if kind != "a" or (major is None and minor is None)
    ]


def exact(rules: Iterable[DeviceRule]) -> list[DeviceRule]:
    """The rules of ``rules`` without a wildcard."""
    return [rule for rule in rules if not rule.has_wildcard]


def policies(allow: st.SearchStrategy[list[DeviceRule]],
             deny: st.SearchStrategy[list[DeviceRule]]) -> st.SearchStrategy[Policy]:
    """Policies made of a drawn ``allow`` and ``deny`` list (see the module rules)."""
    return st.tuples(allow, deny).map(_created).filter(lambda access: access is not None)


def _created(lists: tuple[list[DeviceRule], list[DeviceRule]]) -> Policy | None:
    try:
        return Policy.create(*lists)
    except DeviceRuleError:
        return None
