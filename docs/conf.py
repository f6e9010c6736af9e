"""Sphinx configuration of the gpu-isolator docs site.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (after
``pip install -e '.[docs]'``). Pages are Markdown (MyST); the API reference
is generated from the docstrings of the public names (autodoc). Nothing is
fetched at build time.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a checkout builds its own code, installed or not

project = "gpu-isolator"
author = "the gpu-isolator developers"
copyright = "the gpu-isolator developers, Apache-2.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}

html_theme = "alabaster"
html_static_path = ["_static"]
html_title = "gpu-isolator"


def _with_module_rules(app, what, name, obj, options, lines):
    """A class whose docstring defers to its module ("see the module rules")
    gets those rules under it: the rules have one home, the module, and the
    reference shows them where a reader looks."""
    import inspect

    if what not in ("class", "exception") or "module rules" not in " ".join(lines):
        return
    module = inspect.getmodule(obj)
    rules = inspect.getdoc(module) if module is not None else None
    if rules:
        lines.extend(["", f"*The rules of* ``{module.__name__}``:", "", *rules.splitlines()])


def setup(app):
    app.connect("autodoc-process-docstring", _with_module_rules)
