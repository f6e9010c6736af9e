"""Resources: the agent's text form ``"cpus:1;mem:128;gpus:2"`` as a value.

Rules (Mesos ``Resources::parse``, simple text form):
- Entries are separated by ``;``; each is ``name:value`` with exactly one
  ``:`` (else "Bad value for resources, missing or extra ':' in <entry>").
  Blank entries are skipped; surrounding spaces are trimmed. An optional
  role in parentheses (``gpus(*):2``) is accepted and ignored: this port has
  no roles.
- A value is a scalar (a finite, non-negative number, kept to Mesos' three
  decimal places), a range list ``[31000-32000, 33000-33010]`` or a set
  ``{a,b}``; ranges and sets are kept verbatim and passed through. Anything
  else (``gpus:abc``, ``nan``, ``inf``, ``-1``, more than ``MAX_SCALAR``) is an
  error naming the entry.
- The same scalar named twice adds up (``cpus:1;cpus:2`` is ``cpus:3``), as
  Mesos adds resources; a range or set named twice is an error.
- ``gpus()`` of a ``gpus`` range or set (``gpus:[1-2]``) raises
  ``ResourcesError``: a garbled GPU count is never read as "no GPUs".
- An explicit zero is kept (``"gpus:0"`` has ``gpus() == 0``): Mesos tells
  "gpus:0" from "no gpus" by looking at the text, this value remembers it.
- ``str()`` gives the text form back (scalars first, in insertion order);
  ``Resources.parse(str(r)) == r``.
- ``Resources`` is a frozen msgspec Struct (``scalars``, ``others``), so it
  crosses actors and files as a plain object. ``Resources.coerce`` also takes
  the text form or a ``{name: number}`` mapping: a Struct that should accept
  ``resources: "gpus:2"`` in a file types the field ``Resources | str`` and
  coerces it (msgspec never calls a ``dec_hook`` for Struct types).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

__all__ = ["Resources", "ResourcesError"]


MAX_SCALAR = 1e15
"""The largest scalar accepted: beyond it a float cannot keep Mesos' three
decimal places (and ``1e308 * 1000`` overflows)."""


class ResourcesError(ValueError):
    """The text form of resources could not be parsed; the message names the entry."""


def _format_scalar(value: float) -> str:
    if value == int(value):
        return str(int(value))
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _parse_scalar(name: str, text: str, entry: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ResourcesError(
            f"Bad value for resource '{name}' in '{entry}': '{text}' is not a number"
            " (expected a scalar like 'gpus:2', a range list '[1-2]' or a set '{a,b}')"
        ) from None
    if not math.isfinite(value):
        raise ResourcesError(
            f"Bad value for resource '{name}' in '{entry}': '{text}' is not a finite number"
        )
    if value < 0:
        raise ResourcesError(
            f"Bad value for resource '{name}' in '{entry}': '{text}' is negative;"
            " a scalar resource must be non-negative"
        )
    if value > MAX_SCALAR:
        raise ResourcesError(
            f"Bad value for resource '{name}' in '{entry}': '{text}' is too large"
            f" (at most {MAX_SCALAR:.0e}, where three decimal places still fit)"
        )
    # Mesos keeps scalar values to three decimal places.
    return round(value * 1000) / 1000


class Resources(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Agent resources: scalars by name, ranges and sets kept as text."""

    scalars: dict[str, float] = {}
    others: dict[str, str] = {}

    # ---------------------------------------------------------------- parsing

    @classmethod
    def parse(cls, text: str) -> "Resources":
        """Parse ``"cpus:1;mem:128;gpus:2"``; raises ResourcesError naming the bad entry."""
        if not isinstance(text, str):
            raise ResourcesError(f"Bad value for resources: expected text, got {type(text).__name__}")
        scalars: dict[str, float] = {}
        others: dict[str, str] = {}
        for raw in text.split(";"):
            entry = raw.strip()
            if not entry:
                continue
            parts = entry.split(":")
            if len(parts) != 2:
                raise ResourcesError(f"Bad value for resources, missing or extra ':' in {entry}")
            name, value = parts[0].strip(), parts[1].strip()
            if "(" in name or ")" in name:
                open_paren, close_paren = name.find("("), name.find(")")
                if open_paren < 0 or close_paren < open_paren or name[close_paren + 1 :].strip():
                    raise ResourcesError(
                        f"Bad value for resources, mismatched parentheses in {entry}"
                    )
                name = name[:open_paren].strip()
            if not name:
                raise ResourcesError(f"Bad value for resources, missing resource name in '{entry}'")
            if not value:
                raise ResourcesError(f"Bad value for resource '{name}': empty value in '{entry}'")
            if value.startswith("[") or value.startswith("{"):
                closing = "]" if value[0] == "[" else "}"
                if not value.endswith(closing):
                    raise ResourcesError(
                        f"Bad value for resource '{name}' in '{entry}': unterminated '{value[0]}'"
                    )
                if name in others or name in scalars:
                    raise ResourcesError(f"Bad value for resources, '{name}' is given twice")
                others[name] = value
                continue
            if name in others:
                raise ResourcesError(f"Bad value for resources, '{name}' is given twice")
            scalars[name] = round((scalars.get(name, 0.0) + _parse_scalar(name, value, entry)) * 1000) / 1000
        return cls(scalars=scalars, others=others)

    @classmethod
    def from_scalars(cls, values: Mapping[str, float]) -> "Resources":
        """Build from ``{"gpus": 2, "cpus": 1}``, with the same checks as ``parse``."""
        scalars: dict[str, float] = {}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ResourcesError(
                    f"Bad value for resource '{name}': expected a number, got {value!r}"
                )
            scalars[str(name)] = _parse_scalar(str(name), repr(float(value)), f"{name}:{value}")
        return cls(scalars=scalars)

    @classmethod
    def coerce(cls, value: Any) -> "Resources":
        """Accept a Resources, its text form, or a ``{name: number}`` mapping."""
        if isinstance(value, Resources):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping):
            if set(value) <= {"scalars", "others"} and all(isinstance(v, Mapping) for v in value.values()):
                return msgspec.convert(value, cls)
            return cls.from_scalars(value)
        raise ResourcesError(
            f"Bad value for resources: expected text like 'cpus:1;gpus:2', got {value!r}"
        )

    # ---------------------------------------------------------------- queries

    def gpus(self) -> float | None:
        """The ``gpus`` scalar, or None when not given (``0.0`` when given as 0).
        A ``gpus`` range or set (``gpus:[1-2]``) raises: it is never read as none."""
        if "gpus" in self.others:
            raise ResourcesError(
                f"Bad value for resource 'gpus': {self.others['gpus']!r} is not a scalar"
                " (expected a whole number of GPUs like 'gpus:2')"
            )
        return self.scalars.get("gpus")

    def get(self, name: str, default: float | None = None) -> float | None:
        """The scalar ``name``, or ``default``."""
        return self.scalars.get(name, default)

    def names(self) -> list[str]:
        return [*self.scalars, *self.others]

    def __contains__(self, name: object) -> bool:
        return name in self.scalars or name in self.others

    def __bool__(self) -> bool:
        return bool(self.scalars) or bool(self.others)

    def filter(self, names: Iterable[str]) -> "Resources":
        """Only the named resources (e.g. ``filter(["gpus"])``)."""
        wanted = set(names)
        return Resources(
            scalars={k: v for k, v in self.scalars.items() if k in wanted},
            others={k: v for k, v in self.others.items() if k in wanted},
        )

    def __str__(self) -> str:
        parts = [f"{name}:{_format_scalar(value)}" for name, value in self.scalars.items()]
        parts += [f"{name}:{value}" for name, value in self.others.items()]
        return ";".join(parts)

    def __repr__(self) -> str:
        return f"Resources.parse({str(self)!r})"
