"""Every example the README and the docs site show holds today (issue 44):
Python blocks run on the simulated node, shell commands parse with the
parser they name, Kubernetes objects validate against Kubernetes' schemas,
message scripts run, excerpts match what the program prints. The rules of
each kind are in ``tests/support/docs.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs import DOCS, REPO, check_page, check_yaml, pages, unchecked_fences

PAGES = pages()


def page_id(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.host_facts  # examples use the flags a user would: the host's loader cache and /proc
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_example_on_the_page_holds(page: Path) -> None:
    check_page(page)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_on_the_page_is_of_a_kind_the_suite_checks(page: Path) -> None:
    assert unchecked_fences(page) == [], f"{page_id(page)}: blocks nothing checks"


@pytest.mark.parametrize("manifest", sorted(p for p in (REPO / "deploy").rglob("*.yaml")
                                             if "helm" not in p.relative_to(REPO / "deploy").parts), ids=page_id)
def test_every_shipped_manifest_is_valid_kubernetes(manifest: Path) -> None:
    """What deploy/ ships validates against Kubernetes' own schemas, and the
    gpu-isolator commands of its pods parse, shown in the docs or not. (The
    Helm chart's files are templates and values: what it renders is
    validated by tests/deploy/test_helm_chart.py.)"""
    check_yaml(manifest.read_text(), page_id(manifest), None)


QUICK_START = [
    "python -m pip install -e . && gpu-isolator demo",
    "python -m pip install -e '.[test]' && python -m pytest",
]


def test_the_readme_is_short_and_keeps_the_two_quick_start_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    block = re.search(r"## Quick start\n+```sh\n(.*?)```", readme, re.S)
    assert block is not None, "README.md has no '## Quick start' with a sh block"
    assert block.group(1).splitlines() == QUICK_START


def test_every_page_of_the_site_is_reachable_from_its_index() -> None:
    listed = set()
    for page in DOCS.rglob("*.md"):
        for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
            for entry in block.splitlines():
                if entry.strip() and not entry.startswith(":"):
                    listed.add((page.parent / entry.strip()).with_suffix(".md").resolve())
    site = {p.resolve() for p in DOCS.rglob("*.md") if "_build" not in p.parts} - {(DOCS / "index.md").resolve()}
    assert sorted(map(str, site - listed)) == []


def test_the_architecture_picture_is_an_svg_with_a_title() -> None:
    from xml.etree import ElementTree

    root = ElementTree.parse(DOCS / "_static" / "architecture.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.find("{http://www.w3.org/2000/svg}title") is not None  # what a screen reader says


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    """The site builds as the README says (``python -m sphinx -W -b html docs
    docs/_build/html``): a broken reference, a missing docstring target or
    a bad directive fails here, not only in CI."""
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                             "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "html" / "index.html").is_file()
