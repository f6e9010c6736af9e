"""A package's private modules belong to its own tree (issue 41).

A module whose name starts with ``_`` is private to the package that holds
it (a private name inside a module is that module's business, not this
rule's): it may be imported by that package, its ancestors (an ``__init__``
re-exporting it) and its descendants (as trio's subpackages use
``trio._core``), never by a sibling or cousin, which use the package's
public surface (its ``__init__``). This walks every import statement of
``runtime/``, ``actors/`` and ``isolators/`` (relative ones resolved, those
inside functions too) and names each one that breaks the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("runtime", "actors", "isolators")


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every module or name each import statement takes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if _is_module(full) else base))  # a module, or a name of one
    return found


def _violation(importer: str, is_package: bool, target: str) -> str | None:
    parts = target.split(".")
    if parts[0] not in TOPS:
        return None
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            inside = importer == owner or importer.startswith(owner + ".")
            ancestor = is_package and owner.startswith(importer + ".")
            if not (inside or ancestor):
                return f"{'.'.join(parts[: i + 1])} is private to {owner}"
    return None


def cross_imports() -> list[str]:
    """Every import that reaches into another package's private module, as 'file:line: why'."""
    bad = []
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            importer, is_package = _module_name(path)
            package = importer if is_package else importer.rpartition(".")[0]
            for line, target in _imported(ast.parse(path.read_text(), str(path)), package):
                why = _violation(importer, is_package, target)
                if why is not None:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}: {why}")
    return list(dict.fromkeys(bad))  # one line per statement and module, however many names it takes


def test_no_module_imports_a_private_module_outside_its_own_tree() -> None:
    assert cross_imports() == []


@pytest.mark.parametrize("importer, is_package, target, allowed", [
    ("isolators.kubernetes.dra._plugin", False, "isolators.kubernetes._operator", True),  # a descendant
    ("isolators.kubernetes", True, "isolators.kubernetes.dra._command", True),  # an ancestor re-exporting
    ("isolators.kubernetes.dra._plugin", False, "isolators.kubernetes.device_plugin._operator", False),  # sibling
    ("isolators.service._commands", False, "runtime._network", False),  # a cousin of another top
    ("actors.allocator._process", False, "actors.devices._kernel", False),
    ("isolators.cli", False, "isolators.kubernetes.dra._command", False),  # not an ancestor: a module beside it
    ("isolators.kubernetes.pod_repair._repair", False, "isolators._types", True),
    ("isolators.kubernetes.dra._plugin", False, "isolators.kubernetes.pod_repair._access", False),  # a cousin
])
def test_the_rule_tells_family_from_siblings_and_cousins(importer: str, is_package: bool, target: str,
                                                         allowed: bool) -> None:
    assert (_violation(importer, is_package, target) is None) is allowed
