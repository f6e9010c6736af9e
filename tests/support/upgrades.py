"""Upgrade fixtures as tests use them: an earlier release's files on a node of the test's own (SPEC R-SH-3).

Rules:
- ``Fixture(name, release)`` is ``tests/upgrades/fixtures/<release>/<name>``
  (written by that release's own code: ``tests/upgrades/write_fixtures.py``)
  with its ``facts`` (``facts.json``: the kernel facts and the paths it was
  written under) and ``host`` (its host document: the test's node gets the
  same GPU UUIDs).
- ``install(base, rewrite)`` copies its kept files (everything but
  ``facts.json``, ``host.json`` and ``WRITTEN_BY``) under the test's
  directory ``base``, with ``facts["base"]`` rewritten to ``base`` in every
  file (and each ``old -> new`` of ``rewrite``: a cgroups root), since
  the files hold the absolute paths they were written under; a ledger's
  owner and health files are named after the rewritten owner, as the
  ledger names them (``owner_file_name``). File modes are the ledger's
  (0700 directories, 0600 files). Nothing else is changed.
- ``rebuild_cgroups(node)`` makes, under the test node's own cgroups root,
  a cgroup per container of ``facts["devices_list"]`` with exactly those
  device rules (this release's device control on the node's backend: on
  cgroups v1 the same ``devices.list``), with no process inside: the
  kernel as the earlier release left it. It runs a ``Runtime`` of its
  own: call it before the test's.
- ``corrupt(path, how)`` makes a kept file unreadable the three ways
  R-SH-3 names: ``truncated`` (its first half), ``garbage`` (bytes no
  JSON reader takes), ``unknown-version`` (the same object with
  ``"version": 99``, as a later release might write it; a CDI spec's
  ``cdiVersion`` ``99.0.0``).
- ``probe_grants(probes, node, names, gpu_nodes)`` is the kernel's verdict:
  a probe child moved into each container's cgroup opens every GPU node
  (then it is closed, so the cgroup can be cleaned up); container -> the
  minors it was granted (``probes.verdict``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from actors.devices import DeviceControl
from actors.ledger import owner_file_name
from runtime import Runtime

from .probes import GRANTED, DeviceProbe

__all__ = ["Fixture", "CORRUPTIONS", "corrupt", "probe_grants"]

FIXTURES = Path(__file__).resolve().parents[1] / "upgrades" / "fixtures"
CORRUPTIONS = ("truncated", "garbage", "unknown-version")
_NOT_KEPT = {"facts.json", "host.json", "WRITTEN_BY"}


class Fixture:
    """One fixture of an earlier release (see module rules)."""

    def __init__(self, name: str, release: str = "0.1.0") -> None:
        self.directory = FIXTURES / release / name
        self.facts: dict[str, Any] = json.loads((self.directory / "facts.json").read_text())
        self.host: dict[str, Any] = json.loads((self.directory / "host.json").read_text())

    def install(self, base: str | os.PathLike[str], rewrite: dict[str, str] | None = None) -> None:
        """Its kept files under ``base``, their paths rewritten (see module rules)."""
        base = os.fspath(base)
        changes = {self.facts["base"]: base, **(rewrite or {})}
        for top in sorted(os.listdir(self.directory)):
            if top in _NOT_KEPT:
                continue
            for directory, _subdirs, files in os.walk(self.directory / top):
                relative = os.path.relpath(directory, self.directory)
                target = os.path.join(base, relative)
                os.makedirs(target, mode=0o700, exist_ok=True)
                os.chmod(target, 0o700)
                for name in files:
                    text = (Path(directory) / name).read_text()
                    for old, new in changes.items():
                        text = text.replace(old, new)
                    if name.endswith((".owner", ".health")):
                        suffix = name[name.rindex("."):]
                        name = owner_file_name(json.loads(text)["owner"])[: -len(".owner")] + suffix
                    path = os.path.join(target, name)
                    with open(path, "w") as handle:
                        handle.write(text)
                    os.chmod(path, 0o600)

    async def rebuild_cgroups(self, node: Any) -> None:
        """The containers' cgroups with the rules the kernel had (see module rules)."""
        async with Runtime():  # a runtime of its own: call it before the test's
            devices = await DeviceControl.create(node.backend, node.hierarchy, node.cgroups_root)
            try:
                for name, lines in sorted(self.facts["devices_list"].items()):
                    await devices.configure(name, allow=lines)
            finally:
                await devices.close()


def corrupt(path: str | os.PathLike[str], how: str) -> bytes:
    """Make the file at ``path`` unreadable ``how`` (see module rules); its new bytes. A CDI spec's
    version is its ``cdiVersion`` (CDI's own format version)."""
    data = Path(path).read_bytes()
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data = b"\x00\xff\x13garbage, not JSON\n"
    elif how == "unknown-version":
        document = json.loads(data)
        if "cdiVersion" in document:
            document["cdiVersion"] = "99.0.0"
        else:
            document["version"] = 99
        data = json.dumps(document).encode()
    else:
        raise ValueError(f"unknown corruption {how!r}: expected one of {CORRUPTIONS}")
    Path(path).write_bytes(data)
    return data


def probe_grants(probes: Callable[[], DeviceProbe], node: Any, names: Iterable[str],
                 gpu_nodes: dict[int, str]) -> dict[str, list[int]]:
    """Container -> the GPU minors a process in its cgroup may open (the kernel's verdict)."""
    grants = {}
    for name in names:
        probe = probes()
        try:
            probe.move_to(node.cgroup_dir(name))
            grants[name] = sorted(minor for minor, path in gpu_nodes.items() if probe.access(path) == GRANTED)
        finally:
            probe.close()  # the cgroup empties: a cleanup removes it
    return grants
