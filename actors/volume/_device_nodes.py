"""The ``/dev/nvidia*`` nodes a container with its own rootfs gets (R-IS-3).

Rules:
- ``nvidia_device_nodes(dev_dir)`` lists every character device directly in
  ``dev_dir`` whose name starts with ``nvidia`` (``nvidiactl``,
  ``nvidia-uvm``, ``nvidia-uvm-tools``, ``nvidia-modeset``, ``nvidiaN``, …),
  sorted by name, with its major/minor numbers and permission bits. Anything
  that is not a character device -- the ``nvidia-caps`` directory, a
  symlink, a regular file -- is left out. A missing ``dev_dir`` gives ``[]``.
- ``copy_device_nodes(nodes, dest_dir)`` creates ``dest_dir`` if needed and
  mknods each node there under its own name, mode 0666 (set with chmod after
  mknod, so the umask cannot narrow it). A node already there with the same
  numbers is kept (its mode is reset to 0666): copying twice is harmless. A
  character device with other numbers (a stale copy) is replaced, with a
  warning; any other file in the way is an error.
- Both are synchronous and blocking: callers run them through their
  executor, one job per container operation. Failures raise
  ``DeviceNodeError`` naming the path and the numbers.
"""

from __future__ import annotations

import logging
import os
import stat

import msgspec

from ._errors import DeviceNodeError

__all__ = ["DeviceNode", "nvidia_device_nodes", "copy_device_nodes", "CONTAINER_DEVICE_MODE"]

logger = logging.getLogger(__name__)

CONTAINER_DEVICE_MODE = 0o666


class DeviceNode(msgspec.Struct, frozen=True):
    """A character device node: where it is, its numbers, its permissions."""

    path: str
    major: int
    minor: int
    mode: int

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def nvidia_device_nodes(dev_dir: str = "/dev") -> list[DeviceNode]:
    """Every ``nvidia*`` character device directly in ``dev_dir``, by name."""
    try:
        names = sorted(os.listdir(dev_dir))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise DeviceNodeError(f"Failed to list '{dev_dir}': {exc.strerror}") from None
    nodes = []
    for name in names:
        if not name.startswith("nvidia"):
            continue
        path = os.path.join(dev_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # removed while listing
        except OSError as exc:
            raise DeviceNodeError(f"Failed to stat '{path}': {exc.strerror}") from None
        if not stat.S_ISCHR(st.st_mode):
            continue
        nodes.append(DeviceNode(
            path=path, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev),
            mode=stat.S_IMODE(st.st_mode)))
    return nodes


def copy_device_nodes(nodes: list[DeviceNode], dest_dir: str) -> list[str]:
    """Mknod each node into ``dest_dir`` with mode 0666; return the new paths."""
    try:
        os.makedirs(dest_dir, exist_ok=True)
    except OSError as exc:
        raise DeviceNodeError(f"Failed to create '{dest_dir}': {exc.strerror}") from None
    paths = []
    for node in nodes:
        target = os.path.join(dest_dir, node.name)
        device = os.makedev(node.major, node.minor)
        try:
            _make_node(target, device, node)
            os.chmod(target, CONTAINER_DEVICE_MODE)
        except OSError as exc:
            raise DeviceNodeError(
                f"Failed to mknod '{target}' ({node.major}:{node.minor}):"
                f" {exc.strerror or exc}") from None
        paths.append(target)
    return paths


def _make_node(target: str, device: int, node: DeviceNode) -> None:
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        os.mknod(target, stat.S_IFCHR | CONTAINER_DEVICE_MODE, device)
        return
    if stat.S_ISCHR(st.st_mode):
        if st.st_rdev == device:
            return
        logger.warning(
            "Replacing '%s' (%d:%d) with a copy of '%s' (%d:%d)", target,
            os.major(st.st_rdev), os.minor(st.st_rdev), node.path, node.major,
            node.minor)
        os.unlink(target)
        os.mknod(target, stat.S_IFCHR | CONTAINER_DEVICE_MODE, device)
        return
    raise DeviceNodeError(
        f"Failed to mknod '{target}' ({node.major}:{node.minor}): a file that"
        " is not a character device is in the way")
