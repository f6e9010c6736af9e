"""The public surface: what each package's ``__all__`` promises exists, each
class and function has one home (one package exports it), and the names
other projects import (docs/requirements.md section 11) are there."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

TOPS = ("runtime", "actors", "isolators")

PINNED = {
    "runtime": ["Runtime", "Process", "PID", "spawn", "dispatch", "defer", "delay", "terminate", "wait", "Future",
                "Promise", "collect", "await_all", "Clock", "Executor", "Failure", "ProcessTerminated"],
    "runtime.testing": ["expect_dispatch", "drop_dispatch"],
    "actors": ["Gpu", "NvidiaGpuAllocator", "NvidiaVolume"],
    "isolators": ["Flags", "Resources", "ContainerID", "ContainerConfig", "ContainerState", "ImageManifest",
                  "NvidiaComponents", "NvidiaGpuIsolatorProcess", "IsolatorError"],
}


def public_modules() -> list[ModuleType]:
    """Every module of the three packages whose dotted name has no private
    part (``__main__`` entry points left out: importing one runs it)."""
    found = []
    for top in TOPS:
        package = importlib.import_module(top)
        names = [top] + [info.name for info in pkgutil.walk_packages(package.__path__, f"{top}.")]
        for name in names:
            if any(part.startswith("_") for part in name.split(".")):
                continue
            found.append(importlib.import_module(name))
    return found


MODULES = public_modules()


@pytest.mark.parametrize("module", [m for m in MODULES if hasattr(m, "__all__")], ids=lambda m: m.__name__)
def test_all_names_exist_once(module: ModuleType) -> None:
    names = list(module.__all__)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{module.__name__}.__all__ names what it lacks: {missing}"


def test_every_class_and_function_has_one_home() -> None:
    """Exported by a package, or re-exported by a module that does not define
    it: each counts as an import path; one a name."""
    homes: dict[int, list[str]] = {}
    for module in MODULES:
        is_package = hasattr(module, "__path__")
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            if is_package or value.__module__ != module.__name__:
                homes.setdefault(id(value), []).append(f"{module.__name__}.{name}")
    twice = sorted(paths for paths in homes.values() if len(paths) > 1)
    assert not twice, f"exported from more than one place: {twice}"


@pytest.mark.parametrize("module_name", sorted(PINNED))
def test_the_pinned_names_are_exported(module_name: str) -> None:
    module = importlib.import_module(module_name)
    missing = [name for name in PINNED[module_name] if name not in module.__all__ or not hasattr(module, name)]
    assert not missing, f"{module_name} lost pinned names: {missing}"

