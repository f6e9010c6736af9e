"""Compile the DRA driver's .proto files into the committed Python modules.

Rules:
- ``generate(output_root)`` runs ``grpcio-tools``' protoc (the version
  pinned in ``pyproject.toml``'s test extra) on every file of ``PROTOS``
  with the repository as its include root (``compile_protos`` of the
  kubelet device plugin's ``_proto/generate.py``), so the modules import by their
  package path (``isolators.dra._proto.dra_v1_pb2``); it writes each
  proto's ``_pb2.py``, ``_pb2.pyi`` and ``_pb2_grpc.py`` under
  ``output_root`` at that path and returns the paths (``GENERATED``). A
  protoc error raises ``RuntimeError`` with its output.
- The wire packages are the kubelet's: ``pluginregistration``,
  ``k8s.io.kubelet.pkg.apis.dra.v1``, ``k8s.io.kubelet.pkg.apis.dra.v1beta1``
  and ``v1`` / ``v1alpha1`` (DRAResourceHealth; kubelets 1.34-1.36 ask
  v1alpha1, whose messages are v1's).
- ``python -m isolators.dra._proto.generate`` regenerates them in place;
  ``tests/dra/test_dra_api.py`` fails while they are stale.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from isolators.kubelet._proto.generate import SOURCE_ROOT, compile_protos, main, outputs

__all__ = ["PROTOS", "GENERATED", "SOURCE_ROOT", "generate"]

_DIR = "isolators/dra/_proto"
PROTOS = tuple(f"{_DIR}/{name}.proto" for name in ("pluginregistration", "dra_v1", "dra_v1beta1", "dra_health_v1",
                                                   "dra_health_v1alpha1"))
GENERATED = outputs(PROTOS)


def generate(output_root: str | os.PathLike[str]) -> list[Path]:
    """Compile every .proto under ``output_root`` (see the module rules)."""
    return compile_protos(PROTOS, output_root)


if __name__ == "__main__":  # pragma: no cover - a developer's command
    sys.exit(main(PROTOS))
