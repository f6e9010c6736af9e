"""What the docs show, checked: every example of README.md and docs/ (SPEC
section 10's README rule, issue 44).

Rules:
- A page's blocks are found by Sybil's MyST lexers, the ones Sphinx's
  myst-parser reads: fenced blocks (```` ```python ````), ``{code-block}``
  directives and ``invisible-code-block`` in HTML comments (hidden from
  the rendered page and from GitHub, run like any other block).
- ``python``: run, in page order, in one namespace per page. A block with
  a top-level ``await`` runs on the page's event loop (asyncio, in a
  thread of its own: an anyio blocking portal); others run in the test's
  thread, where ``asyncio.run`` and ``trio.run`` work. A hidden block may
  call ``enter(async_context_manager)`` to keep a ``Runtime`` or a
  ``SimulatedNode`` open until the page ends (it is exited then, in
  reverse order). The page's directory for files is ``scratch`` (a fresh
  temp dir); the current directory is the repository's, so
  ``examples/...`` paths work as in a checkout.
- ``sh``: every command is split as the shell would (continuations,
  ``&&``, ``;``, ``|``); ``gpu-isolator CMD ...`` is parsed by the CLI's
  own parser (``isolators.cli._parser``), the isolator flags of the
  commands that take them (``--name=value``) by ``service_flags``, as the
  command does; ``python -m MODULE ARGS`` by the parser that module's
  ``main`` builds (stopped right after parsing); ``pip install -e
  '.[EXTRA]'`` must name extras pyproject.toml has. Other programs
  (kubectl, curl, podman) are not this project's to check.
- ``yaml``: a Kubernetes object (``apiVersion`` and ``kind``) is validated
  against Kubernetes' own schemas (``kubernetes-validate``, strict, at
  ``KUBERNETES_VERSION``), and each ``gpu-isolator`` command of its pods
  is checked as ``sh`` is; anything else is a message script, loaded and
  run on the in-memory backend, every expectation holding. A
  ``{literalinclude}`` of a ``.yaml`` file is checked the same way.
- Anything else (``json``, ``text``, ``toml``, ``ini``, ``dockerfile``) is
  an excerpt of what the program prints or reads: it must be a
  ``{code-block}`` with a ``:name:``, and a later block of the page must
  read ``shown["NAME"]`` to check it against the program (a hidden block,
  usually: ``check_log_lines``, a Struct, the renderer). An excerpt no
  block reads fails the page.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import logging
import os
import re
import runpy
import shlex
import sys
import tempfile
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from sybil import Document, Example, Region
from sybil.evaluators.python import pad
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer
from sybil.parsers.myst import CodeBlockParser
from sybil.parsers.myst.lexers import DirectiveLexer

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
KUBERNETES_VERSION = "1.34.0"  # resource.k8s.io/v1 is GA from 1.34 (the DRA driver's floor)

RUN = {"python", "sh", "yaml"}
"""Languages whose blocks are run or parsed by this module."""
EXCERPTS = {"json", "text", "toml", "ini", "dockerfile"}
"""Languages of excerpts: named, and read by a later block that checks them."""
DIRECTIVES = {"toctree", "literalinclude", "image", "figure", "note", "warning", "seealso", "eval-rst",
              "autoclass", "autofunction", "autoexception", "automodule", "contents"}


def pages() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [REPO / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]


# -- the blocks of a page --------------------------------------------------------------------------------------------
class Fence:
    """One fenced block of a page: its info string (``python``,
    ``{code-block} json``) and the line it starts on."""

    def __init__(self, info: str, line: int) -> None:
        self.info, self.line = info, line

    @property
    def directive(self) -> str | None:
        match = re.match(r"\{([\w-]+)\}", self.info)
        return match.group(1) if match else None

    @property
    def language(self) -> str:
        if self.directive == "code-block":
            return self.info.split("}", 1)[1].strip()
        return "" if self.directive else self.info.strip()


def fences(path: Path) -> list[Fence]:
    """Every fenced block of ``path`` (nested fences included once)."""
    document = Document(path.read_text(), str(path))
    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE))
    return [Fence(region.lexemes["info"], document.text.count("\n", 0, region.start) + 1)
            for region in lexer(document)]


# -- python ------------------------------------------------------------------------------------------------------------
class Page:
    """What the blocks of one page share: the namespace, the event loop
    of its top-level awaits, what they opened, the excerpts shown."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stack = contextlib.ExitStack()
        self._portal: Any = None
        self.scratch = tempfile.mkdtemp(prefix="gpu-isolator-docs-")
        self.stack.callback(_remove_tree, self.scratch)
        self.shown = Shown()

    @property
    def portal(self) -> Any:
        if self._portal is None:
            from anyio.from_thread import start_blocking_portal

            self._portal = self.stack.enter_context(start_blocking_portal("asyncio"))
        return self._portal

    def enter(self, manager: Any) -> Any:
        """Enter an async context manager on the page's loop until the page ends."""
        return self.stack.enter_context(self.portal.wrap_async_context_manager(manager))

    def namespace(self) -> dict[str, Any]:
        return {"__name__": "__docs__", "enter": self.enter, "scratch": self.scratch, "shown": self.shown,
                "check_log_lines": check_log_lines,
                "same_shape": same_shape, "elided": elided, "check_shell": check_shell}

    def close(self) -> None:
        self.stack.close()


class Shown(dict):
    """The page's excerpts by name; remembers which ones a block read."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.read.add(name)
        return super().__getitem__(name)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def run_python(example: Example) -> None:
    __tracebackhide__ = True
    page: Page = example.namespace["__page__"]
    source = pad(example.parsed, example.line + example.parsed.line_offset)
    code = compile(source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    if code.co_flags & inspect.CO_COROUTINE:
        async def body() -> None:
            await eval(code, example.namespace)

        page.portal.call(body)
    else:
        exec(code, example.namespace)


# -- sh --------------------------------------------------------------------------------------------------------------
class ExampleError(AssertionError):
    """An example does not hold; the message names it and why."""


def shell_commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a shell text, as argv lists (variables left as written)."""
    text = re.sub(r"\\\n", " ", script)
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                if command:
                    yield command
                command = []
            else:
                command.append(token)
        if command:
            yield command


def check_shell(script: str, where: str) -> int:
    """Check every command of ``script`` this project owns; how many were checked."""
    checked = 0
    for argv in shell_commands(script):
        while argv and (argv[0] in ("sudo", "exec", "env") or re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0])):
            argv = argv[1:]
        if not argv:
            continue
        try:
            if argv[0] == "gpu-isolator":
                check_cli(argv[1:])
            elif argv[0] in ("python", "python3") and argv[1:2] == ["-m"]:
                check_module_command(argv[2], argv[3:])
            else:
                continue
        except ExampleError as error:
            raise ExampleError(f"{where}: `{shlex.join(argv)}`: {error}") from None
        checked += 1
    return checked


def check_cli(argv: list[str]) -> None:
    """``gpu-isolator ARGV`` parses as the command line would parse it."""
    from isolators.cli import UsageError, _parser
    from isolators.service import service_flags

    parser = _parser()
    try:
        with contextlib.redirect_stdout(None):
            args, extra = parser.parse_known_args(argv)
    except UsageError as error:
        raise ExampleError(str(error)) from None
    except SystemExit as exit:  # --help
        if exit.code:
            raise ExampleError(f"exits {exit.code}") from None
        return
    if extra and not getattr(args, "accepts_flags", False):
        raise ExampleError(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        try:
            service_flags(None, extra)
        except ValueError as error:
            raise ExampleError(str(error)) from None


class _Parsed(Exception):
    pass


def check_module_command(module: str, argv: list[str]) -> None:
    """``python -m MODULE ARGV``: the module exists, and ARGV parses with the
    parser its ``__main__`` builds (run until it has parsed, no further)."""
    if module == "pip":
        return check_pip(argv)
    if module == "pytest":
        return
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        spec = None
    if spec is None:
        raise ExampleError(f"there is no module {module}")
    if not argv:
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        try:
            with contextlib.redirect_stderr(None):
                original(self, args, namespace)
        except SystemExit as exit:
            raise ExampleError(f"{self.prog} refuses {shlex.join(sys.argv[1:])}") from None
        raise _Parsed

    saved = sys.argv
    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    sys.argv = [module, *argv]
    try:
        with warnings.catch_warnings():  # a module other tests imported runs again as __main__: only to parse
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = saved
    raise ExampleError(f"{module} ran without parsing its arguments: no options to check them against")


def check_pip(argv: list[str]) -> None:
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for arg in argv:
        match = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if match:
            unknown = set(match.group(1).split(",")) - extras
            if unknown:
                raise ExampleError(f"pyproject.toml has no extra {', '.join(sorted(unknown))}")


# -- yaml ------------------------------------------------------------------------------------------------------------
def check_yaml(text: str, where: str, page: Page | None, base_dir: Path = REPO) -> None:
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    if documents and all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in documents):
        for document in documents:
            check_kubernetes(document, where)
        return
    if page is None:
        raise ExampleError(f"{where}: neither Kubernetes objects nor a message script")
    check_script(text, where, base_dir)


def check_kubernetes(document: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    name = f"{document['kind']} {document.get('metadata', {}).get('name', '')}".strip()
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        raise ExampleError(f"{where}: {name} is not valid Kubernetes {KUBERNETES_VERSION}: {error.message}"
                           f" at {'/'.join(map(str, error.path))}") from None
    except kubernetes_validate.SchemaNotFoundError as error:
        raise ExampleError(f"{where}: {name}: Kubernetes {KUBERNETES_VERSION} has no such kind ({error})") from None
    template = (document.get("spec") or {}).get("template", {}).get("spec") if document["kind"] != "Pod" else None
    pod = template or (document.get("spec") if document["kind"] == "Pod" else None)
    for container in (pod or {}).get("containers", []):
        check_shell(container_script(container), f"{where}: {name}, container {container.get('name')}")


def container_script(container: dict[str, Any]) -> str:
    """What a container runs, as shell text: ``sh -c SCRIPT $0 ARGS...`` with
    ``"$@"`` replaced by ARGS; any other command joined as one line."""
    command, args = list(container.get("command") or []), list(container.get("args") or [])
    argv = command + args
    if len(argv) >= 3 and argv[0].endswith("sh") and argv[1] == "-c":
        script, positional = argv[2], argv[4:]
        return script.replace('"$@"', shlex.join(positional))
    return shlex.join(argv)


def check_script(text: str, where: str, base_dir: Path) -> None:
    from isolators import ScriptError, load_script, run_script
    from runtime import Runtime

    try:
        script = load_script(text, where, base_dir=str(base_dir))
    except ScriptError as error:
        raise ExampleError(str(error)) from None

    async def run() -> Any:
        async with Runtime():
            return await run_script(script, "memory")

    report = asyncio.run(run())
    if not report.passed:
        raise ExampleError(f"{where}: {report.summary()}")


# -- excerpts ------------------------------------------------------------------------------------------------------
LOG_LINE = re.compile(r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<logger>[\w.]+): (?P<message>.*)")


def check_log_lines(text: str) -> int:
    """Each line ``LEVEL logger: message`` (the CLI's log format) is one the
    logger's module writes: at that level, matching one of its format
    strings (``%s`` and friends match anything; ``…`` in the excerpt stands
    for an elided part). How many lines were checked."""
    checked = 0
    for line in filter(None, (line.strip() for line in text.splitlines())):
        match = LOG_LINE.fullmatch(line)
        if match is None:
            raise ExampleError(f"not a log line of the form 'LEVEL logger: message': {line!r}")
        formats = logged_formats(match["logger"]).get(match["level"].lower(), [])
        if not any(_log_pattern(f).fullmatch(match["message"]) for f in formats):
            raise ExampleError(f"{match['logger']} writes no {match['level']} line like {match['message']!r}"
                               f" (its {match['level']} formats: {formats})")
        checked += 1
    return checked


def logged_formats(module_name: str) -> dict[str, list[str]]:
    """The format strings a module's ``logger.LEVEL(...)`` calls use, by level."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise ExampleError(f"there is no module {module_name} (a logger is named after its module)") from None
    if getattr(module, "logger", None) is None or module.logger.name != module_name:
        raise ExampleError(f"{module_name} has no logger of its own name")
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    found: dict[str, list[str]] = {}
    levels = {"debug", "info", "warning", "error", "critical", "exception"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in levels
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "logger" and node.args):
            text = _constant_text(node.args[0])
            if text is not None:
                level = "error" if node.func.attr == "exception" else node.func.attr
                found.setdefault(level, []).append(text)
    return found


def _constant_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _constant_text(node.left), _constant_text(node.right)
        return None if left is None or right is None else left + right
    return None


def _log_pattern(format_string: str) -> re.Pattern[str]:
    parts = re.split(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfgix%]", format_string)
    return re.compile(".+?".join(re.escape(p) for p in parts), re.S)


def elided(excerpt: str) -> re.Pattern[str]:
    """A pattern of an excerpt whose ``…`` stand for elided text."""
    return re.compile(".*?".join(re.escape(p) for p in excerpt.split("…")), re.S)


# -- the parsers ---------------------------------------------------------------------------------------------------
def _region_language(region: Region) -> str:
    return region.lexemes.get("arguments", "")


class ExcerptParser(CodeBlockParser):
    """A named excerpt: kept for a later block to check."""

    def __init__(self, language: str) -> None:
        super().__init__(language)

    def evaluate(self, example: Example) -> None:
        options = example.region.lexemes.get("options") or {}
        name = options.get("name")
        if not name:
            raise ExampleError(f"{example.path}, line {example.line}: a {self.language} excerpt must be a"
                               " {code-block} with a :name: that a later block checks (shown[NAME])")
        shown: Shown = example.namespace["shown"]
        if name in shown:
            raise ExampleError(f"{example.path}, line {example.line}: a second excerpt named {name!r}")
        dict.__setitem__(shown, name, str(example.parsed))


class IncludeParser:
    """``{literalinclude} PATH`` of a YAML file: checked as a yaml block."""

    def __init__(self) -> None:
        self.lexer = DirectiveLexer(directive="literalinclude", arguments=r".+")

    def __call__(self, document: Document) -> Iterator[Region]:
        for region in self.lexer(document):
            region.parsed = region.lexemes["arguments"].strip()
            region.evaluator = self.evaluate
            yield region

    def evaluate(self, example: Example) -> None:
        target = (Path(example.path).parent / example.parsed).resolve()
        if not target.is_file():
            raise ExampleError(f"{example.path}, line {example.line}: includes {example.parsed}, which is missing")
        if target.suffix in (".yaml", ".yml"):
            check_yaml(target.read_text(), f"{target.relative_to(REPO)} (included at {example.path}:"
                                           f"{example.line})", example.namespace["__page__"], target.parent)


def _python(example: Example) -> None:
    run_python(example)


def _sh(example: Example) -> None:
    check_shell(str(example.parsed), f"{example.path}, line {example.line}")


def _yaml(example: Example) -> None:
    check_yaml(str(example.parsed), f"{example.path}, line {example.line}", example.namespace["__page__"])


def parsers() -> list[Any]:
    return [CodeBlockParser("python", _python), CodeBlockParser("sh", _sh), CodeBlockParser("yaml", _yaml),
            IncludeParser(), *(ExcerptParser(language) for language in sorted(EXCERPTS))]


def check_page(path: Path) -> None:
    """Run every example of the page at ``path`` (see the module rules)."""
    __tracebackhide__ = True
    document = Document.parse(str(path), *parsers())
    page = Page(path)
    document.namespace.update(page.namespace(), __page__=page)
    cwd = os.getcwd()
    os.chdir(REPO)
    logging_level = logging.getLogger().level
    try:
        for example in document.examples():
            example.evaluate()
        unread = sorted(set(page.shown) - page.shown.read)
        if unread:
            raise ExampleError(f"{path}: no block checks the excerpt(s) {', '.join(unread)} (read shown[NAME])")
    finally:
        os.chdir(cwd)
        logging.getLogger().setLevel(logging_level)
        page.close()


def unchecked_fences(path: Path) -> list[str]:
    """Fences of a kind nothing checks: a language this module neither runs
    nor keeps as an excerpt, a directive it does not know, no language."""
    found = []
    for fence in fences(path):
        if fence.directive and fence.directive != "code-block":
            if fence.directive not in DIRECTIVES:
                found.append(f"line {fence.line}: directive {{{fence.directive}}}")
        elif fence.language not in RUN | EXCERPTS:
            found.append(f"line {fence.line}: language {fence.language or '(none)'!r}")
    return found


def same_shape(excerpt: str, kind: Any, printed: Any = None) -> Any:
    """Decode the JSON ``excerpt`` as the program's ``kind`` (a Struct or a
    type msgspec knows) and check it names exactly the fields the program
    prints for that value, at every level: ``msgspec.to_builtins`` of the
    value, or of ``printed(value)`` where the program prints something
    made from it (a route's answer)."""
    import msgspec

    value = msgspec.json.decode(excerpt.encode(), type=kind)
    output = value if printed is None else printed(value)
    _same_keys(msgspec.json.decode(excerpt.encode()), msgspec.to_builtins(output), "")
    return value


def _same_keys(shown: Any, printed: Any, where: str) -> None:
    if isinstance(shown, dict) and isinstance(printed, dict):
        if set(shown) != set(printed):
            raise ExampleError(f"the excerpt's fields at {where or '/'} are {sorted(shown)}; the program prints"
                               f" {sorted(printed)}")
        for key in shown:
            _same_keys(shown[key], printed[key], f"{where}/{key}")
    elif isinstance(shown, list) and isinstance(printed, list):
        for index, (a, b) in enumerate(zip(shown, printed)):
            _same_keys(a, b, f"{where}/{index}")
