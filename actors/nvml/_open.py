"""Choosing the NVML implementation for a node.

Rules:
- ``open_nvml(host_file)``: a host file → ``SimulatedNvml`` of that file;
  ``None`` → ``BindingsNvml`` (the real driver). The port is returned
  initialised; a missing driver raises ``NvmlUnavailable`` saying to pass a
  host file. Blocking: call it from an executor when on the loop.
- ``open_nvml_or_default(host_file)``: the same, except that with no host file
  and no usable driver it falls back to the embedded simulated node (the
  demo's and the CLI's default; SPEC R-NV-1).
- ``nvml_available()``: whether the real NVML initialises here (Mesos'
  ``nvml::isAvailable``); it leaves NVML shut down again.
"""

from __future__ import annotations

import logging
import os

from ._bindings import BindingsNvml
from ._default_node import embedded_host_spec
from ._errors import NvmlError, NvmlUnavailable
from ._port import Nvml
from ._simulated import SimulatedNvml

__all__ = ["open_nvml", "open_nvml_or_default", "nvml_available", "default_simulated_node"]

logger = logging.getLogger(__name__)


def open_nvml(host_file: str | os.PathLike[str] | None) -> Nvml:
    """The initialised port for ``host_file`` (None: the real NVML)."""
    nvml: Nvml = BindingsNvml() if host_file is None else SimulatedNvml.from_file(host_file)
    nvml.init()
    return nvml


def default_simulated_node() -> SimulatedNvml:
    """The embedded 8-GPU simulated node, initialised."""
    nvml = SimulatedNvml(embedded_host_spec())
    nvml.init()
    return nvml


def open_nvml_or_default(host_file: str | os.PathLike[str] | None) -> Nvml:
    """Like ``open_nvml``, but no host file and no driver → the embedded node."""
    if host_file is not None:
        return open_nvml(host_file)
    try:
        return open_nvml(None)
    except NvmlUnavailable as exc:
        logger.info("No NVIDIA driver (%s); using the embedded simulated 8-GPU node", exc.text)
        return default_simulated_node()


def nvml_available() -> bool:
    """Whether the real NVML initialises on this machine."""
    try:
        nvml = open_nvml(None)
    except NvmlError:
        return False
    nvml.close()
    return True
