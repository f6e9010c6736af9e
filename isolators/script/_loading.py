"""Loading a message script: text -> typed ``Script``, or one ``ScriptError``.

Rules:
- A script is YAML or JSON (``*.json``, or text that parses as JSON),
  decoded by msgspec into ``Script``: an unknown key, a value of the wrong
  type, a missing field or a value out of range is ONE ``ScriptError`` of
  one line, ``FILE:LINE: $.path.to.field: problem``. The line is found from
  the YAML parse (JSON is composed the same way); the decoded values
  themselves never carry line numbers, so no key is reserved.
- Beyond types, each step's action checks its own value (``validate``), an
  expectation must fit the action, the runner's flags cannot be set, the
  node must be a valid host file; relative paths are resolved against the
  script's directory.
- Limits against hostile input: 1 MiB of text, nesting 32 deep, 200,000
  YAML nodes once aliases are expanded (no recursive aliases), no duplicate
  keys, 10,000 steps, 100,000 calls once groups are repeated. Deep nesting
  and size are refused by a streaming pass before anything recursive runs.
"""

from __future__ import annotations

import os
import re
from typing import Any, NoReturn

import msgspec
import yaml

from actors.flags import Flags
from actors.nvml import HostFileError, host_spec_from_dict, load_host_file

from ._action import (
    ACTIONS,
    MAX_CALLS,
    MAX_DEPTH,
    MAX_NODES,
    MAX_SCRIPT_BYTES,
    RUNNER_FLAGS,
    CallExpect,
    Expect,
    ScriptError,
    concurrent_actions,
)
from ._actions import resolve_path
from ._format import BACKENDS, Node, Script, host_document, one_action_problem, step_action


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
            allowed = concurrent_actions() if in_group else tuple(ACTIONS)
            kind = "inside 'concurrent' a step" if in_group else "a step"
            detail = (f"unknown step '{field}': {kind} holds one action ({', '.join(allowed)})"
                      f" plus optional 'name' and 'expect'")
        else:
            struct = Script if not tokens else _struct_of(str(parent), in_group)
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


def _struct_of(key: str, in_group: bool) -> type | None:
    """The Struct a mapping under ``key`` decodes to (to list its fields)."""
    if key == "node":
        return Node
    if key == "expect":
        return CallExpect if in_group else Expect
    args = ACTIONS[key].args if key in ACTIONS else None
    return args if isinstance(args, type) and issubclass(args, msgspec.Struct) else None


def _annotate(script: Script, marks: _Marks) -> None:
    for i, step in enumerate(script.steps):
        tokens: list[str | int] = ["steps", i]
        step.line, step.where = marks.line(tokens), _path_text(tokens)
        if step.concurrent is not None:
            for j, sub in enumerate(step.concurrent.steps):
                sub_tokens = tokens + ["concurrent", "steps", j]
                sub.line, sub.where = marks.line(sub_tokens), _path_text(sub_tokens)


def _check(script: Script, source: str, marks: _Marks) -> None:
    """What msgspec types cannot say: one action a step, expectations that
    fit the action, each action's own checks, runner-owned flags, the number
    of calls."""

    def failing(step: Any) -> Any:
        def fail(suffix: list[str | int], problem: str) -> NoReturn:
            raise _located(source, marks, _path_tokens(step.where) + [step.action, *suffix], problem)
        return fail

    def one_action(step: Any) -> Any:
        problem = one_action_problem(step)
        if problem is not None:
            raise _located(source, marks, _path_tokens(step.where), problem)
        step.action = step_action(step)
        return ACTIONS[step.action]

    calls = 0
    for step in script.steps:
        action = one_action(step)
        allowed = action.expects
        for field in Expect.__struct_fields__:
            if getattr(step.expect, field) is not None and field not in allowed:
                hint = (f"'{action.name}' steps can expect: {', '.join(allowed)}" if allowed
                        else f"'{action.name}' is itself an assertion")
                raise _located(source, marks, _path_tokens(step.where) + ["expect", field],
                               f"'{field}' does not apply here ({hint})")
        args = getattr(step, action.name)
        for sub in args.steps if action.name == "concurrent" else []:
            one_action(sub).validate(getattr(sub, sub.action), failing(sub))
        action.validate(args, failing(step))
        calls += action.calls(args)
        if calls > MAX_CALLS:
            raise _located(source, marks, _path_tokens(step.where),
                           f"the script makes more than {MAX_CALLS} calls (repeats included)")
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


def _check_node(script: Script, source: str, marks: _Marks, base_dir: str | None) -> None:
    node = script.node
    if node.host_file is not None:
        node.host_file = resolve_path(node.host_file, base_dir)
        if node.driver_version is not None or node.control_devices is not None:
            raise _located(source, marks, ["node", "host_file"],
                           "'driver_version' and 'control_devices' come from the host file here")
        try:
            load_host_file(node.host_file)
        except HostFileError as e:
            raise _located(source, marks, ["node", "host_file"], str(e)) from None
    else:
        try:
            host_spec_from_dict(host_document(node), "node")
        except HostFileError as e:
            match = re.match(r"^Invalid host file 'node': ([\w\[\].-]+): (.*)$", str(e))
            if match is None:
                raise _located(source, marks, ["node"], str(e)) from None
            field = match.group(1).replace("gpu_count", "gpus")
            raise _located(source, marks, ["node", *_path_tokens("." + field)], match.group(2)) from None
    for step in script.steps:
        ACTIONS[step.action].resolve(getattr(step, step.action), base_dir)


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

