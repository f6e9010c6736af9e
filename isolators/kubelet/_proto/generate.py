"""Compile ``deviceplugin.proto`` and ``podresources.proto`` into the committed Python modules.

Rules:
- ``generate(output_root)`` runs ``grpcio-tools``' protoc (the version
  pinned in ``pyproject.toml``'s test extra) on each of ``PROTOS``
  (``isolators/kubelet/_proto/deviceplugin.proto``, the device plugin
  API v1beta1, and ``podresources.proto``, the pod resources API v1) with
  the repository as its include root, so the modules import each other by
  their package path (``isolators.kubelet._proto.deviceplugin_pb2``); it
  writes ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py``
  of each under ``output_root`` at that path and returns their paths
  (``GENERATED``, in order). A protoc error raises ``RuntimeError`` with
  its output. ``compile_proto(proto, output_root)`` is that protoc run
  for one .proto; ``outputs(protos)``, ``compile_protos(protos, root)``
  and ``main(protos)`` are the same steps for any list of them (the DRA
  driver's ``_proto/generate.py`` uses them for its own).
- ``python -m isolators.kubelet._proto.generate`` regenerates them in place
  (after editing the .proto or changing the pinned grpcio-tools); the test
  ``tests/kubelet/test_kubelet_api.py`` fails while they are stale.
- Only this developer step needs ``grpcio-tools``; the plugin needs the
  ``grpcio`` and ``protobuf`` runtimes pinned in the dependencies.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

__all__ = ["PROTO", "PROTOS", "GENERATED", "SOURCE_ROOT", "compile_proto", "compile_protos", "outputs", "main",
           "generate"]

SOURCE_ROOT = Path(__file__).resolve().parents[3]
"""The directory holding the ``isolators`` package (the include root)."""
PROTO = "isolators/kubelet/_proto/deviceplugin.proto"
PROTOS = (PROTO, "isolators/kubelet/_proto/podresources.proto")


def outputs(protos: tuple[str, ...]) -> tuple[str, ...]:
    """What protoc writes for ``protos``, in order (paths under the include root)."""
    return tuple(proto.removesuffix(".proto") + suffix for proto in protos
                 for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


GENERATED = outputs(PROTOS)


def compile_proto(proto: str, output_root: str | os.PathLike[str]) -> None:
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


def compile_protos(protos: tuple[str, ...], output_root: str | os.PathLike[str]) -> list[Path]:
    """Compile each of ``protos`` under ``output_root``; the paths written."""
    for proto in protos:
        compile_proto(proto, output_root)
    return [Path(output_root) / name for name in outputs(protos)]


def main(protos: tuple[str, ...]) -> int:
    """Regenerate ``protos``' modules in place (the developer's command)."""
    for path in compile_protos(protos, SOURCE_ROOT):
        print(f"wrote {path}")
    return 0


def generate(output_root: str | os.PathLike[str]) -> list[Path]:
    """Compile the .protos under ``output_root`` (see the module rules)."""
    return compile_protos(PROTOS, output_root)


if __name__ == "__main__":  # pragma: no cover - a developer's command
    sys.exit(main(PROTOS))
