"""The DRA driver's names: defaults, sockets, the kubelet's constants.

Rules (SPEC section 21):
- ``DEFAULT_DRIVER_NAME`` is ``gpu.isolator.dev``; a driver name is a DNS
  subdomain (lower-case alphanumerics, ``-`` and ``.``, each label starting
  and ending alphanumeric, at most 63 characters as Kubernetes caps driver
  names); ``check_driver_name`` refuses anything else with one line.
- The kubelet's plugin watcher reads ``DEFAULT_REGISTRY_DIR``
  (``/var/lib/kubelet/plugins_registry``); the driver serves its
  registration on ``<registry>/<driver>-reg.sock`` and its DRA service on
  ``<plugins_dir>/<driver>/dra.sock`` (``DEFAULT_PLUGINS_DIR``
  ``/var/lib/kubelet/plugins``).
- ``PLUGIN_TYPE`` is ``DRAPlugin``; ``SUPPORTED_VERSIONS`` exactly
  ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin`` (the kubelet refuses a bare
  ``v1beta1``).
- ``gpu_device_name(minor)`` is ``gpu-<minor>``, ``mig_device_name`` is
  ``mig-<minor>-<gi>-<ci>`` (DNS labels).
- No gRPC and no Kubernetes client here: the CLI reads these while parsing.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "DEFAULT_DRIVER_NAME", "DEFAULT_REGISTRY_DIR", "DEFAULT_PLUGINS_DIR", "PLUGIN_TYPE", "SUPPORTED_VERSIONS",
    "MAX_DRIVER_NAME", "check_driver_name", "registration_socket", "dra_socket", "gpu_device_name",
    "mig_device_name",
]

DEFAULT_DRIVER_NAME = "gpu.isolator.dev"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
MAX_DRIVER_NAME = 63

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def check_driver_name(name: str) -> str:
    """``name`` when it is a valid driver name, else ``ValueError`` saying why."""
    if not isinstance(name, str) or not _SUBDOMAIN.fullmatch(name) or len(name) > MAX_DRIVER_NAME:
        raise ValueError(f"Invalid driver name {name!r}: expected a DNS subdomain of at most {MAX_DRIVER_NAME}"
                         f" characters (lower-case letters, digits, '-' and '.'), e.g. {DEFAULT_DRIVER_NAME}")
    return name


def registration_socket(registry_dir: str, driver: str) -> str:
    """``<registry>/<driver>-reg.sock``."""
    return os.path.join(os.path.abspath(registry_dir), f"{driver}-reg.sock")


def dra_socket(plugins_dir: str, driver: str) -> str:
    """``<plugins_dir>/<driver>/dra.sock``."""
    return os.path.join(os.path.abspath(plugins_dir), driver, "dra.sock")


def gpu_device_name(minor: int) -> str:
    return f"gpu-{minor}"


def mig_device_name(minor: int, gi: int, ci: int) -> str:
    return f"mig-{minor}-{gi}-{ci}"
