"""Every requirement id (``R-XX-N``) and "SPEC section N" the repository
cites is explained in docs/requirements.md, so a reader can resolve it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "requirements.md"
ID = re.compile(r"\bR-[A-Z]{2}-\d+\b")
SECTION = re.compile(r"SPEC section (\d+)")


def cited() -> dict[str, set[str]]:
    """Every id and section cited in a file git knows (or would add), by where."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    found: dict[str, set[str]] = {}
    for name in listed:
        path = REPO / name
        if path == DOC or path.suffix not in {".py", ".md", ".yaml", ".yml", ".json", ".toml", ".c"}:
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for ref in ID.findall(text) + [f"section {n}" for n in SECTION.findall(text)]:
            found.setdefault(ref, set()).add(name)
    return found


def test_every_cited_requirement_is_explained() -> None:
    text = DOC.read_text()
    defined = set(re.findall(r"\*\*(R-[A-Z]{2}-\d+)", text))
    sections = {f"section {n}" for n in re.findall(r"^## (\d+)\. ", text, re.M)}
    missing = {ref: sorted(where) for ref, where in cited().items() if ref not in defined | sections}
    assert not missing, f"cited but not in docs/requirements.md: {missing}"
    assert len(defined) >= 60 and {f"section {n}" for n in range(20)} <= sections
