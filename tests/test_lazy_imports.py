"""Packages import their names when first used (``runtime._lazy``): a device
worker process imports its backend modules and nothing of the agent, and a
package answers for its exports, its submodules and nothing else."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the device worker child runs (``_worker_child.BOOT``), reporting what it imported.
CHILD = (
    "import sys; sys.path[:0] = sys.argv[1:]; import actors.devices._worker_child;"
    " print(' '.join(sorted(sys.modules)))"
)


def test_the_device_worker_child_imports_its_backends_and_nothing_of_the_agent() -> None:
    done = subprocess.run([sys.executable, "-I", "-S", "-c", CHILD, str(ROOT), *(p for p in sys.path if p)],
                          capture_output=True, text=True, timeout=60, check=True)
    imported = set(done.stdout.split())
    assert {"actors.devices._backend", "actors.devices._worker_child", "runtime._errors"} <= imported
    agent = sorted(name for name in imported if name.split(".")[0] in ("asyncio", "anyio", "trio", "isolators")
                   or name in ("runtime._runtime", "runtime._process", "actors.allocator", "actors.nvml",
                               "actors.devices._control"))
    assert agent == []


@pytest.mark.parametrize("package", ["runtime", "actors", "actors.devices", "isolators", "isolators.service",
                                     "isolators.kubernetes", "isolators.kubernetes.device_plugin",
                                     "isolators.kubernetes.pod_repair", "isolators.kubernetes.dra"])
def test_a_package_answers_for_its_exports_its_submodules_and_nothing_else(package: str) -> None:
    module = importlib.import_module(package)
    name = module.__all__[0]
    assert getattr(module, name) is vars(module)[name]  # imported once, then kept
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
        getattr(module, "no_such_name")


def test_a_submodule_is_found_as_an_attribute() -> None:
    import runtime

    assert runtime.testing is importlib.import_module("runtime.testing")


@pytest.mark.parametrize("package", ["runtime", "actors", "actors.devices", "isolators", "isolators.service"])
def test_a_star_import_for_type_checkers_names_exactly_the_lazy_exports(package: str) -> None:
    """Where a package's ``TYPE_CHECKING`` block imports a module's names with
    ``*`` (its ``__all__``), that is exactly what ``_EXPORTS`` lists for the
    module: type checkers and the running program see the same names."""
    import ast

    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    starred = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and [alias.name for alias in node.names] == ["*"] and node.level == 1]
    for name in starred:
        source = importlib.import_module(f".{name}", package)
        assert sorted(source.__all__) == sorted(module._EXPORTS[f".{name}"]), name
