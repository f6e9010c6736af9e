"""Malformed and hostile message scripts: one ScriptError of one line,
``FILE:LINE: $.path.to.field: problem`` (R-MS-1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isolators import ScriptError, load_script, load_script_file
from isolators.script import MAX_SCRIPT_BYTES

NODE = "node: {gpus: 4}\n"


def error_of(text: str | bytes, source: str = "s.yaml") -> str:
    with pytest.raises(ScriptError) as info:
        load_script(text, source)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("text, message", [
    # unknown step / action
    (NODE + "steps:\n  - prepare: {id: a}\n  - reboot: {id: b}\n",
     "s.yaml:4: $.steps[1].reboot: unknown step 'reboot': a step holds one action (prepare, update, usage,"
     " cleanup, recover, create, concurrent, advance, restart, free, held, reconcile, mark_unhealthy,"
     " mark_healthy, free_mig) plus optional 'name' and 'expect'"),
    (NODE + "steps:\n  - concurrent:\n      steps:\n        - restart: {}\n",
     "s.yaml:5: $.steps[0].concurrent.steps[0].restart: unknown step 'restart': inside 'concurrent' a step"
     " holds one action (prepare, update, usage, cleanup) plus optional 'name' and 'expect'"),
    (NODE + "steps:\n  - prepare: {id: a}\n    update: {id: a, resources: 'gpus:1'}\n",
     "s.yaml:3: $.steps[0]: a step holds exactly one action (prepare, update, usage, cleanup, recover, create,"
     " concurrent, advance, restart, free, held, reconcile, mark_unhealthy, mark_healthy, free_mig);"
     " got 'prepare' and 'update'"),
    (NODE + "steps:\n  - name: nothing to do\n",
     "s.yaml:3: $.steps[0]: a step holds exactly one action"),
    # the loader's line numbers are not a field a script can set
    (NODE + "steps:\n  - line: 7\n", "s.yaml:3: $.steps[0].line: unknown step 'line'"),
    # unknown fields
    (NODE + "steps:\n  - prepare: {id: a, gpus: 2}\n",
     "s.yaml:3: $.steps[0].prepare.gpus: unknown field 'gpus' (expected one of: id, resources, rootfs,"
     " docker_env, docker_labels, debug, task)"),
    (NODE + "steps:\n  - free: []\n    expect: {gpu: [1]}\n",
     "s.yaml:4: $.steps[0].expect.gpu: unknown field 'gpu' (expected one of: error, gpus, count, none,"
     " result, ok, failed, repairs)"),
    ("nodes: {gpus: 4}\nsteps:\n  - free: []\n",
     "s.yaml:1: $.nodes: unknown field 'nodes' (expected one of: name, description, node, steps)"),
    ("node: {gpus: 4, backend: cgroups_v3}\nsteps:\n  - free: []\n",
     "s.yaml:1: $.node.backend: Invalid enum value 'cgroups_v3' (expected one of: memory, cgroups_v1,"
     " cgroups_v2)"),
    # wrong types
    (NODE + "steps:\n  - prepare:\n      id: a\n      resources: 5\n",
     "s.yaml:5: $.steps[0].prepare.resources: Expected `str`, got `int`"),
    (NODE + "steps:\n  - free: [0, one]\n", "s.yaml:3: $.steps[0].free[1]: Expected `int`, got `str`"),
    (NODE + "steps:\n  - advance: -1\n", "s.yaml:3: $.steps[0].advance: Expected `float` >= 0.0"),
    (NODE + "steps:\n  - advance: .nan\n", "s.yaml:3: $.steps[0].advance: Expected `float` >= 0.0"),
    (NODE + "steps:\n  - mark_unhealthy: -3\n", "s.yaml:3: $.steps[0].mark_unhealthy: Expected `int` >= 0"),
    ("steps: 5\n", "s.yaml:1: $.steps: Expected `array`, got `int`"),
    ("- free: []\n", "s.yaml: a script is a mapping with 'node' and 'steps', got list"),
    (NODE + "steps:\n  - concurrent: {steps: [{cleanup: {id: 'c{i}'}}], repeat: 100000}\n",
     "s.yaml:3: $.steps[0].concurrent.repeat: Expected `int` <= 10000"),
    # missing fields
    (NODE + "steps:\n  - prepare: {resources: 'gpus:1'}\n",
     "s.yaml:3: $.steps[0].prepare.id: missing required field 'id'"),
    (NODE + "steps:\n  - update:\n      id: a\n",
     "s.yaml:3: $.steps[0].update.resources: missing required field 'resources'"),
    (NODE, "s.yaml:1: $.steps: missing required field 'steps'"),
    (NODE + "steps: []\n", "s.yaml:2: $.steps: Expected `array` of length >= 1"),
    # expectations that do not fit the action
    (NODE + "steps:\n  - free: [1]\n    expect: {error: x}\n",
     "s.yaml:4: $.steps[0].expect.error: 'error' does not apply here ('free' is itself an assertion)"),
    (NODE + "steps:\n  - usage: {id: a}\n    expect: {gpus: [0]}\n",
     "s.yaml:4: $.steps[0].expect.gpus: 'gpus' does not apply here ('usage' steps can expect: error, result)"),
    # the node
    ("node: {gpus: 2, host_file: x.toml}\nsteps:\n  - free: []\n",
     "s.yaml:1: $.node.host_file: give either 'gpus' or 'host_file', not both"),
    ("node:\n  gpus:\n    - {nvlink: {5: 2}}\nsteps:\n  - free: []\n",
     "s.yaml:3: $.node.gpus[0].nvlink: peer 5 is not a GPU index (the node has 1 GPUs)"),
    ("node:\n  gpus: 4\n  flags: {cgroups_root: production}\nsteps:\n  - free: []\n",
     "s.yaml:3: $.node.flags.cgroups_root: the flag 'cgroups_root' is set by the runner"),
    ("node:\n  gpus: 4\n  flags: {gpu_allocation: random}\nsteps:\n  - free: []\n",
     "s.yaml:3: $.node.flags: Invalid '--gpu_allocation' 'random': expected one of topology, lowest"),
    (NODE + "steps:\n  - create: {work_dir: /var/lib}\n",
     "s.yaml:3: $.steps[0].create.work_dir: the flag 'work_dir' is set by the runner"),
])
def test_malformed_yaml(text: str, message: str) -> None:
    assert error_of(text).startswith(message)


def test_malformed_json_names_the_line() -> None:
    text = json.dumps({"node": {"gpus": 2}, "steps": [{"prepare": {"id": "a"}}, {"usage": {"id": 3}}]}, indent="\t")
    assert error_of(text, "s.json") == "s.json:13: $.steps[1].usage.id: Expected `str`, got `int`"
    assert error_of('{"node": {"gpus": 2},\n "steps": [\n  {"free": []\n ]}', "s.json").startswith(
        "s.json:4: not valid JSON: JSON is malformed")


def test_yaml_syntax_errors_name_the_line() -> None:
    assert error_of("node: {gpus: 2}\nsteps:\n  - free: [1, 2\n").startswith("s.yaml:4: not valid YAML:")


@pytest.mark.parametrize("text, message", [
    ("[" * 400_000 + "]" * 400_000, "s.yaml:1: the script is nested more than 32 levels deep"),
    ("node: " + "{a: " * 40 + "1" + "}" * 40 + "\nsteps: [{free: []}]\n", "nested more than 32 levels deep"),
    ("a: &a [1,2,3,4,5,6,7,8,9,10]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")),
     "the script expands to more than 200000 values (aliases included)"),
    ("steps:\n  - free: &x [*x]\n", "s.yaml:2: a recursive alias (a value that contains itself)"),
    ("steps:\n  - prepare: {id: a}\n    prepare: {id: b}\n", "s.yaml:3: duplicate key 'prepare' (first on line 2)"),
    ("", "s.yaml: the script is empty"),
    (b"node: {gpus: 2}\nsteps: [{free: []}]\n\xff\n", "s.yaml: not UTF-8 text"),
    ("x" * (MAX_SCRIPT_BYTES + 1), f"s.yaml: the script is {MAX_SCRIPT_BYTES + 1} bytes; the limit is"),
    (NODE + "steps:\n" + "  - concurrent: {steps: [{cleanup: {id: 'c{i}'}}], repeat: 10000}\n" * 11,
     "s.yaml:13: $.steps[10]: the script makes more than 100000 calls"),
], ids=["deep-flow", "deep-mapping", "alias-bomb", "recursive-alias", "duplicate-key", "empty", "not-utf8",
        "too-big", "too-many-calls"])
def test_hostile_scripts_are_one_clear_error(text: str | bytes, message: str) -> None:
    assert message in error_of(text)


def test_a_huge_file_is_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"#" * (MAX_SCRIPT_BYTES * 4))
    with pytest.raises(ScriptError, match=f"huge.yaml: the script is more than {MAX_SCRIPT_BYTES} bytes"):
        load_script_file(str(path))


def test_steps_know_their_lines_and_paths() -> None:
    script = load_script(
        NODE + "steps:\n"
        "  - prepare: {id: a}\n"
        "  - concurrent:\n"
        "      steps:\n"
        "        - cleanup: {id: a}\n"
        "        - usage: {id: a}\n",
        "s.yaml",
    )
    first, group = script.steps
    assert (first.line, first.where, first.action) == (3, "$.steps[0]", "prepare")
    assert (group.line, group.where, group.action) == (4, "$.steps[1]", "concurrent")
    assert [(s.line, s.where) for s in group.concurrent.steps] == [
        (6, "$.steps[1].concurrent.steps[0]"), (7, "$.steps[1].concurrent.steps[1]")]
    assert script.name == "s"


def test_without_libyaml(monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    import isolators.script._loading as script_module

    monkeypatch.setattr(script_module, "_Loader", yaml.SafeLoader)
    assert error_of(NODE + "steps:\n  - prepare:\n      id: 7\n") == (
        "s.yaml:4: $.steps[0].prepare.id: Expected `str`, got `int`")
    assert "s.yaml:1: the script is nested more than 32 levels deep" in error_of("[" * 100_000)
    assert load_script(NODE + "steps:\n  - free: [0]\n").steps[0].line == 3


@pytest.mark.parametrize("rootfs", ["/etc", "../up", "a/../../b", ""])
def test_a_rootfs_stays_inside_the_run(rootfs: str) -> None:
    text = NODE + f"steps:\n  - prepare: {{id: a, rootfs: '{rootfs}'}}\n"
    assert error_of(text).startswith(f"s.yaml:3: $.steps[0].prepare.rootfs: rootfs {rootfs!r} must be a relative name")
