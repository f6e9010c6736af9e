"""Test support for the NVML port (as ``trio.testing`` is for trio).

Rules:
- ``nvml_library_missing()`` puts this process in the state of a host
  without the NVIDIA driver, whatever the machine really has: inside the
  ``with`` block, pynvml's own loader fails to open ``libnvidia-ml.so.1``
  (its ``CDLL`` refuses, its cached library is set aside), so ``nvmlInit``
  raises pynvml's ``NVML_ERROR_LIBRARY_NOT_FOUND`` through the real
  bindings code. On exit pynvml is restored exactly. Tests use it so that
  "no NVML" never depends on the accident of the machine they run on.
- The simulated node itself (``SimulatedNvml``) is the other double: it
  lives in the package proper, since the demo and the CLI use it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["nvml_library_missing"]


@contextlib.contextmanager
def nvml_library_missing() -> Iterator[None]:
    """pynvml cannot load its library inside this block (see module rules)."""
    import pynvml

    def refuse(name: str, *args: object, **kwargs: object) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    with pynvml.libLoadLock:
        saved = pynvml.nvmlLib, pynvml.CDLL
        pynvml.nvmlLib, pynvml.CDLL = None, refuse
    try:
        yield
    finally:
        with pynvml.libLoadLock:
            pynvml.nvmlLib, pynvml.CDLL = saved
