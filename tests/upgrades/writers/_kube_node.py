"""What both Kubernetes writers share: one simulated node of the earlier release, and what it leaves behind.

Rules:
- Runs with the earlier release's tree first on ``sys.path`` (``write_fixtures``):
  ``tests.support`` here is that release's (its fake kubelet, PodResources,
  DRA kubelet and API server), and the plugins it starts are that
  release's ``python -m isolators`` from that tree.
- ``kept(kube, out)`` copies what the node kept on disk into ``out``:
  ``host.toml`` (the host file the node simulates: the units' UUIDs),
  ``work/`` (the ``--work_dir``, when one was made: the DRA
  checkpoint), ``cdi/`` (every CDI
  spec the plugins wrote), ``ledger/`` (the node ledger: leases, owner
  files, the mutex), and the truth outside the files as the fakes held
  it: ``api-claims.json`` (every ResourceClaim document of the fake API
  server) and ``pod-resources.json`` (every PodResources assignment:
  namespace, pod, container, resource, ids).
- Called after every plugin stopped (SIGTERM, as a rolling update stops
  them), so what is copied is what the next release finds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def kept(kube: Any, out: Path) -> None:
    shutil.copyfile(kube.node.host_file, out / "host.toml")
    if Path(kube.node.work_dir).is_dir():  # the device plugin writes nothing there
        shutil.copytree(kube.node.work_dir, out / "work", symlinks=True)
    shutil.copytree(kube.cdi, out / "cdi", symlinks=True)
    shutil.copytree(kube.ledger, out / "ledger", symlinks=True)
    claims = [claim for _, claim in sorted(kube.api.claims.items())]
    (out / "api-claims.json").write_text(json.dumps(claims, indent=1, sort_keys=True) + "\n")
    assignments = [{"namespace": a.namespace, "pod": a.pod, "container": a.container, "resource": a.resource,
                    "ids": list(a.ids)} for a in kube.pod_resources.assignments]
    (out / "pod-resources.json").write_text(json.dumps(assignments, indent=1, sort_keys=True) + "\n")
