"""``/dev/char/<major>:<minor>`` links for the GPU nodes: what keeps systemd from dropping them (R-PR-2).

Rules:
- systemd records a container scope's device rules by path; for a
  character device it resolves ``/dev/char/<major>:<minor>``, and on
  ``daemon-reload`` drops a rule whose link does not exist. The NVIDIA
  driver's nodes (``/dev/nvidia*``, ``/dev/nvidia-caps/*``) get no such
  links from udev, so pods lose them.
- ``ensure_char_links(dev_dir, nodes)`` makes, for each node (its host
  path under ``dev_dir``, its type and numbers), the link
  ``<dev_dir>/char/<major>:<minor>`` (``block/`` for a block device)
  pointing at the node by a path relative to the link's directory, as
  udev writes them; ``<dev_dir>/char`` is made when missing. A link that
  exists and resolves to a node of the same numbers is kept; anything
  else there (a link to another file, a file, a dangling link) is left
  as it is and reported, never replaced. A node that is not there (or
  whose numbers are not the ones given) gets no link and is reported.
- It answers ``CharLinks``: made, kept, and ``refused`` (path, why) —
  the caller logs each refusal once. Idempotent: a second call makes
  nothing. Blocking: run it on an executor.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

import msgspec

from ..._types import ContainerDevice

__all__ = ["CharLinks", "ensure_char_links", "char_link_path"]


class CharLinks(msgspec.Struct, kw_only=True):
    """What ``ensure_char_links`` did."""

    made: list[str] = []
    kept: list[str] = []
    refused: list[tuple[str, str]] = []
    """(link path, why it was left alone)."""


def char_link_path(dev_dir: str, node: ContainerDevice) -> str:
    kind = "block" if node.type == "b" else "char"
    return os.path.join(dev_dir, kind, f"{node.major}:{node.minor}")


def _is_node(path: str, node: ContainerDevice) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    kind = stat.S_ISBLK if node.type == "b" else stat.S_ISCHR
    return kind(info.st_mode) and (os.major(info.st_rdev), os.minor(info.st_rdev)) == (node.major, node.minor)


def ensure_char_links(dev_dir: str, nodes: Iterable[ContainerDevice]) -> CharLinks:
    """Make the missing links (see module rules)."""
    result = CharLinks()
    for node in {(n.host_path, n.type, n.major, n.minor): n for n in nodes}.values():
        link = char_link_path(dev_dir, node)
        if not _is_node(node.host_path, node):
            why = (f"{node.host_path} is not the {node.type} {node.major}:{node.minor} node"
                   if os.path.lexists(node.host_path) else f"there is no {node.host_path} to link to")
            result.refused.append((link, why))
            continue
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            target = None
        except OSError:  # there, but not a link
            result.refused.append((link, "it exists and is not a link"))
            continue
        if target is not None:
            if _is_node(link, node):
                result.kept.append(link)
            else:
                result.refused.append((link, f"it points at {target!r}, not at {node.host_path}"))
            continue
        try:
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(node.host_path, os.path.dirname(link)), link)
        except FileExistsError:  # made meanwhile by someone else (udev): judged on the next call
            result.refused.append((link, "it appeared while the link was being made"))
            continue
        except OSError as error:  # a read-only or foreign /dev: said, and the plugin goes on
            result.refused.append((link, f"it cannot be made ({error.strerror}; the plugin needs --dev_dir"
                                         " writable, as the host's /dev mounted read-write)"))
            continue
        result.made.append(link)
    return result
