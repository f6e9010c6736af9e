"""Kubernetes manifests a test reads: loaded into typed models, validated against Kubernetes' own schemas.

Rules:
- ``load_manifests(path)`` loads every object of a YAML file into
  lightkube's typed models (``codecs.load_all_yaml``: an unknown kind or
  field type fails), as the DRA driver's client reads them.
- ``validate_manifests(path)`` validates every object of the file against
  Kubernetes' OpenAPI schemas at ``KUBERNETES_VERSION`` with
  ``kubernetes-validate`` (bundled schemas: offline; strict: a field the
  schema does not have is an error), and answers the objects as dicts; an
  invalid object is an ``AssertionError`` naming the file, the object, the
  field's path and the schema's complaint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["KUBERNETES_VERSION", "load_manifests", "validate_manifests"]

KUBERNETES_VERSION = "1.34.0"
"""resource.k8s.io/v1 is GA from 1.34 (the DRA driver's floor); the device plugin's objects are older."""


def load_manifests(path: str | Path) -> list[Any]:
    """Every object of the file, as lightkube's typed models (see module rules)."""
    from lightkube.codecs import load_all_yaml

    with open(path) as handle:
        return load_all_yaml(handle)


def validate_manifests(path: str | Path) -> list[dict[str, Any]]:
    """Every object of the file, validated against Kubernetes' schemas (see module rules)."""
    import kubernetes_validate

    documents = [document for document in yaml.safe_load_all(Path(path).read_text()) if document is not None]
    for document in documents:
        name = f"{document.get('kind')} {document.get('metadata', {}).get('name', '')}".strip()
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{path}: {name} is not valid Kubernetes {KUBERNETES_VERSION}: {error.message} at"
                                 f" {'/'.join(map(str, error.path))}") from None
    return documents
