"""Compile the kubelet's .proto files into the committed Python modules: the one regeneration command.

Rules:
- ``PROTOS``: every API the Kubernetes front doors speak, each written from
  the kubelet's facts: ``deviceplugin.proto`` (deviceplugin v1beta1),
  ``podresources.proto`` (PodResources v1), ``pluginregistration.proto``,
  ``dra_v1.proto`` / ``dra_v1beta1.proto`` (``k8s.io.kubelet.pkg.apis.dra.v1``
  / ``.v1beta1``) and ``dra_health_v1.proto`` / ``dra_health_v1alpha1.proto``
  (DRAResourceHealth ``v1`` / ``v1alpha1``; kubelets 1.34-1.36 ask
  v1alpha1, whose messages are v1's).
- ``generate(output_root)`` runs ``grpcio-tools``' protoc (the version
  pinned in ``pyproject.toml``'s test extra) on each with the repository
  as its include root, so the modules import each other by their package
  path (``isolators.kubernetes._proto.deviceplugin_pb2``); it writes
  ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` of each
  under ``output_root`` at that path and returns their paths
  (``GENERATED``, in order). A protoc error raises ``RuntimeError`` with
  its output.
- ``python -m isolators.kubernetes._proto.generate`` regenerates them in
  place (after editing a .proto or changing the pinned grpcio-tools); the
  test ``tests/kubernetes/test_kubernetes_api.py`` fails while they are stale.
- Only this developer step needs ``grpcio-tools``; the front doors need
  the ``grpcio`` and ``protobuf`` runtimes pinned in the dependencies.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

__all__ = ["PROTOS", "GENERATED", "SOURCE_ROOT", "generate"]

SOURCE_ROOT = Path(__file__).resolve().parents[3]
"""The directory holding the ``isolators`` package (the include root)."""
_DIR = "isolators/kubernetes/_proto"
PROTOS = tuple(f"{_DIR}/{name}.proto" for name in ("deviceplugin", "podresources", "pluginregistration", "dra_v1",
                                                   "dra_v1beta1", "dra_health_v1", "dra_health_v1alpha1"))


GENERATED = tuple(proto.removesuffix(".proto") + suffix for proto in PROTOS
                  for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def _compile(proto: str, output_root: str | os.PathLike[str]) -> None:
    """Run protoc on ``proto`` (a path under ``SOURCE_ROOT``) into ``output_root`` (see the module rules)."""
    from grpc_tools import protoc  # the developer's tool, not the plugin's dependency

    output_root = Path(output_root)
    output_root.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{SOURCE_ROOT}", f"--python_out={output_root}",
            f"--pyi_out={output_root}", f"--grpc_python_out={output_root}", str(SOURCE_ROOT / proto)]
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto} ({code}): {captured.getvalue().strip()}")


def generate(output_root: str | os.PathLike[str]) -> list[Path]:
    """Compile every .proto under ``output_root`` (see the module rules)."""
    for proto in PROTOS:
        _compile(proto, output_root)
    return [Path(output_root) / name for name in GENERATED]


def main() -> int:
    """Regenerate the modules in place (the developer's command)."""
    for path in generate(SOURCE_ROOT):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover - a developer's command
    sys.exit(main())
