"""CDI spec documents: a spec to JSON or YAML bytes, and back.

Rules:
- ``encode_spec(spec, "json"|"yaml")`` validates first (``validate_spec``):
  a spec the engines would refuse is never written. JSON is indented by 2
  and ends with a newline; YAML is block style in the spec's field order.
  Both carry exactly the same document.
- ``decode_spec(data, "json"|"yaml", source)`` reads a document back into a
  ``CdiSpec`` and validates it; anything else (bad syntax, unknown fields,
  broken rules) is one ``CdiSpecError`` naming ``source``.
- ``spec_format(path)`` is ``json`` for ``*.json`` and ``yaml`` for
  ``*.yaml``/``*.yml``; engines read no other names.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import yaml

from ._model import CdiSpec
from ._rules import CdiSpecError, validate_spec

__all__ = ["SpecFormat", "encode_spec", "decode_spec", "spec_format"]

SpecFormat = Literal["json", "yaml"]
FORMATS = ("json", "yaml")


def spec_format(path: str) -> SpecFormat:
    """The format a spec file of this name is read in (engines read .json and .yaml)."""
    lowered = path.lower()
    if lowered.endswith(".json"):
        return "json"
    if lowered.endswith((".yaml", ".yml")):
        return "yaml"
    raise CdiSpecError(f"CDI spec file {path!r} must end in .json or .yaml (engines read no other names)")


def encode_spec(spec: CdiSpec, format: SpecFormat = "json") -> bytes:
    """The spec as a JSON or YAML document (validated first)."""
    validate_spec(spec)
    if format == "json":
        return msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n"
    if format == "yaml":
        text = yaml.safe_dump(msgspec.to_builtins(spec), sort_keys=False, default_flow_style=False)
        return text.encode("utf-8")
    raise CdiSpecError(f"Unknown CDI spec format {format!r}: expected json or yaml")


def decode_spec(data: bytes, format: SpecFormat = "json", source: str = "<bytes>") -> CdiSpec:
    """A validated spec from a JSON or YAML document."""
    try:
        if format == "json":
            spec = msgspec.json.decode(data, type=CdiSpec)
        elif format == "yaml":
            spec = msgspec.convert(yaml.safe_load(data), CdiSpec)
        else:
            raise CdiSpecError(f"Unknown CDI spec format {format!r}: expected json or yaml")
    except (msgspec.DecodeError, msgspec.ValidationError, yaml.YAMLError, UnicodeDecodeError) as error:
        raise CdiSpecError(f"CDI spec {source} is not a valid {format.upper()} CDI document: {error}") from None
    try:
        return validate_spec(spec)
    except CdiSpecError as error:
        raise CdiSpecError(f"CDI spec {source}: {error}") from None
