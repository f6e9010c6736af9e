"""Kubernetes manifests a test reads, loaded into typed models.

Rules:
- ``load_manifests(path)`` loads every object of a YAML file into
  lightkube's typed models (``codecs.load_all_yaml``: an unknown kind or
  field type fails), as the DRA driver's client reads them. Validation
  against Kubernetes' own schemas is ``tests.support.docs.check_yaml``
  (``kubernetes-validate``, strict), which the docs tests run on every
  manifest under ``deploy/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load_manifests"]


def load_manifests(path: str | Path) -> list[Any]:
    """Every object of the file, as lightkube's typed models (see module rules)."""
    from lightkube.codecs import load_all_yaml

    with open(path) as handle:
        return load_all_yaml(handle)
