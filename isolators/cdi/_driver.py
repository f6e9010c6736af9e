"""The driver volume in CDI: its mount, its binaries at their usual paths, the loader-cache hook.

Rules (R-DR-2):
- No CDI spec this project writes sets ``PATH`` or ``LD_LIBRARY_PATH``: a
  container keeps its own (an image's, or one it was started with). The
  Mesos launch info's environment (R-VO-3) and ``to_oci()`` are another
  rendering and keep the volume's ``PATH`` / ``LD_LIBRARY_PATH``.
- ``DriverInjection.edits(volume)`` is what a container given the driver
  volume gets from a spec: the volume's read-only mount (at
  ``/usr/local/nvidia``), each of its binaries (``<volume>/bin/<name>``)
  bound read-only, ``nosuid``, ``nodev`` at ``/usr/bin/<name>`` (where
  NVIDIA's specs put them), and one ``createContainer`` hook:
  ``<program> update-ldcache --folder /usr/local/nvidia/lib64 --folder
  /usr/local/nvidia/lib`` (``_hook``), which puts the volume's libraries in
  the container's own loader cache (``ldconfig -p`` lists them).
- The hook's program is ``Flags.cdi_hook`` when set (a command the host
  can run, e.g. the ``gpu-isolator-cdi-hook`` script or a copy of the hook
  file with Python 3 on the host), else this installation's Python running
  the hook file in isolated mode (``<python> -I <.../_hook.py>``): right
  wherever this process runs on the host itself.
- ``volume_binaries(host_path)`` lists the volume's ``bin/`` (blocking: an
  executor's job); names are checked as file names.
"""

from __future__ import annotations

import os
import posixpath
import sys
from collections.abc import Sequence

import msgspec

from .._types import ContainerBindMount
from ._hook import HOOK_FILE, hook_args
from ._model import CdiContainerEdits, CdiHook, CdiMount

__all__ = ["BINARY_DIR", "LIBRARY_FOLDERS", "DriverInjection", "hook_program", "volume_binaries"]

BINARY_DIR = "/usr/bin"
"""Where a container finds the driver's binaries (NVIDIA's specs mount them there)."""
LIBRARY_FOLDERS = ("lib64", "lib")
"""The volume's library folders, as ``--folder`` of the hook (64-bit first)."""
_BINARY_OPTIONS = ["ro", "nosuid", "nodev", "bind"]


def hook_program(configured: str | None = None) -> tuple[str, ...]:
    """The hook's program and its first arguments (see module rules)."""
    if configured is not None:
        return (configured,)
    return (sys.executable, "-I", HOOK_FILE)


def volume_binaries(host_path: str) -> tuple[str, ...]:
    """The names in ``<host_path>/bin`` (sorted; none when it is missing). Blocking."""
    try:
        names = os.listdir(os.path.join(host_path, "bin"))
    except FileNotFoundError:
        return ()
    return tuple(sorted(name for name in names if name not in (".", "..") and "/" not in name
                        and not name.startswith(".")))


class DriverInjection(msgspec.Struct, frozen=True, kw_only=True):
    """How a container gets the driver volume from a CDI spec (see module rules)."""

    program: tuple[str, ...]
    """The hook's program and its first arguments (``hook_program``)."""
    binaries: tuple[str, ...] = ()
    """The names in the volume's ``bin/``."""

    def hook(self, volume: ContainerBindMount) -> CdiHook:
        folders = [posixpath.join(volume.container_path, folder) for folder in LIBRARY_FOLDERS]
        return CdiHook(hook_name="createContainer", path=self.program[0],
                       args=[*self.program, *hook_args(folders)])

    def mounts(self, volume: ContainerBindMount) -> list[CdiMount]:
        """The volume's mount, then each binary at ``/usr/bin/<name>``."""
        mounts = [CdiMount(host_path=volume.host_path, container_path=volume.container_path,
                           options=volume.oci_options())]
        mounts += [CdiMount(host_path=os.path.join(volume.host_path, "bin", name),
                            container_path=posixpath.join(BINARY_DIR, name), options=list(_BINARY_OPTIONS))
                   for name in self.binaries]
        return mounts

    def edits(self, volumes: Sequence[ContainerBindMount]) -> CdiContainerEdits:
        """The mounts and hook of ``volumes`` (none or the one driver volume)."""
        return CdiContainerEdits(mounts=[m for volume in volumes for m in self.mounts(volume)],
                                 hooks=[self.hook(volume) for volume in volumes])
