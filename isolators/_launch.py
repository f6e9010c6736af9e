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
from typing import Any

from actors import NvidiaVolume
from actors.volume import copy_device_nodes, nvidia_device_nodes
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
    check_container_id,
)


async def build_launch_info(executor: Executor, volume: NvidiaVolume, runtime_dir: str, dev_dir: str,
                            container_id: ContainerID, config: ContainerConfig
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
    check_container_id(container_id)
    parts = []
    cid: ContainerID | None = container_id
    while cid is not None:
        parts.append(cid.value)
        cid = cid.parent
    return "/containers/".join(reversed(parts))


def devices_directory(runtime_dir: str, container_id: ContainerID) -> str:
    """Where a prepare copies the container's device nodes."""
    return os.path.join(runtime_dir, "containers", runtime_path(container_id), "devices")


def prepare_filesystem(rootfs: str, inject: bool, host_path: str, container_path: str,
                       dev_dir: str, devices_dir: str) -> tuple[list[ContainerMountInfo], bool]:
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
    if nodes:
        made_dirs = []
        directory = devices_dir
        while not os.path.isdir(directory):
            made_dirs.append(directory)
            directory = os.path.dirname(directory)
        existed = {n.name for n in nodes if os.path.lexists(os.path.join(devices_dir, n.name))}
        try:
            copied = copy_device_nodes(nodes, devices_dir)
        except Exception as e:
            for node in nodes:
                if node.name not in existed:
                    _remove_quietly(os.unlink, os.path.join(devices_dir, node.name))
            for made in made_dirs:  # deepest first; a directory someone else filled stays
                _remove_quietly(os.rmdir, made)
            raise IsolatorError(f"Failed to copy NVIDIA device nodes into '{devices_dir}': {e}") from None
        for node, path in zip(nodes, copied):
            mounts.append(ContainerMountInfo(path, os.path.join(rootfs, "dev", node.name), MS_BIND))
    return mounts, bool(nodes)


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
