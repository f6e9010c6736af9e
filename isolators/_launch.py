"""Launch-info building: what a container with its own root filesystem gets.

Rules (Mesos ``NvidiaGpuIsolatorProcess::_prepare``, R-IS-3):
- No rootfs -> no launch info. A rootfs without a docker manifest ->
  "The 'ContainerConfig' for docker is missing a manifest".
- When the volume should be injected (``NvidiaVolume.should_inject``): a
  read-only recursive bind of the volume at ``<rootfs>/usr/local/nvidia``
  and its environment, into ``task_environment`` for a command task, else
  ``environment``.
- Every ``/dev/nvidia*`` node (not ``/dev/nvidia-caps``) is copied into the
  container's devices directory ``<runtime_dir>/containers/<id>/devices``
  (Mesos' layout: ``containers/<parent>/containers/<child>``), mode 0666,
  and bind-mounted at the same path under the rootfs.
- MIG (R-MG-2): on a node handing out MIG devices, their capability nodes
  (``<dev_dir>/nvidia-caps/nvidia-cap<minor>``, those that exist) are
  copied into ``<devices dir>/nvidia-caps`` and bound at
  ``<rootfs>/dev/nvidia-caps/…``, and their capability proc files (those
  that exist) are bound read-only at the same path under ``<rootfs>/proc``.
  The cgroup decides which of them open.
- All filesystem work of one prepare is ONE executor job
  (``prepare_filesystem``); nothing blocks the event loop.
- The device nodes a prepare copies are its own: a failed copy removes the
  nodes and directories it made (nothing else); ``remove_devices_dir``
  removes a container's devices directory and the container directories
  left empty above it (cleanup).
- No path is built from a container id before it is validated.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any

from actors import NvidiaVolume
from actors.mig import CAPS_DEV_SUBDIR
from actors.volume import DeviceNode, copy_device_nodes, nvidia_device_nodes
from runtime import Executor

from ._errors import IsolatorError
from ._types import (
    MS_BIND,
    MS_RDONLY,
    MS_REC,
    ContainerConfig,
    ContainerID,
    ContainerLaunchInfo,
    ContainerMountInfo,
)


async def build_launch_info(executor: Executor, volume: NvidiaVolume, runtime_dir: str, dev_dir: str,
                            container_id: ContainerID, config: ContainerConfig, *, mig_files: Any = None,
                            ) -> tuple[ContainerLaunchInfo | None, bool]:
    """The launch info of ``config`` and whether device nodes were copied."""
    if config.rootfs is None:
        return None, False
    manifest = config.docker_manifest
    if manifest is None:
        raise IsolatorError("The 'ContainerConfig' for docker is missing a manifest")
    inject = volume.should_inject(manifest)
    env = volume.env(manifest) if inject else None
    devices_dir = devices_directory(runtime_dir, container_id)
    mounts, copied = await executor.run(
        prepare_filesystem, config.rootfs, inject, volume.host_path, volume.container_path, dev_dir, devices_dir,
        mig_files,
    )
    launch = ContainerLaunchInfo(mounts=mounts)
    if env is not None:
        if config.has_task_info:
            launch.task_environment = env
        else:
            launch.environment = env
    return launch, copied


def runtime_path(container_id: ContainerID) -> str:
    """The container's path below ``<runtime_dir>/containers`` (Mesos' layout)."""
    return container_id.path("/containers/")


def devices_directory(runtime_dir: str, container_id: ContainerID) -> str:
    """Where a prepare copies the container's device nodes."""
    return os.path.join(runtime_dir, "containers", runtime_path(container_id), "devices")


def prepare_filesystem(rootfs: str, inject: bool, host_path: str, container_path: str,
                       dev_dir: str, devices_dir: str, mig_files: Any = None) -> tuple[list[ContainerMountInfo], bool]:
    """The blocking part of a launch info: one executor job per prepare.

    Returns the mounts and whether device nodes were copied. A failed copy
    removes the nodes and directories it made, and nothing else."""
    mounts: list[ContainerMountInfo] = []
    if inject:
        target = os.path.join(rootfs, container_path.lstrip("/"))
        try:
            os.makedirs(target, exist_ok=True)
        except OSError as e:
            raise IsolatorError(f"Failed to create the container directory at '{target}': {e.strerror}") from None
        mounts.append(ContainerMountInfo(host_path, target, MS_RDONLY | MS_BIND | MS_REC))
    nodes = nvidia_device_nodes(dev_dir)
    caps = _present_cap_nodes(mig_files.cap_nodes) if mig_files is not None else []
    caps_dir = os.path.join(devices_dir, CAPS_DEV_SUBDIR)
    groups = [(found, directory) for found, directory in ((nodes, devices_dir), (caps, caps_dir)) if found]
    copied = _copy_groups(groups)
    for (found, directory), paths in zip(groups, copied):
        inside = os.path.join(rootfs, "dev") if directory == devices_dir else os.path.join(rootfs, "dev", CAPS_DEV_SUBDIR)
        for node, path in zip(found, paths):
            mounts.append(ContainerMountInfo(path, os.path.join(inside, node.name), MS_BIND))
    for host, inside in (mig_files.proc_files if mig_files is not None else ()):
        if os.path.isfile(host):
            mounts.append(ContainerMountInfo(host, os.path.join(rootfs, inside.lstrip("/")), MS_RDONLY | MS_BIND))
    return mounts, bool(nodes) or bool(caps)


def _present_cap_nodes(paths: tuple[str, ...]) -> list:
    """The capability nodes of ``paths`` that exist as character devices."""
    found = []
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(st.st_mode):
            found.append(DeviceNode(path=path, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev),
                                    mode=stat.S_IMODE(st.st_mode)))
    return found


def _copy_groups(groups: list[tuple[list[DeviceNode], str]]) -> list[list[str]]:
    """``copy_device_nodes`` of each ``(nodes, directory)``; a failure removes
    the nodes and directories this call made, and nothing else."""
    made_dirs: list[str] = []
    for _nodes, directory in groups:
        while not os.path.isdir(directory) and directory not in made_dirs:
            made_dirs.append(directory)
            directory = os.path.dirname(directory)
    existed = {os.path.join(d, n.name) for nodes, d in groups for n in nodes if os.path.lexists(os.path.join(d, n.name))}
    copied: list[list[str]] = []
    for nodes, directory in groups:
        try:
            copied.append(copy_device_nodes(nodes, directory))
        except Exception as e:
            for made_nodes, made_in in groups:
                for node in made_nodes:
                    path = os.path.join(made_in, node.name)
                    if path not in existed:
                        _remove_quietly(os.unlink, path)
            for made in sorted(made_dirs, key=len, reverse=True):  # deepest first; one someone filled stays
                _remove_quietly(os.rmdir, made)
            raise IsolatorError(f"Failed to copy NVIDIA device nodes into '{directory}': {e}") from None
    return copied


def remove_devices_dir(runtime_dir: str, relative: str) -> None:
    """Remove ``<runtime_dir>/containers/<relative>/devices`` and the container
    directories left empty above it (blocking; one executor job)."""
    containers = os.path.join(runtime_dir, "containers")
    directory = os.path.join(containers, relative)
    shutil.rmtree(os.path.join(directory, "devices"), ignore_errors=True)
    while directory != containers and directory.startswith(containers + os.sep):
        try:
            os.rmdir(directory)
        except OSError:
            return  # not empty (other files, nested containers): it stays
        directory = os.path.dirname(directory)


def _remove_quietly(remove: Any, path: str) -> None:
    try:
        remove(path)
    except OSError:
        pass
