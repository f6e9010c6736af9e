"""What a service request asks for: whole GPUs and MIG devices by profile.

Rules (SPEC R-SV-2 with R-MG-3):
- A request asks for ``gpus`` (a count) and, on a node served with
  ``--nvidia_mig_strategy=mixed``, MIG devices by profile (``mig``:
  ``{"1g.18gb": 2}``). ``demand_of(gpus, mig)`` is the isolator's view of
  it, per resource: ``{"gpus": 1, "mig-1g.18gb": 2}`` (``gpus`` always
  there, MIG resources only with a count above zero), in that order.
  A profile may be given with or without its ``mig-`` prefix; one that is
  not a MIG profile name is a ``ValueError`` naming it and the form.
- ``resources_text(demand)`` is the ``Resources`` text the isolator is
  asked for (``gpus:1;mig-1g.18gb:2``); ``describe(demand)`` is how
  messages name it (``2 GPU(s)``, ``1 GPU(s) and 2 MIG 1g.18gb``).
- ``parse_mig_option(text)`` reads exec's ``--mig PROFILE[:N]`` (N
  defaults to 1; a whole number above zero).
- Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from actors.mig import MIG_RESOURCE_PREFIX, parse_profile, profile_of_resource, resource_of_profile

__all__ = ["GPUS", "demand_of", "describe", "merge_mig_options", "mig_counts", "parse_mig_option", "resources_text"]

GPUS = "gpus"


def _profile(text: str) -> str:
    profile = profile_of_resource(text) or text
    try:
        parse_profile(profile)
    except ValueError as error:
        raise ValueError(f"Invalid MIG profile {text!r}: {error}") from None
    return profile


def demand_of(gpus: int, mig: Mapping[str, int] | None = None) -> dict[str, int]:
    """Units asked for per resource (see module rules)."""
    demand = {GPUS: gpus}
    for text, count in sorted((mig or {}).items()):
        if count:
            resource = resource_of_profile(_profile(text))
            demand[resource] = demand.get(resource, 0) + count
    return demand


def resources_text(demand: Mapping[str, int]) -> str:
    return ";".join(f"{name}:{count}" for name, count in demand.items())


def describe(demand: Mapping[str, int]) -> str:
    parts = [f"{demand.get(GPUS, 0)} GPU(s)"] if demand.get(GPUS, 0) or len(demand) == 1 else []
    parts += [f"{count} MIG {profile_of_resource(name)}" for name, count in demand.items()
              if name.startswith(MIG_RESOURCE_PREFIX) and count]
    return " and ".join(parts)


def mig_counts(demand: Mapping[str, int]) -> dict[str, int]:
    """The MIG part of a demand, by profile (``{"1g.18gb": 2}``)."""
    return {profile_of_resource(name) or name: count for name, count in demand.items() if name != GPUS and count}


def parse_mig_option(text: str) -> tuple[str, int]:
    """``1g.18gb`` or ``1g.18gb:2`` -> (profile, count); ValueError otherwise."""
    profile, sep, count = text.partition(":")
    if sep and not (count.isdigit() and int(count) > 0):
        raise ValueError(f"--mig {text!r}: the count after ':' must be a whole number above 0")
    return _profile(profile.strip()), int(count) if sep else 1


def merge_mig_options(texts: Iterable[str]) -> dict[str, int]:
    """Every ``--mig`` option, counts of one profile added up."""
    merged: dict[str, int] = {}
    for text in texts:
        profile, count = parse_mig_option(text)
        merged[profile] = merged.get(profile, 0) + count
    return merged
