"""Merging an OCI fragment (``ContainerLaunchInfo.to_oci()``) into a ``config.json``.

Rules:
- ``merge_oci(config, fragment)`` returns a new config; neither input is
  changed. ``process.env`` merges by variable name (the fragment's value
  wins, the config's order is kept, new names go last); ``mounts`` by
  destination and ``linux.devices`` by path (the fragment's entry replaces
  the config's); ``linux.resources.devices`` entries are appended after the
  config's own, so they follow its deny-all default (the last matching
  rule wins in runc), exact repeats skipped.
- Anything else in the config is kept as it is.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["merge_oci"]


def _replace_by(existing: list[dict[str, Any]], added: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    keys = {entry.get(key) for entry in added}
    return [entry for entry in existing if entry.get(key) not in keys] + [copy.deepcopy(e) for e in added]


def merge_oci(config: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``fragment`` merged in (see the module rules)."""
    merged = copy.deepcopy(config)
    env_entries = fragment.get("process", {}).get("env", [])
    if env_entries:
        process = merged.setdefault("process", {})
        values: dict[str, str] = {}
        for entry in list(process.get("env", [])) + list(env_entries):  # a dict keeps each name's first place
            name, _, value = entry.partition("=")
            values[name] = value
        process["env"] = [f"{name}={value}" for name, value in values.items()]
    if fragment.get("mounts"):
        merged["mounts"] = _replace_by(merged.get("mounts", []), fragment["mounts"], "destination")
    linux_fragment = fragment.get("linux", {})
    if linux_fragment.get("devices") or linux_fragment.get("resources", {}).get("devices"):
        linux = merged.setdefault("linux", {})
        if linux_fragment.get("devices"):
            linux["devices"] = _replace_by(linux.get("devices", []), linux_fragment["devices"], "path")
        rules = linux_fragment.get("resources", {}).get("devices", [])
        if rules:
            resources = linux.setdefault("resources", {})
            current = resources.setdefault("devices", [])
            for rule in rules:
                if rule not in current:
                    current.append(copy.deepcopy(rule))
    return merged
