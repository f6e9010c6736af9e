"""The Kubernetes front doors' upgrade fixtures, put where this release's front doors look (SPEC R-SH-3).

Rules:
- A fixture (``fixture_dir(release, name)``, written by
  ``tests/upgrades/writers/<name>.py`` with that release's own code) holds
  what one simulated node kept: ``host.toml``, ``work/``, ``cdi/``,
  ``ledger/``, and the truth outside the files, ``api-claims.json`` and
  ``pod-resources.json`` (see ``writers/_kube_node.py``).
- ``kube_node_from(fixture, base, sockets)`` is a ``KubeNode`` of the
  fixture's host file whose work dir, CDI spec dir and node ledger hold
  copies of the fixture's (the ledger made 0700 and its files 0600, as
  the front doors left them: git keeps no modes), whose fake API server
  holds its ResourceClaims and whose PodResources lists its assignments
  -- the node as the earlier release left it, its plugins not started.
  The copies are the test's own: the committed fixture never changes.
  ``running_from(fixture, directory)`` is that node under ``directory``
  with its sockets in a short directory of their own, closed (every
  plugin stopped) on the way out.
- ``corrupt(path, how)`` damages a kept file as a node does: ``truncated``
  (the first half of it, a write cut short), ``garbage`` (bytes that are
  no JSON), ``unknown-version`` (a later release's version 99, same
  claims); the bytes written.
- ``wait_leases(kube, expected, what)`` waits (bounded) until the node
  ledger holds exactly ``expected`` (``tests.support.ledger.leases``'s
  form), failing with what it holds: returns happen within a pass, tests
  wait for the state.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from isolators.kubernetes.pod_repair import AssignedDevices

from tests.support.kube_node import KubeNode
from tests.support.kubelet import plugin_directory
from tests.support.ledger import leases
from tests.upgrades.write_fixtures import fixture_dir

__all__ = ["CORRUPTIONS", "corrupt", "fixture_dir", "kube_node_from", "running_from", "wait_leases"]

CORRUPTIONS = ("truncated", "garbage", "unknown-version")


def _copy_private(source: Path, target: Path) -> None:
    shutil.copytree(source, target, dirs_exist_ok=True)
    os.chmod(target, 0o700)
    for directory, folders, files in os.walk(target):
        for folder in folders:
            os.chmod(os.path.join(directory, folder), 0o700)
        for file in files:
            os.chmod(os.path.join(directory, file), 0o600)


def kube_node_from(fixture: Path, base: Path, sockets: Path, **options: Any) -> KubeNode:
    """A node holding what ``fixture`` kept (see module rules)."""
    base.mkdir(parents=True, exist_ok=True)
    host = base / "host.toml"
    shutil.copyfile(fixture / "host.toml", host)
    kube = KubeNode(base, sockets, host, str(base / "ledger"), **options)
    if (fixture / "work").is_dir():
        _copy_private(fixture / "work", Path(kube.node.work_dir))
    shutil.copytree(fixture / "cdi", kube.cdi, dirs_exist_ok=True)
    _copy_private(fixture / "ledger", base / "ledger")
    for claim in json.loads((fixture / "api-claims.json").read_text()):
        kube.api.claims[(claim["metadata"]["namespace"], claim["metadata"]["name"])] = claim
    kube.pod_resources.assignments = [AssignedDevices(namespace=a["namespace"], pod=a["pod"], container=a["container"],
                                                      resource=a["resource"], ids=tuple(a["ids"]))
                                      for a in json.loads((fixture / "pod-resources.json").read_text())]
    return kube


@contextlib.contextmanager
def running_from(fixture: Path, directory: Path, **options: Any) -> Iterator[KubeNode]:
    """``kube_node_from`` under ``directory``, closed afterwards (see module rules)."""
    with plugin_directory() as sockets:
        kube = kube_node_from(fixture, directory / "node", sockets, **options)
        try:
            yield kube
        finally:
            kube.close()


def corrupt(path: Path, how: str) -> bytes:
    """Damage ``path`` (see module rules); the bytes it now holds."""
    data = path.read_bytes()
    if how == "truncated":
        damaged = data[:len(data) // 2]
    elif how == "garbage":
        damaged = b"\x00\x17\xff\xfe not a checkpoint \x80"
    elif how == "unknown-version":
        document = json.loads(data)
        document["version"] = 99
        damaged = json.dumps(document).encode()
    else:
        raise ValueError(f"unknown corruption {how!r}: one of {', '.join(CORRUPTIONS)}")
    path.write_bytes(damaged)
    return damaged


def wait_leases(kube: KubeNode, expected: dict, what: str, bound: float = 10.0) -> None:
    deadline = time.monotonic() + bound
    while (held := leases(kube.ledger)) != expected:
        assert time.monotonic() < deadline, f"{what}: not within {bound}s; the ledger holds {held}"
        time.sleep(0.02)
