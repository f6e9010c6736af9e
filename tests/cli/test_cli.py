"""The ``gpu-isolator`` command line through its entry point.

``isolators.cli.main(argv)`` returns the exit code: 0 when every expectation
held, 1 when one did not, 2 for bad arguments or a bad script (one line on
stderr, never a traceback). Real subprocesses check ``python -m isolators``
(and a reader that closes the pipe).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.nvml.testing import nvml_library_missing
from isolators import cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gpu-isolator"), err
    for needle in needles:
        assert needle in lines[0], err


# -- --version (R-SH-1) --------------------------------------------------------------
def test_version_prints_the_installed_distributions_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib
    from importlib import metadata

    code, out, err = run(capsys, "--version")
    assert (code, err) == (0, "")
    assert out == f"gpu-isolator {metadata.version('gpu-isolator')}\n"
    # The installed metadata is pyproject.toml's version (what the image's label and the chart's tag carry).
    assert out.split()[1] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([sys.executable, "-m", "isolators", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert (done.returncode, done.stdout, done.stderr) == (0, out, "")


def test_version_without_an_installed_distribution_is_one_error_naming_the_next_step(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    code, out, err = run(capsys, "--version")
    assert (code, out) == (2, "")
    assert_one_line_error(err, "the gpu-isolator distribution is not installed, so it has no version",
                          "pip install .")


# -- demo -------------------------------------------------------------------------
def test_demo_tells_the_story_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "demo")
    assert code == 0, out + err
    assert out.startswith("gpu-isolator demo\n  A simulated node with 8 GPUs in two NVLink islands")
    for line in (
        "prepare train (cpus:4;mem:8192;gpus:2) -> train holds GPUs [0, 1]",
        "prepare big (gpus:4) -> big holds GPUs [4, 5, 6, 7]",
        "update train to gpus:3 -> train holds GPUs [0, 1, 2]",
        "prepare greedy (gpus:2) -> refused as expected: Requested 2 gpus but only 1 available",
        "usage of big -> 4 GPUs: GPU 4 12288/40960 MiB 42% busy 180 W 48 C;",
        "agent restart: drop every actor, rebuild, recover -> recovered ['big', 'train']",
        "cleanup train -> train gone; free GPUs now [0, 1, 2, 3, 4, 5, 6, 7]",
    ):
        assert line in out, line
    assert "FAIL" not in out
    assert "demo on memory: 13 steps, 13 passed, 0 failed in " in out
    assert "every expectation held" in out


# -- run --------------------------------------------------------------------------
def test_run_a_passing_script(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "run", str(EXAMPLES / "quickstart.yaml"))
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0] == f"{EXAMPLES / 'quickstart.yaml'}: quickstart on memory, 6 steps"
    assert "  ok     1  line 14   c1 asks for 2 GPUs and gets two joined by NVLink" in lines
    assert lines[-1].startswith("quickstart on memory: 6 steps, 6 passed, 0 failed in ")
    assert err == ""


def test_run_a_failing_script_exits_1_with_expected_and_actual(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "wrong.yaml"
    script.write_text(
        "node: {gpus: 4}\n"
        "steps:\n"
        "  - prepare: {id: a, resources: 'gpus:2'}\n"
        "    expect: {gpus: [0, 1]}\n"
        "  - name: over-allocation\n"
        "    prepare: {id: b, resources: 'gpus:3'}\n"
        "    expect: {error: 'no such message'}\n"
        "  - free: [3]\n"
    )
    code, out, err = run(capsys, "run", str(script))
    assert code == 1
    assert "  ok     1  line 3    prepare a (gpus:2) -> a holds GPUs [0, 1]" in out
    assert "  FAIL   2  line 5    over-allocation" in out
    assert "expected: an error containing 'no such message'" in out
    assert "actual:   error: Requested 3 gpus but only 2 available" in out
    assert "  FAIL   3  line 8    free GPUs -> the free GPUs differ" in out
    assert "expected: free GPUs [3]" in out and "actual:   free GPUs [2, 3]" in out
    summary = out.splitlines()[-1]
    assert summary.startswith("wrong on memory: 3 steps, 1 passed, 2 failed in ")
    assert summary.endswith(": FAILED (lines 5, 8)")
    assert "Traceback" not in out + err


def test_run_a_bad_script_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "bad.yaml"
    script.write_text("node: {gpus: 4}\nsteps:\n  - prepare:\n      id: a\n      resources: 5\n")
    code, out, err = run(capsys, "run", str(script))
    assert code == 2
    assert out == ""
    assert_one_line_error(
        err, f"gpu-isolator: error: {script}:5: $.steps[0].prepare.resources: Expected `str`, got `int`"
    )


def test_run_a_json_script(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text(
        '{\n\t"node": {"gpus": 2},\n\t"steps": [\n'
        '\t\t{"prepare": {"id": "a", "resources": "gpus:1"}, "expect": {"gpus": [0]}},\n'
        '\t\t{"free": [1]}\n\t]\n}\n'
    )
    code, out, err = run(capsys, "run", str(script))
    assert code == 0, out + err
    assert "  ok     1  line 4    prepare a (gpus:1) -> a holds GPUs [0]" in out
    assert "  ok     2  line 5    free GPUs -> [1]" in out


def test_host_files_are_relative_to_the_script(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "two.toml").write_text("gpu_count = 2\n")
    (tmp_path / "node" / "s.yaml").write_text("node: {host_file: two.toml}\nsteps:\n  - free: [0, 1]\n")
    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "run", str(tmp_path / "node" / "s.yaml"))
    assert code == 0, out + err


def test_run_with_a_missing_host_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("node:\n  host_file: nowhere.toml\nsteps:\n  - free: []\n")
    code, _, err = run(capsys, "run", str(tmp_path / "s.yaml"))
    assert code == 2
    assert_one_line_error(err, "s.yaml:2: $.node.host_file: Cannot read host file", "nowhere.toml")


def test_backend_override_and_root_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = run(capsys, "run", str(EXAMPLES / "quickstart.yaml"), "--backend", "memory")
    assert code == 0 and "quickstart on memory" in out
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, out, err = run(capsys, "run", str(EXAMPLES / "quickstart.yaml"), "--backend", "cgroups_v2")
    assert code == 2 and out == ""
    assert_one_line_error(err, "gpu-isolator run: error: the cgroups_v2 backend needs root")


# -- inspect ----------------------------------------------------------------------
def test_inspect_a_host_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "inspect", "--host-file", str(EXAMPLES / "dgx-8gpu.toml"))
    assert code == 0, err
    assert out.startswith(f"simulated node ({EXAMPLES / 'dgx-8gpu.toml'}), driver 535.161.08, 8 GPUs")
    assert "Tesla V100-SXM2-32GB" in out
    assert "GPU0  X     NV6   NV6   NV6   SYS   SYS   SYS   SYS   0" in out


def test_inspect_the_pcie_box(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "--host-file", str(EXAMPLES / "pcie-4gpu.toml"))
    assert code == 0
    assert "GPU0  X     PIX   SYS   SYS   0" in out


def test_inspect_a_bad_host_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "h.toml").write_text("gpu_count = -1\n")
    code, out, err = run(capsys, "inspect", "--host-file", str(tmp_path / "h.toml"))
    assert code == 2 and out == ""
    assert_one_line_error(err, "gpu-isolator: error: Invalid host file", "gpu_count")


# -- help and bad arguments -----------------------------------------------------------
@pytest.mark.parametrize("argv, usage", [
    (["--help"], "usage: gpu-isolator [-h] [-v] [--version] COMMAND ..."),
    (["demo", "--help"], "usage: gpu-isolator demo [-h]"),
    (["run", "--help"], "usage: gpu-isolator run [-h] [--backend {memory,cgroups_v1,cgroups_v2}] SCRIPT"),
    (["inspect", "--help"], "usage: gpu-isolator inspect [-h] [--host-file FILE | --simulated]"),
])
def test_help(capsys: pytest.CaptureFixture[str], argv: list[str], usage: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    assert out.startswith(usage)


def test_inspect_without_nvml_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with nvml_library_missing():  # no driver, whatever this machine has
        code, out, err = run(capsys, "inspect")
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert err.strip() == (
        "gpu-isolator: error: cannot read this machine's GPUs: nvmlInit failed: NVML Shared Library Not"
        " Found (NVML_ERROR_LIBRARY_NOT_FOUND); is the NVIDIA driver installed and loaded? Without one,"
        " inspect a simulated node: --host-file FILE, or --simulated for the built-in example"
    )


def test_inspect_simulated_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with nvml_library_missing():
        code, out, err = run(capsys, "inspect", "--simulated")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "--simulated: the built-in example node (the demo's), not this machine's GPUs"
    assert lines[1] == "simulated node (<embedded 8-GPU node>.toml), driver 550.54.15, 8 GPUs"
    code, out, err = run(capsys, "inspect", "--simulated", "--host-file", "x.toml")
    assert code == 2 and out == ""
    assert_one_line_error(err, "argument --host-file: not allowed with argument --simulated")


@pytest.mark.parametrize("argv, message", [
    ([], "gpu-isolator: error: the following arguments are required: COMMAND (see 'gpu-isolator --help')"),
    (["frobnicate"], "gpu-isolator: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["run"], "gpu-isolator run: error: the following arguments are required: SCRIPT"),
    (["run", "x.yaml", "--backend", "gpu"], "gpu-isolator run: error: argument --backend: invalid choice: 'gpu'"),
    (["inspect", "--host-file"], "gpu-isolator inspect: error: argument --host-file: expected one argument"),
    (["demo", "extra"], "gpu-isolator: error: unrecognized arguments: extra"),
    (["bench"], "gpu-isolator: error: argument COMMAND: invalid choice: 'bench' (choose from 'demo', 'run', 'inspect', 'cdi', 'serve', 'exec', 'status', 'ledger', 'kubelet-plugin', 'dra-plugin')"),
    (["run", "/no/such/script.yaml"], "gpu-isolator: error: Cannot read script '/no/such/script.yaml'"),
])
def test_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_line_error(err, message)


@pytest.mark.parametrize("argv", [["run", str(EXAMPLES / "quickstart.yaml")], ["demo"]], ids=["run", "demo"])
def test_an_internal_error_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                       argv: list[str]) -> None:
    import isolators

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something broke")

    monkeypatch.setattr(isolators, "run_script", broken)
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, "gpu-isolator: internal error: RuntimeError: something broke",
                          "run with --verbose for the traceback")


def test_a_bad_id_in_a_script_is_named_as_given(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``prepare: {id: "../x"}``: the error names '../x', not one of its dotted parts."""
    script = tmp_path / "ids.yaml"
    script.write_text('node: {gpus: 2}\nsteps:\n  - prepare: {id: "../x"}\n  - prepare: {id: "a./b"}\n')
    code, out, err = run(capsys, "run", str(script))
    assert code == 1, out + err
    assert ("actual:   error: Invalid container id '../x': '.' separates the ids of a nested container"
            " (parent.child), and part 1 of 3 ('') is not an id: it must not be empty") in out
    assert ("actual:   error: Invalid container id 'a./b': '.' separates the ids of a nested container"
            " (parent.child), and part 2 of 2 ('/b') is not an id: it contains '/'") in out
    assert "Invalid container id ''" not in out


# -- a real process -------------------------------------------------------------------
def test_python_m_isolators(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    demo = subprocess.run([sys.executable, "-m", "isolators", "demo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "every expectation held" in demo.stdout
    (tmp_path / "bad.yaml").write_text("node: {gpus: 2}\nsteps:\n  - reboot: {}\n")
    bad = subprocess.run([sys.executable, "-m", "isolators", "run", "bad.yaml"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == (
        "gpu-isolator: error: bad.yaml:3: $.steps[0].reboot: unknown step 'reboot': a step holds one action"
        " (prepare, update, usage, cleanup, recover, create, concurrent, advance, restart, free, held,"
        " reconcile, mark_unhealthy, mark_healthy, free_mig) plus optional 'name' and 'expect'"
    )


@pytest.mark.parametrize("argv", [["inspect", "--simulated"], ["demo"]], ids=["inspect", "demo"])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(tmp_path: Path, argv: list[str]) -> None:
    """``gpu-isolator inspect --simulated | head``: the reader is gone before
    the first line is written; the command ends with no message (status 141,
    as if SIGPIPE ended it), like other command-line tools."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader closed it: every write fails with EPIPE
    try:
        ended = subprocess.run([sys.executable, "-m", "isolators", *argv], cwd=tmp_path, stdout=write_end,
                               stderr=subprocess.PIPE, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.close(write_end)
    assert (ended.returncode, ended.stderr) == (141, "")


def test_the_installed_command_outside_the_source_tree(tmp_path: Path) -> None:
    """The console script as a user runs it: no source tree on sys.path."""
    script = Path(sys.executable).parent / "gpu-isolator"
    if not script.exists():
        pytest.skip(f"the gpu-isolator console script is not installed next to {sys.executable}"
                    " (python -m pip install -e .)")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}

    def run_installed(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(script), *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)

    demo = run_installed("demo")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "A simulated node with 8 GPUs" in demo.stdout and "every expectation held" in demo.stdout
    simulated = run_installed("inspect", "--simulated")
    assert simulated.returncode == 0, simulated.stderr
    assert simulated.stdout.startswith("--simulated: the built-in example node")
    # The benchmark is not part of the installed package: no half-working command.
    bench = run_installed("bench")
    assert bench.returncode == 2 and bench.stdout == ""
    assert bench.stderr.startswith("gpu-isolator: error: argument COMMAND: invalid choice: 'bench'")
    for argv in (["run", "missing.yaml"], ["inspect", "--host-file", "missing.toml"], ["frobnicate"]):
        failed = run_installed(*argv)
        assert failed.returncode == 2, (argv, failed.stdout, failed.stderr)
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
