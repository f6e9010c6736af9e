"""Choosing the NVML implementation for a node.

Rules (R-NV-1):
- ``open_nvml(host_file)``: a host file → ``SimulatedNvml`` of that file;
  ``None`` → ``BindingsNvml`` (the real driver) and nothing else. The port
  is returned initialised; no usable driver raises ``NvmlUnavailable``
  naming NVML's own error and saying how to use a host file instead. The
  library never invents GPUs: there is no silent fallback to a simulated
  node. Blocking: call it from an executor when on the loop.
- ``embedded_simulated_node()``: the embedded 8-GPU example node
  (``EMBEDDED_HOST_FILE``), initialised. Only callers that chose it on
  purpose use it (the demo, ``gpu-isolator inspect --simulated``), and they
  say so on screen.
- ``nvml_available()``: whether the real NVML initialises here (Mesos'
  ``nvml::isAvailable``); it leaves NVML shut down again.
"""

from __future__ import annotations

import os

from ._bindings import BindingsNvml
from ._default_node import embedded_host_spec
from ._errors import NvmlError
from ._port import Nvml
from ._simulated import SimulatedNvml

__all__ = ["open_nvml", "nvml_available", "embedded_simulated_node"]


def open_nvml(host_file: str | os.PathLike[str] | None) -> Nvml:
    """The initialised port for ``host_file`` (None: the real NVML)."""
    nvml: Nvml = BindingsNvml() if host_file is None else SimulatedNvml.from_file(host_file)
    nvml.init()
    return nvml


def embedded_simulated_node() -> SimulatedNvml:
    """The embedded 8-GPU simulated node, initialised (only when chosen explicitly)."""
    nvml = SimulatedNvml(embedded_host_spec())
    nvml.init()
    return nvml


def nvml_available() -> bool:
    """Whether the real NVML initialises on this machine."""
    try:
        nvml = open_nvml(None)
    except NvmlError:
        return False
    nvml.close()
    return True
