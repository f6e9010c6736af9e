"""Lazy exports: a package's names imported when first used.

Rules:
- A package's ``__init__`` lists what it exports as ``{module: names}``
  (a module relative to the package, ``"._pid"``, or absolute,
  ``"actors.flags"``) and calls ``lazy_exports(__name__, globals(),
  exports)``, which returns its ``__all__``, ``__getattr__`` and
  ``__dir__`` (PEP 562). Importing the package then imports none of those
  modules: a device worker process that needs one backend module, or a
  command that needs little, pays for nothing else.
- An exported name is imported from its module on first access and kept in
  the package's globals (later accesses are plain lookups).
- Any other name is looked up as a submodule of the package (as after an
  eager import of it); none of that name is an ``AttributeError`` saying so.
  An import error inside an existing module is raised as it is.
- It imports nothing but ``importlib`` and knows nothing of any package,
  so every package (``runtime``, ``actors``, ``isolators``) can use it
  without breaking the import direction.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` whose globals are
    ``namespace`` (see the module rules)."""
    names = [name for exported in exports.values() for name in exported]
    module_of = {name: module for module, exported in exports.items() for name in exported}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:  # a submodule, as after an eager import of the package
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return names, __getattr__, __dir__
