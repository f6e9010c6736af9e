"""Message scripts: whole isolator scenarios as data (R-MS-1, R-MS-2).

Rules of the format:
- A script is YAML or JSON (``*.json``, or text that parses as JSON),
  decoded by msgspec into the typed ``Script`` below: an unknown key, a value
  of the wrong type, a missing field or a value out of range is ONE
  ``ScriptError`` of one line, ``FILE:LINE: $.path.to.field: problem``.
  The line is found from the YAML parse (JSON is composed the same way); the
  decoded values themselves never carry line numbers, so no key is reserved.
- ``node`` names the simulated node: ``gpus`` (a count, or a list of GPU
  tables as a host file writes them, with ``nvlink``, ``numa_node``,
  ``pcie_switch``...) or ``host_file`` (relative paths are relative to the
  script's directory); ``driver_version``, ``control_devices``, the device
  ``backend`` (``memory``, ``cgroups_v1``, ``cgroups_v2``) and extra
  ``flags``. The runner owns the paths (temp dirs, cgroups root, backend):
  scripts may not set them; a ``prepare``'s ``rootfs`` is a relative name
  made inside the run's temp dir.
- ``steps`` is a list; each step holds exactly one action, an optional
  ``name`` and an optional ``expect``:
  ``prepare`` / ``update`` / ``usage`` / ``cleanup`` / ``recover`` (isolator
  calls); ``create`` (flags: drop the running isolator, build components and
  isolator from these flags, fail like the agent's start-up); ``concurrent``
  (calls dispatched at once, ``repeat``-ed with ``{i}`` in their text);
  ``advance`` (seconds on the paused clock); ``restart`` (drop every actor,
  rebuild from the flags, recover the containers the kernel / checkpoint
  still holds); ``free`` (assert the allocator's free minors); ``held``
  (assert which minors each container holds); ``reconcile``;
  ``mark_unhealthy`` (a GPU minor).
- Expectations: ``error`` (a substring the failure must contain,
  case-insensitive); without it the step must succeed. ``gpus`` / ``count``
  (what a prepared or updated container holds afterwards), ``none`` (prepare
  returns no launch info), ``result`` (fields of the returned value),
  ``ok`` / ``failed`` (counts of a concurrent group), ``repairs``
  (reconcile). An expectation a step cannot have is a script error.
- Limits against hostile input: 1 MiB of text, nesting 32 deep, 200,000
  YAML nodes once aliases are expanded (no recursive aliases), no duplicate
  keys, 10,000 steps, 100,000 calls once groups are repeated.

Rules of a run:
- The runner drives the isolator actor through its handle (dispatch), on a
  node of its own: temp dirs and a fresh cgroups root, removed at the end
  with every container left behind.
- Every step is reported as it completes (its number, line, what it did and
  the outcome); a broken expectation shows expected and actual. A run never
  stops early, so one run shows every broken expectation; then a summary.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from typing import Annotated, Any, Callable, Literal

import aiofiles
import aiofiles.os
import msgspec
import yaml

from actors import Flags, ImageManifest, Resources
from actors.nvml import MAX_GPUS, HostFileError, host_spec_from_dict, load_host_file
from runtime import Clock, Future, await_all

from ._components import NvidiaComponents
from ._errors import IsolatorError
from ._isolator import MesosIsolator, NvidiaGpuIsolatorProcess
from ._types import ContainerClass, ContainerConfig, ContainerID, ContainerState

logger = logging.getLogger(__name__)

MAX_SCRIPT_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 200_000
MAX_STEPS = 10_000
MAX_CALLS = 100_000
MAX_REPEAT = 10_000

ACTIONS = ("prepare", "update", "usage", "cleanup", "recover", "create", "concurrent", "advance",
           "restart", "free", "held", "reconcile", "mark_unhealthy")
CONCURRENT_ACTIONS = ("prepare", "update", "usage", "cleanup")
RUNNER_FLAGS = ("host_file", "dev_dir", "runtime_dir", "work_dir", "volume_dir", "cgroups_root",
                "cgroups_hierarchy", "device_backend")
"""Flags the runner sets for every run; ``create`` may still name a ``host_file``."""

BACKENDS = ("memory", "cgroups_v1", "cgroups_v2")


class ScriptError(IsolatorError, ValueError):
    """A script that cannot be read, decoded or run; one line naming the field."""


# -- the format ---------------------------------------------------------------
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]
_Text = Annotated[str, msgspec.Meta(max_length=10_000)]
_Minor = Annotated[int, msgspec.Meta(ge=0, le=(1 << 20) - 1)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_CALLS)]


class Node(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The simulated node a script runs on."""

    gpus: Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS)] | list[dict[str, Any]] | None = None
    host_file: str | None = None
    driver_version: str | None = None
    control_devices: dict[str, str] | None = None
    backend: Literal["memory", "cgroups_v1", "cgroups_v2"] = "memory"
    flags: dict[str, Any] = {}


class Prepare(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: _Id
    resources: _Text = ""
    rootfs: str | None = None
    docker_env: list[str] | None = None
    docker_labels: dict[str, str] | None = None
    debug: bool = False
    task: bool = False


class Update(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: _Id
    resources: _Text


class ById(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: _Id


class Recover(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    states: list[_Id] = []
    orphans: list[_Id] = []


class Restart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    recover: bool = True
    states: list[_Id] | None = None
    """The containers the agent still knows (default: every one the isolator held)."""
    orphans: list[_Id] = []


class CallExpect(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    error: _Text | None = None


class CallStep(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """A step inside ``concurrent``: one isolator call."""

    prepare: Prepare | None = None
    update: Update | None = None
    usage: ById | None = None
    cleanup: ById | None = None
    expect: CallExpect = msgspec.field(default_factory=CallExpect)
    name: _Text | None = None


class Concurrent(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    steps: Annotated[list[CallStep], msgspec.Meta(min_length=1, max_length=MAX_STEPS)]
    repeat: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPEAT)] = 1


class Expect(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    error: _Text | None = None
    gpus: list[_Minor] | None = None
    count: _Count | None = None
    none: bool | None = None
    result: dict[str, Any] | list[Any] | None = None
    ok: _Count | None = None
    failed: _Count | None = None
    repairs: _Count | None = None


class Step(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """One step: exactly one action, a name and an expectation.

    After loading, ``line`` (1-based; 0 if unknown) and ``where`` (the JSON
    path, ``$.steps[3]``) are set on every step; they are not fields."""

    prepare: Prepare | None = None
    update: Update | None = None
    usage: ById | None = None
    cleanup: ById | None = None
    recover: Recover | None = None
    create: dict[str, Any] | None = None
    concurrent: Concurrent | None = None
    advance: Annotated[float, msgspec.Meta(ge=0, le=1e9)] | None = None
    restart: Restart | None = None
    free: list[_Minor] | None = None
    held: dict[str, list[_Minor]] | None = None
    reconcile: bool | None = None
    mark_unhealthy: _Minor | None = None
    expect: Expect = msgspec.field(default_factory=Expect)
    name: _Text | None = None


class Script(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """A whole script. After loading, ``source`` (its file name) and
    ``base_dir`` (where relative host files are found) are set too."""

    name: _Text | None = None
    description: _Text = ""
    node: Node = msgspec.field(default_factory=Node)
    steps: Annotated[list[Step], msgspec.Meta(min_length=1, max_length=MAX_STEPS)]


_FIELDS_BY_KEY: dict[str, type] = {
    "node": Node, "prepare": Prepare, "update": Update, "usage": ById, "cleanup": ById,
    "recover": Recover, "restart": Restart, "concurrent": Concurrent, "expect": Expect,
}

# Which expectations each action can have (error: every call and create).
_EXPECTATIONS: dict[str, tuple[str, ...]] = {
    "prepare": ("error", "gpus", "count", "none", "result"),
    "update": ("error", "gpus", "count", "result"),
    "usage": ("error", "result"),
    "cleanup": ("error", "result"),
    "recover": ("error",),
    "create": ("error",),
    "concurrent": ("ok", "failed"),
    "advance": (),
    "restart": ("error", "result"),
    "free": (),
    "held": (),
    "reconcile": ("error", "repairs", "result"),
    "mark_unhealthy": ("error",),
}


def _one_action_problem(step: Step | CallStep) -> str | None:
    names = CONCURRENT_ACTIONS if isinstance(step, CallStep) else ACTIONS
    present = [name for name in names if getattr(step, name) is not None]
    if len(present) == 1:
        return None
    inside = " inside 'concurrent'" if isinstance(step, CallStep) else ""
    got = " and ".join(f"'{name}'" for name in present) if present else "none"
    return f"a step{inside} holds exactly one action ({', '.join(names)}); got {got}"


def step_action(step: Step | CallStep) -> str:
    """The one action a step holds (ScriptError naming the step otherwise)."""
    problem = _one_action_problem(step)
    if problem is not None:
        raise ScriptError(f"{_where(step)}: {problem}")
    names = CONCURRENT_ACTIONS if isinstance(step, CallStep) else ACTIONS
    return next(name for name in names if getattr(step, name) is not None)


# -- loading: text -> document with line marks ---------------------------------
class _Marks:
    """Line numbers of the values of a document, found from its YAML nodes."""

    def __init__(self, root: yaml.Node | None) -> None:
        self.root = root

    def line(self, path: list[str | int]) -> int:
        """The 1-based line of the value at ``path`` (its key's line for a
        mapping value), or of the deepest ancestor found; 0 if unknown."""
        node = self.root
        if node is None:
            return 0
        line = node.start_mark.line + 1
        for token in path:
            if isinstance(node, yaml.MappingNode) and isinstance(token, str):
                for key, value in node.value:
                    if isinstance(key, yaml.ScalarNode) and key.value == token:
                        node, line = value, key.start_mark.line + 1
                        break
                else:
                    return line
            elif isinstance(node, yaml.SequenceNode) and isinstance(token, int) and token < len(node.value):
                node = node.value[token]
                line = node.start_mark.line + 1
            else:
                return line
        return line


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Depth, expanded size, cycles and duplicate keys of a composed YAML tree."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def visit(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ScriptError(f"{source}:{node.start_mark.line + 1}: the script is nested more than {MAX_DEPTH} levels deep")
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ScriptError(f"{source}:{node.start_mark.line + 1}: a recursive alias (a value that contains itself)")
        active.add(key)
        size = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in seen:
                        raise ScriptError(
                            f"{source}:{k.start_mark.line + 1}: duplicate key '{k.value}'"
                            f" (first on line {seen[k.value]})"
                        )
                    seen[k.value] = k.start_mark.line + 1
                size += visit(k, depth + 1) + visit(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                size += visit(item, depth + 1)
        if size > MAX_NODES:
            raise ScriptError(f"{source}: the script expands to more than {MAX_NODES} values (aliases included)")
        active.discard(key)
        sizes[key] = size
        return size

    visit(root, 0)


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml when present: the pure-Python parser takes seconds on a 1 MiB script."""


def _scan(text: str, source: str) -> None:
    """A streaming pass over the parse events: refuse deep nesting and too many
    values before anything recursive (composing) runs. libyaml's parser keeps
    its own stack; its composer recurses and would overflow the C stack."""
    depth = events = 0
    for event in yaml.parse(text, Loader=_Loader):
        events += 1
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark is not None else 0
                where = f"{source}:{line}" if line else source
                raise ScriptError(f"{where}: the script is nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
        if events > MAX_NODES:
            raise ScriptError(f"{source}: the script has more than {MAX_NODES} values")


def _compose(text: str, source: str) -> yaml.Node | None:
    _scan(text, source)
    loader = _Loader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _parse_yaml(text: str, source: str) -> tuple[Any, _Marks]:
    try:
        _scan(text, source)
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                raise ScriptError(f"{source}: the script is empty")
            _check_nodes(root, source)
            document = loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = " ".join(p for p in (e.context, e.problem) if p)
        if "nesting depth" in problem:  # PyYAML >= 6.0.4 stops deep nesting in its scanner
            raise ScriptError(f"{where}: the script is nested more than {MAX_DEPTH} levels deep") from None
        raise ScriptError(f"{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise ScriptError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ScriptError(f"{source}: the script is nested too deeply") from None
    return document, _Marks(root)


def _check_depth(value: Any, source: str, depth: int = 1) -> None:
    if isinstance(value, (dict, list)) and depth > MAX_DEPTH:
        raise ScriptError(f"{source}: the script is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        for v in value.values():
            _check_depth(v, source, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_depth(v, source, depth + 1)


def _parse_json(text: str, source: str) -> tuple[Any, _Marks]:
    try:
        document = msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        message = str(e)
        match = re.search(r"\(byte (\d+)\)", message)
        where = f"{source}:{text[: int(match.group(1))].count(chr(10)) + 1}" if match else source
        raise ScriptError(f"{where}: not valid JSON: {message}") from None
    except RecursionError:
        raise ScriptError(f"{source}: the script is nested too deeply") from None
    _check_depth(document, source)
    try:
        # Only for line numbers: JSON strings hold no raw tabs, so this keeps
        # every position; YAML reads JSON but not tab indentation.
        root = _compose(text.replace("\t", " "), source)
        if root is not None:
            _check_nodes(root, source)
    except (yaml.YAMLError, RecursionError):
        root = None
    return document, _Marks(root)


def _is_json(text: str, source: str) -> bool:
    lowered = source.lower()
    if lowered.endswith(".json"):
        return True
    if lowered.endswith((".yaml", ".yml")):
        return False
    if text.lstrip()[:1] not in ("{", "["):
        return False
    try:
        msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return False  # flow-style YAML
    return True


# -- loading: document -> Script -------------------------------------------------
_PATH_TOKEN = re.compile(r"\.([^.\[`]+)|\[(\d+|\.\.\.)\]")


def _path_tokens(path: str) -> list[str | int]:
    tokens: list[str | int] = []
    for name, index in _PATH_TOKEN.findall(path[1:] if path.startswith("$") else path):
        if name:
            tokens.append(name)
        elif index.isdigit():
            tokens.append(int(index))
        else:
            break  # a dict value: msgspec does not say which key
    return tokens


def _path_text(tokens: list[str | int]) -> str:
    return "$" + "".join(f"[{t}]" if isinstance(t, int) else f".{t}" for t in tokens)


def _located(source: str, marks: _Marks | None, tokens: list[str | int], problem: str) -> ScriptError:
    line = marks.line(tokens) if marks is not None else 0
    where = f"{source}:{line}" if line else source
    return ScriptError(f"{where}: {_path_text(tokens)}: {problem}")


def _validation_error(error: msgspec.ValidationError, source: str, marks: _Marks) -> ScriptError:
    message = str(error)
    match = re.match(r"^(.*) - at (`key` in )?`(\$[^`]*)`$", message, re.S)
    if match is None:
        detail, path, is_key = message, "$", False
    else:
        detail, path, is_key = match.group(1), match.group(3), match.group(2) is not None
    tokens = _path_tokens(path)
    if is_key:
        detail += " (in a key)"
    unknown = re.match(r"^Object contains unknown field `(.*)`$", detail)
    missing = re.match(r"^Object missing required field `(.*)`$", detail)
    if unknown:
        field = unknown.group(1)
        parent = tokens[-1] if tokens else None
        in_group = "concurrent" in tokens
        if isinstance(parent, int) and tokens[-2:-1] == ["steps"] and len(tokens) >= 2:
            allowed = CONCURRENT_ACTIONS if in_group else ACTIONS
            kind = "inside 'concurrent' a step" if in_group else "a step"
            detail = (f"unknown step '{field}': {kind} holds one action ({', '.join(allowed)})"
                      f" plus optional 'name' and 'expect'")
        else:
            struct = Script if not tokens else _FIELDS_BY_KEY.get(str(parent))
            if struct is Expect and in_group:
                struct = CallExpect
            known = f" (expected one of: {', '.join(struct.__struct_fields__)})" if struct is not None else ""
            detail = f"unknown field '{field}'{known}"
        tokens = tokens + [field]
    elif detail.startswith("Invalid enum value") and tokens == ["node", "backend"]:
        detail += f" (expected one of: {', '.join(BACKENDS)})"
    elif missing:
        field = missing.group(1)
        detail = f"missing required field '{field}'"
        tokens = tokens + [field]
    return _located(source, marks, tokens, detail)


def _annotate(script: Script, marks: _Marks) -> None:
    for i, step in enumerate(script.steps):
        tokens: list[str | int] = ["steps", i]
        step.line, step.where = marks.line(tokens), _path_text(tokens)
        if step.concurrent is not None:
            for j, sub in enumerate(step.concurrent.steps):
                sub_tokens = tokens + ["concurrent", "steps", j]
                sub.line, sub.where = marks.line(sub_tokens), _path_text(sub_tokens)


def _where(step: Step | CallStep) -> str:
    line = getattr(step, "line", 0)
    where = getattr(step, "where", "$.steps[?]")
    return f"line {line}: {where}" if line else where


def _check(script: Script, source: str, marks: _Marks) -> None:
    """What msgspec types cannot say: one action a step, expectations that
    fit the action, runner-owned flags, the number of calls."""

    def fail(step: Step | CallStep, suffix: list[str | int], problem: str) -> ScriptError:
        tokens = _path_tokens(step.where) + suffix
        return _located(source, marks, tokens, problem)

    calls = 0
    for step in script.steps:
        problem = _one_action_problem(step)
        if problem is not None:
            raise fail(step, [], problem)
        step.action = action = step_action(step)
        allowed = _EXPECTATIONS[action]
        for field in Expect.__struct_fields__:
            if getattr(step.expect, field) is not None and field not in allowed:
                hint = f"'{action}' steps can expect: {', '.join(allowed)}" if allowed else f"'{action}' is itself an assertion"
                raise fail(step, ["expect", field], f"'{field}' does not apply here ({hint})")
        for call in [step] + (list(step.concurrent.steps) if step.concurrent is not None else []):
            rootfs = call.prepare.rootfs if call.prepare is not None else None
            if rootfs is not None and (os.path.isabs(rootfs) or not rootfs.strip()
                                       or any(part in ("", ".", "..") for part in rootfs.split("/"))):
                raise fail(call, ["prepare", "rootfs"],
                           f"rootfs {rootfs!r} must be a relative name (it is made inside the run's temp dir)")
        if action == "create":
            for key in step.create:
                if str(key).replace("-", "_") in RUNNER_FLAGS and str(key).replace("-", "_") != "host_file":
                    raise fail(step, ["create", key], f"the flag '{key}' is set by the runner (each run gets its own)")
        if action == "concurrent":
            group = step.concurrent
            for sub in group.steps:
                problem = _one_action_problem(sub)
                if problem is not None:
                    raise fail(sub, [], problem)
                sub.action = step_action(sub)
            calls += group.repeat * len(group.steps)
        else:
            calls += 1
        if calls > MAX_CALLS:
            raise fail(step, [], f"the script makes more than {MAX_CALLS} calls (repeats included)")
    node = script.node
    for key in node.flags:
        if str(key).replace("-", "_") in RUNNER_FLAGS:
            hint = "use node.host_file" if key == "host_file" else (
                "use node.backend or --backend" if key == "device_backend" else "each run gets its own")
            raise _located(source, marks, ["node", "flags", key], f"the flag '{key}' is set by the runner ({hint})")
    try:
        Flags.from_dict(node.flags)
    except ValueError as e:
        raise _located(source, marks, ["node", "flags"], str(e)) from None
    if node.host_file is not None and node.gpus is not None:
        raise _located(source, marks, ["node", "host_file"], "give either 'gpus' or 'host_file', not both")


def _resolve(path: str, base_dir: str | None) -> str:
    path = os.path.expanduser(path)
    if base_dir is not None and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return os.path.abspath(path)


def _check_node(script: Script, source: str, marks: _Marks, base_dir: str | None) -> None:
    node = script.node
    if node.host_file is not None:
        node.host_file = _resolve(node.host_file, base_dir)
        if node.driver_version is not None or node.control_devices is not None:
            raise _located(source, marks, ["node", "host_file"],
                           "'driver_version' and 'control_devices' come from the host file here")
        try:
            load_host_file(node.host_file)
        except HostFileError as e:
            raise _located(source, marks, ["node", "host_file"], str(e)) from None
    else:
        try:
            host_spec_from_dict(_host_document(node), "node")
        except HostFileError as e:
            match = re.match(r"^Invalid host file 'node': ([\w\[\].-]+): (.*)$", str(e))
            if match is None:
                raise _located(source, marks, ["node"], str(e)) from None
            field = match.group(1).replace("gpu_count", "gpus")
            raise _located(source, marks, ["node", *_path_tokens("." + field)], match.group(2)) from None
    for step in script.steps:
        if step.create is not None and isinstance(step.create.get("host_file"), str):
            step.create["host_file"] = _resolve(step.create["host_file"], base_dir)


def _host_document(node: Node) -> dict[str, Any]:
    document: dict[str, Any] = {}
    if isinstance(node.gpus, list):
        document["gpus"] = node.gpus
    else:
        document["gpu_count"] = 8 if node.gpus is None else node.gpus
    if node.driver_version is not None:
        document["driver_version"] = node.driver_version
    if node.control_devices is not None:
        document["control_devices"] = node.control_devices
    return document


def load_script(text: str | bytes, source: str = "<script>", base_dir: str | None = None) -> Script:
    """Decode a YAML or JSON script; raises one ScriptError naming the file,
    the line and the path to the bad field. Relative host files are resolved
    against ``base_dir`` (default: the current directory)."""
    if len(text) > MAX_SCRIPT_BYTES:
        raise ScriptError(f"{source}: the script is {len(text)} bytes; the limit is {MAX_SCRIPT_BYTES}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ScriptError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if "\x00" in text:
        raise ScriptError(f"{source}: not a text file (it contains NUL bytes)")
    document, marks = _parse_json(text, source) if _is_json(text, source) else _parse_yaml(text, source)
    if not isinstance(document, dict):
        raise ScriptError(f"{source}: a script is a mapping with 'node' and 'steps', got {type(document).__name__}")
    try:
        script = msgspec.convert(document, Script)
    except msgspec.ValidationError as e:
        raise _validation_error(e, source, marks) from None
    _annotate(script, marks)
    _check(script, source, marks)
    _check_node(script, source, marks, base_dir)
    script.source = source
    script.base_dir = base_dir
    if script.name is None:
        script.name = os.path.splitext(os.path.basename(source))[0].strip("<>") or "script"
    return script


def load_script_file(path: str) -> Script:
    """Read and decode a script file (see ``load_script``); host files are
    relative to the script's directory."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as e:
        raise ScriptError(f"Cannot read script '{path}': {e.strerror or e}") from None
    if len(data) > MAX_SCRIPT_BYTES:
        raise ScriptError(f"{path}: the script is more than {MAX_SCRIPT_BYTES} bytes")
    return load_script(data, path, base_dir=os.path.dirname(os.path.abspath(path)))


# -- reports ---------------------------------------------------------------------
class StepResult(msgspec.Struct, kw_only=True):
    """The outcome of one step."""

    number: int
    line: int
    action: str
    call: str
    """What the step did, in words (``prepare c1 (gpus:2)``)."""
    title: str
    """The step's name, or its ``call``."""
    ok: bool
    detail: str
    expected: str | None = None
    actual: str | None = None


class ScriptReport(msgspec.Struct, kw_only=True):
    """Every step's outcome, in order."""

    name: str
    backend: str
    results: list[StepResult] = []
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[StepResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        good = sum(r.ok for r in self.results)
        text = (f"{self.name} on {self.backend}: {len(self.results)} steps, {good} passed,"
                f" {len(self.results) - good} failed in {self.seconds:.2f} s")
        if self.passed:
            return text + ": every expectation held"
        lines = ", ".join(str(r.line) for r in self.failures)
        return text + f": FAILED (line{'s' if len(self.failures) > 1 else ''} {lines})"


def format_result(result: StepResult) -> list[str]:
    """The report lines of one step, as ``run`` and ``demo`` print them."""
    mark = "ok  " if result.ok else "FAIL"
    head = f"  {mark} {result.number:>3}  line {result.line:<4} "
    pad = " " * len(head)
    if result.title != result.call:
        lines = [f"{head}{result.title}", f"{pad}{result.call} -> {result.detail}"]
    else:
        lines = [f"{head}{result.call} -> {result.detail}"]
    if result.expected is not None:
        lines.append(f"{pad}expected: {result.expected}")
        lines.append(f"{pad}actual:   {result.actual}")
    return lines


# -- running ---------------------------------------------------------------------
class _Mismatch(Exception):
    """A step whose outcome differs from the expectation."""

    def __init__(self, expected: str, actual: str, detail: str | None = None) -> None:
        super().__init__(detail or f"expected {expected}, got {actual}")
        self.expected, self.actual = expected, actual
        self.detail = detail or "not as expected"


class _Env:
    """The node a script runs on: flags, temp dirs, the live actors."""

    def __init__(self, script: Script, backend: str | None, cgroups_root: str | None) -> None:
        self.script = script
        self.backend = backend or script.node.backend
        if self.backend not in BACKENDS:
            raise ScriptError(f"Unknown backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        self.cgroups_root = cgroups_root or f"gpu-isolator-script-{uuid.uuid4().hex[:12]}"
        self.tmp: str | None = None
        self.base_flags: dict[str, Any] = {}
        self.flags: Flags | None = None
        self.components: NvidiaComponents | None = None
        self.isolator: MesosIsolator | None = None

    async def setup(self) -> None:
        """Temp dirs and the node's host file (async file work)."""
        self.tmp = await aiofiles.os.wrap(tempfile.mkdtemp)(prefix="gpu-isolator-script-")
        node = self.script.node
        host_file = node.host_file
        if host_file is None:
            host_file = os.path.join(self.tmp, "host.json")
            async with aiofiles.open(host_file, "w") as f:
                await f.write(json.dumps(_host_document(node)))
        await aiofiles.os.makedirs(os.path.join(self.tmp, "dev"))
        self.base_flags = dict(node.flags)
        self.base_flags.update(
            host_file=host_file,
            dev_dir=os.path.join(self.tmp, "dev"),
            runtime_dir=os.path.join(self.tmp, "run"),
            work_dir=os.path.join(self.tmp, "work"),
            volume_dir=os.path.join(self.tmp, "volume"),
            device_backend=self.backend,
            cgroups_root=self.cgroups_root,
        )
        self.flags = Flags.from_dict(self.base_flags)

    async def start(self, extra: dict[str, Any] | None = None) -> None:
        flags = self.flags if extra is None else Flags.from_dict({**self.base_flags, **extra})
        components = await NvidiaComponents.create(flags)
        try:
            isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
        except BaseException:
            await components.close()
            raise
        self.flags, self.components, self.isolator = flags, components, isolator

    async def stop(self) -> None:
        isolator, components = self.isolator, self.components
        self.isolator = self.components = None
        if isolator is not None:
            await isolator.close()
        if components is not None:
            await components.close()

    async def teardown(self) -> None:
        """Clean up every container left, remove the cgroups root, the temp dirs."""
        try:
            if self.isolator is None and self.tmp is not None:
                try:
                    await self.start()
                    await self.isolator.recover([], set())
                except Exception as e:
                    logger.warning("script teardown: cannot start an isolator to clean up: %s", e)
            if self.isolator is not None:
                for cid in list((await self.isolator.containers()).keys()):
                    try:
                        await self.isolator.cleanup(ContainerID.parse(cid))
                    except Exception as e:
                        logger.warning("script teardown: cleanup of %s failed: %s", cid, e)
                if not await self.isolator.devices.remove_root():
                    logger.warning("script teardown: the cgroups root %s was not removed", self.cgroups_root)
        finally:
            await self.stop()
            if self.tmp is not None:
                await aiofiles.os.wrap(shutil.rmtree)(self.tmp, ignore_errors=True)


def _config(p: Prepare, rootfs_dir: str) -> ContainerConfig:
    manifest = None
    if p.docker_env is not None or p.docker_labels is not None:
        manifest = ImageManifest(env=p.docker_env or [], labels=p.docker_labels or {})
    return ContainerConfig(
        resources=Resources.parse(p.resources),
        rootfs=None if p.rootfs is None else os.path.join(rootfs_dir, p.rootfs),
        docker_manifest=manifest,
        container_class=ContainerClass.DEBUG if p.debug else ContainerClass.DEFAULT,
        has_task_info=p.task,
    )


def _subset(expected: Any, actual: Any, path: str = "result") -> tuple[str, str, str] | None:
    """The first place where ``actual`` does not match ``expected``: mappings
    match on the keys given, lists element by element, other values by
    equality. ``(path, expected, actual)`` or None."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return path, "a mapping", _short(repr(actual))
        for k, v in expected.items():
            if k not in actual:
                return f"{path}.{k}", repr(v), f"no '{k}' (fields: {', '.join(map(str, actual))})"
            problem = _subset(v, actual[k], f"{path}.{k}")
            if problem:
                return problem
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return path, f"{len(expected)} items", _short(f"{len(actual)} items: {actual!r}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            problem = _subset(e, a, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if expected != actual and not (isinstance(expected, (int, float)) and not isinstance(expected, bool)
                                   and isinstance(actual, (int, float)) and not isinstance(actual, bool)
                                   and float(expected) == float(actual)):
        return path, repr(expected), _short(repr(actual))
    return None


def action_title(step: Step | CallStep, action: str | None = None) -> str:
    """What a step does, in words (``prepare c1 (gpus:2)``)."""
    action = action or step.action
    if action == "prepare":
        p = step.prepare
        extras = [p.resources or "no resources"]
        if p.rootfs:
            extras.append(f"rootfs {p.rootfs}")
        if p.debug:
            extras.append("DEBUG")
        return f"prepare {p.id} ({', '.join(extras)})"
    if action == "update":
        return f"update {step.update.id} to {step.update.resources}"
    if action == "usage":
        return f"usage of {step.usage.id}"
    if action == "cleanup":
        return f"cleanup {step.cleanup.id}"
    if action == "recover":
        r = step.recover
        return f"recover states {r.states}" + (f", orphans {r.orphans}" if r.orphans else "")
    if action == "create":
        flags = ", ".join(f"{k}={v}" for k, v in step.create.items())
        return f"create the isolator ({flags or 'default flags'})"
    if action == "concurrent":
        group = step.concurrent
        calls = "; ".join(action_title(s) for s in group.steps)
        count = group.repeat * len(group.steps)
        return f"{count} call{'s' if count != 1 else ''} at once: {calls}" + (
            f" (x{group.repeat})" if group.repeat > 1 else "")
    if action == "advance":
        return f"advance the clock {step.advance:g} s"
    if action == "restart":
        return "agent restart: drop every actor, rebuild" + (", recover" if step.restart.recover else "")
    if action == "free":
        return "free GPUs"
    if action == "held":
        return "GPUs held per container"
    if action == "reconcile":
        return "reconcile device rules"
    if action == "mark_unhealthy":
        return f"mark GPU {step.mark_unhealthy} unhealthy"
    return action


class ScriptRunner:
    """Runs one script on one backend and reports every step (see module rules)."""

    def __init__(self, script: Script, backend: str | None = None,
                 echo: Callable[[str], None] | None = None, cgroups_root: str | None = None) -> None:
        self.script = script
        self.env = _Env(script, backend, cgroups_root)
        self.report = ScriptReport(name=script.name or "script", backend=self.env.backend)
        self.echo = echo or (lambda line: None)

    async def run(self) -> ScriptReport:
        env = self.env
        started = time.monotonic()
        try:
            await env.setup()
            if self.script.steps[0].create is None:
                try:
                    await env.start()
                    await env.isolator.recover([], set())
                except Exception as e:
                    raise ScriptError(
                        f"{getattr(self.script, 'source', 'script')}: cannot start the node on"
                        f" {env.backend}: {e}") from None
            for step in self.script.steps:
                await self._run_step(step)
        finally:
            if Clock.paused():
                Clock.resume()
            await env.teardown()
        self.report.seconds = time.monotonic() - started
        self.echo(self.report.summary())
        return self.report

    def _record(self, step: Step, ok: bool, detail: str, expected: str | None = None,
                actual: str | None = None) -> None:
        call = action_title(step)
        result = StepResult(number=len(self.report.results) + 1, line=getattr(step, "line", 0),
                            action=step.action, call=call, title=step.name or call, ok=ok, detail=detail,
                            expected=expected, actual=actual)
        self.report.results.append(result)
        for line in format_result(result):
            self.echo(line)

    async def _run_step(self, step: Step) -> None:
        action = step.action
        try:
            outcome = await self._perform(step, action)
        except _Mismatch as e:
            self._record(step, False, e.detail, e.expected, e.actual)
            return
        except Exception as e:  # a failed call: compare with the expected error
            self._check_error(step, e)
            return
        if step.expect.error is not None:
            self._record(step, False, "succeeded", f"an error containing {step.expect.error!r}",
                         "success: " + await self._describe(step, outcome))
            return
        try:
            await self._check_value(step, outcome)
        except _Mismatch as e:
            self._record(step, False, e.detail, e.expected, e.actual)
            return
        self._record(step, True, await self._describe(step, outcome))

    def _check_error(self, step: Step, error: BaseException) -> None:
        text = _error_text(error)
        wanted = step.expect.error
        if wanted is None:
            self._record(step, False, f"failed: {text}", "success", f"error: {text}")
        elif wanted.lower() in text.lower():
            self._record(step, True, f"refused as expected: {text}")
        else:
            self._record(step, False, f"failed: {text}", f"an error containing {wanted!r}", f"error: {text}")

    async def _describe(self, step: Step, outcome: Any) -> str:
        try:
            return await self._describe_outcome(step, outcome)
        except Exception as e:  # the step held; only the description failed
            logger.warning("script: cannot describe the outcome of %s: %s", step.action, e)
            return "done"

    async def _describe_outcome(self, step: Step, outcome: Any) -> str:
        action = step.action
        iso = self.env.isolator
        if action in ("prepare", "update") and iso is not None:
            target = (step.prepare or step.update).id
            held = (await iso.containers()).get(target)
            text = f"{target} holds GPUs {held}" if held is not None else f"{target} ready (nested: no GPUs of its own)"
            if action == "prepare" and outcome is not None:
                env = outcome.environment or outcome.task_environment
                mounts = len(outcome.mounts)
                text += f"; launch info: {mounts} mount{'s' if mounts != 1 else ''}" + (
                    f", env {sorted(env)}" if env else "")
            return text
        if action == "usage":
            gpus = "; ".join(_gpu_usage(g) for g in outcome.gpus)
            n = outcome.gpus_allocated
            return f"{n} GPU{'s' if n != 1 else ''}" + (f": {gpus}" if gpus else "")
        if action == "cleanup" and self.env.components is not None:
            free = sorted(g.minor for g in await self.env.components.allocator.available())
            return f"{step.cleanup.id} gone; free GPUs now {free}"
        if action == "concurrent":
            return f"{outcome['ok']} ok, {outcome['failed']} failed"
        if action == "restart":
            text = f"recovered {outcome['recovered'] or 'no containers'}"
            if outcome["report"]:
                text += "; " + "; ".join(outcome["report"])
            return text
        if action == "create":
            return "isolator running"
        if action == "reconcile":
            return f"{len(outcome)} repairs" + (": " + "; ".join(r.description for r in outcome) if outcome else "")
        if action in ("free", "held"):
            return f"{outcome}"
        return "done"

    async def _check_value(self, step: Step, outcome: Any) -> None:
        expect, action = step.expect, step.action
        if expect.none is not None and (outcome is None) != expect.none:
            raise _Mismatch("no launch info" if expect.none else "a launch info",
                            "a launch info" if outcome is not None else "no launch info")
        if expect.result is not None:
            actual = msgspec.to_builtins(outcome) if outcome is not None else None
            problem = _subset(expect.result, actual)
            if problem:
                path, wanted, got = problem
                raise _Mismatch(f"{path} = {wanted}", f"{path} = {got}", f"{path} differs")
        if expect.gpus is not None or expect.count is not None:
            target = (step.prepare or step.update).id
            held = (await self.env.isolator.containers()).get(target)
            actual = f"{target} holds GPUs {held}" if held is not None else f"{target} is not known"
            if expect.gpus is not None and held != sorted(expect.gpus):
                raise _Mismatch(f"{target} holds GPUs {sorted(expect.gpus)}", actual, "other GPUs than expected")
            if expect.count is not None and (held is None or len(held) != expect.count):
                raise _Mismatch(f"{target} holds {expect.count} GPUs", actual, "another number of GPUs")
        if expect.repairs is not None and len(outcome) != expect.repairs:
            raise _Mismatch(f"{expect.repairs} repairs", f"{len(outcome)} repairs: {[r.description for r in outcome]}",
                            "another number of repairs")

    async def _perform(self, step: Step, action: str) -> Any:
        env = self.env
        iso = env.isolator
        if iso is None and action not in ("create", "advance"):
            raise IsolatorError("No isolator is running: an earlier 'create' step failed")
        if action in CONCURRENT_ACTIONS:
            return await self._call(step, action)
        if action == "recover":
            states = [ContainerState(ContainerID.parse(s)) for s in step.recover.states]
            return await iso.recover(states, {ContainerID.parse(o) for o in step.recover.orphans})
        if action == "create":
            await env.stop()
            await env.start(step.create)
            await env.isolator.recover([], set())
            return None
        if action == "concurrent":
            return await self._concurrent(step)
        if action == "advance":
            if not Clock.paused():
                Clock.pause()
            Clock.advance(step.advance)
            await Clock.settle()
            return None
        if action == "restart":
            held = sorted((await iso.containers()).keys())
            await env.stop()
            await env.start()
            if not step.restart.recover:
                return {"recovered": [], "report": []}
            names = held if step.restart.states is None else step.restart.states
            await env.isolator.recover([ContainerState(ContainerID.parse(c)) for c in names],
                                       {ContainerID.parse(o) for o in step.restart.orphans})
            recovered = sorted((await env.isolator.containers()).keys())
            return {"recovered": recovered, "report": env.isolator.recovery_report}
        if action == "free":
            free = sorted(g.minor for g in await env.components.allocator.available())
            if free != sorted(step.free):
                raise _Mismatch(f"free GPUs {sorted(step.free)}", f"free GPUs {free}", "the free GPUs differ")
            return free
        if action == "held":
            held = await iso.containers()
            expected = {k: sorted(v) for k, v in step.held.items()}
            if held != expected:
                raise _Mismatch(f"{expected}", f"{held}", "the containers hold other GPUs")
            return held
        if action == "reconcile":
            return await iso.reconcile()
        if action == "mark_unhealthy":
            await env.components.allocator.mark_unhealthy(_gpu_by_minor(env, step.mark_unhealthy))
            return None
        raise ScriptError(f"{_where(step)}: unknown action {action!r}")

    def _call(self, step: Step | CallStep, action: str) -> Future:
        """Dispatch one isolator call; a Future of its outcome."""
        iso = self.env.isolator
        try:
            if action == "prepare":
                return iso.prepare(ContainerID.parse(step.prepare.id),
                                   _config(step.prepare, os.path.join(self.env.tmp, "rootfs")))
            if action == "update":
                return iso.update(ContainerID.parse(step.update.id), Resources.parse(step.update.resources))
            if action == "usage":
                return iso.usage(ContainerID.parse(step.usage.id))
            return iso.cleanup(ContainerID.parse(step.cleanup.id))
        except Exception as e:  # a bad id or resources: the call fails
            return Future.failed(e)

    async def _concurrent(self, step: Step) -> dict[str, int]:
        group = step.concurrent
        calls = [(_substitute(sub, i), sub) for i in range(group.repeat) for sub in group.steps]
        settled = await await_all([self._call(concrete, sub.action) for concrete, sub in calls])
        ok = sum(1 for f in settled if f.is_ready())
        failed = len(settled) - ok
        expect = step.expect
        if expect.ok is not None and ok != expect.ok:
            raise _Mismatch(f"{expect.ok} ok", f"{ok} ok, {failed} failed", f"{ok} ok, {failed} failed")
        if expect.failed is not None and failed != expect.failed:
            raise _Mismatch(f"{expect.failed} failed", f"{ok} ok, {failed} failed", f"{ok} ok, {failed} failed")
        counted = expect.ok is not None or expect.failed is not None
        for f, (concrete, sub) in zip(settled, calls):
            wanted = sub.expect.error
            title = action_title(concrete, sub.action)
            if f.is_failed():
                text = _error_text(f.failure())
                if wanted is None and not counted:
                    raise _Mismatch(f"{title}: success", f"{title}: error: {text}",
                                    f"{ok} ok, {failed} failed")
                if wanted is not None and wanted.lower() not in text.lower():
                    raise _Mismatch(f"{title}: an error containing {wanted!r}", f"{title}: error: {text}",
                                    f"{ok} ok, {failed} failed")
            elif wanted is not None and not counted:
                raise _Mismatch(f"{title}: an error containing {wanted!r}", f"{title}: success",
                                f"{ok} ok, {failed} failed")
        return {"ok": ok, "failed": failed}


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    return str(error) or type(error).__name__


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gpu_usage(g: Any) -> str:
    parts = [f"GPU {g.minor}"]
    if g.memory_total_bytes is not None:
        used = "?" if g.memory_used_bytes is None else g.memory_used_bytes // (1 << 20)
        parts.append(f"{used}/{g.memory_total_bytes // (1 << 20)} MiB")
    if g.utilization_gpu_percent is not None:
        parts.append(f"{g.utilization_gpu_percent}% busy")
    if g.power_milliwatts is not None:
        parts.append(f"{g.power_milliwatts / 1000:g} W")
    if g.temperature_celsius is not None:
        parts.append(f"{g.temperature_celsius} C")
    return " ".join(parts)


def _substitute(step: CallStep, i: int) -> CallStep:
    text = json.dumps(msgspec.to_builtins(step)).replace("{i}", str(i))
    concrete = msgspec.convert(json.loads(text), CallStep)
    concrete.action = step.action
    return concrete


def _gpu_by_minor(env: _Env, minor: int) -> Any:
    for gpu in env.components.allocator.total():
        if gpu.minor == minor:
            return gpu
    raise IsolatorError(f"No GPU with minor {minor} on this node")


async def run_script(script: Script, backend: str | None = None,
                     echo: Callable[[str], None] | None = None,
                     cgroups_root: str | None = None) -> ScriptReport:
    """Run ``script`` (inside a running ``runtime.Runtime``) on ``backend``
    (default: the script's ``node.backend``) and report every step through
    ``echo``. ``cgroups_root`` names the run's own root (default: a fresh
    ``gpu-isolator-script-<random>``); it is removed at the end."""
    return await ScriptRunner(script, backend, echo, cgroups_root).run()
