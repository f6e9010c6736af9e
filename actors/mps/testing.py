"""Test support for MPS: the stand-in control daemon the tests build.

Rules:
- ``build_mps_control(directory)`` compiles ``tests/native/fake_mps_control.c``
  with gcc into ``<directory>/nvidia-cuda-mps-control`` and returns its path
  (None without gcc: the caller skips with ``NO_GCC``); ``static=True``
  links it statically, for a container without a C library. The stand-in speaks
  the real tool's protocol (``-d`` starts the daemon in the background; run
  without ``-d`` it sends the commands on its stdin to the daemon of
  ``$CUDA_MPS_PIPE_DIRECTORY`` and prints the answers); its rules are at the
  top of the C file.
- ``read_record(path)``: the lines the stand-in appended to
  ``$FAKE_MPS_RECORD``, as ``(CUDA_VISIBLE_DEVICES, event, detail)``.
- For tests; nothing here runs on a real node.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["NO_GCC", "STAND_IN_SOURCE", "build_mps_control", "read_record"]

STAND_IN_SOURCE = Path(__file__).resolve().parents[2] / "tests" / "native" / "fake_mps_control.c"
NO_GCC = "gcc is not installed: cannot build the stand-in MPS control daemon (tests/native/fake_mps_control.c)"


def build_mps_control(directory: str | Path, static: bool = False) -> Path | None:
    """The stand-in ``nvidia-cuda-mps-control`` built in ``directory`` (None without gcc)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    out = Path(directory) / "nvidia-cuda-mps-control"
    subprocess.run([gcc, "-O1", "-Wall", "-Wextra", "-Werror", *(["-static"] if static else []), "-o", str(out),
                    str(STAND_IN_SOURCE)], check=True, capture_output=True, text=True)
    return out


def read_record(path: str | Path) -> list[tuple[str, str, str]]:
    """The stand-in's record (see module rules); [] before anything was recorded."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [tuple(line.split("\t", 2)) for line in text.splitlines()]  # type: ignore[misc]
