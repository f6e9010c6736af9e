"""The ``gpu-isolator`` command line (also ``python -m isolators``).

Commands:
- ``demo``: the built-in script (``isolators/demo/demo.yaml``) on a simulated
  8-GPU node with in-memory devices: no root, no GPU.
- ``run SCRIPT [--backend B]``: run a message script, printing each step as it
  completes and a summary.
- ``inspect [--host-file F]``: the node's GPUs and topology (the real NVML
  without ``--host-file``; the embedded simulated node when no driver).
- ``bench [...]``: the container churn benchmark; every argument after
  ``bench`` goes to ``benchmarks.churn`` (a source checkout only).

Exit codes: 0 when every expectation held (or the command succeeded); 1 when
a script ran and an expectation did not hold; 2 for bad arguments, a bad
script or a node that cannot start: one line on stderr
(``gpu-isolator: error: ...``), never a traceback (``--verbose`` adds one
for unexpected errors); 130 on Ctrl-C. ``main(argv)`` returns the code
instead of exiting, so tests call it directly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback
from importlib import resources as importlib_resources
from typing import Any, Awaitable, Callable, NoReturn, Sequence

from runtime import Failure, Runtime

PROG = "gpu-isolator"
BACKENDS = ("memory", "cgroups_v1", "cgroups_v2")
_GLOBAL_OPTIONS = ("-v", "--verbose")

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """Bad command-line arguments (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that raise instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Apache Mesos' NVIDIA GPU isolator on an actor runtime: give every container"
                    " exactly the GPUs it was granted.",
        epilog="Start with '%(prog)s demo'. Each command has its own --help.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what the isolator does (INFO) to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    demo = sub.add_parser(
        "demo", help="run the built-in demo on a simulated 8-GPU node (no root, no GPU)",
        description="Run the built-in demo script: a simulated 8-GPU node (two NVLink islands of four)"
                    " with in-memory device control. Shows prepare, topology-aware picks, an update,"
                    " a refused over-allocation, usage, an agent restart with recovery and cleanup.",
    )
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser(
        "run", help="run a message script (YAML or JSON)",
        description="Run a message script: print each step and its outcome, then a summary."
                    " Exit 0 only if every expectation held, 1 if one did not, 2 for a bad script.",
    )
    run.add_argument("script", metavar="SCRIPT", help="path to a .yaml or .json script")
    run.add_argument("--backend", choices=BACKENDS,
                     help="device control backend (default: the script's node.backend); the cgroups"
                          " backends need root and create cgroups only under a root of their own")
    run.set_defaults(func=_cmd_run)

    inspect = sub.add_parser(
        "inspect", help="show the node's GPUs and topology",
        description="Show the GPUs NVML reports and their topology matrix (like 'nvidia-smi topo -m')."
                    " Without --host-file: the real NVML, or the embedded simulated node when no"
                    " NVIDIA driver is present.",
    )
    inspect.add_argument("--host-file", metavar="FILE", help="a simulated node (TOML or JSON host file)")
    inspect.set_defaults(func=_cmd_inspect)

    bench = sub.add_parser(
        "bench", add_help=False, help="container churn benchmark (benchmarks.churn)",
        description="Concurrent container churn against the raw-kernel floor. Every argument after"
                    " 'bench' goes to benchmarks.churn ('%(prog)s --help' shows its options).",
    )
    bench.set_defaults(func=_cmd_bench, bench_parser=bench)
    return parser


def _run_async(make: Callable[[], Awaitable[int]]) -> int:
    async def main() -> int:
        async with Runtime():
            return await make()

    return asyncio.run(main())


def _print(line: str) -> None:
    print(line, flush=True)


def _check_backend(backend: str) -> None:
    if backend in ("cgroups_v1", "cgroups_v2") and os.geteuid() != 0:
        raise UsageError(f"{PROG} run: error: the {backend} backend needs root; run as root or use"
                         " --backend memory")


async def _run_loaded(script: Any, backend: str | None) -> int:
    from ._script import run_script

    report = await run_script(script, backend, echo=_print)
    return 0 if report.passed else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._script import load_script

    text = importlib_resources.files("isolators").joinpath("demo", "demo.yaml").read_bytes()
    script = load_script(text, "demo.yaml")
    print(
        "gpu-isolator demo\n"
        "  A simulated node with 8 GPUs in two NVLink islands (GPUs 0-3 and 4-7), device\n"
        "  control kept in memory: no root and no GPU needed. Each step below is one call\n"
        "  to the isolator actor; 'ok' means it did what the script expected.\n",
        flush=True,
    )
    code = _run_async(lambda: _run_loaded(script, None))
    print(
        "\nNext: 'gpu-isolator inspect' shows a node's GPUs and topology; 'gpu-isolator run SCRIPT'\n"
        "runs your own scenario (examples/ and tests/scripts/ in the source tree have some).",
        flush=True,
    )
    return code


def _cmd_run(args: argparse.Namespace) -> int:
    from ._script import load_script_file

    script = load_script_file(args.script)
    backend = args.backend or script.node.backend
    _check_backend(backend)
    _print(f"{args.script}: {script.name} on {backend}, {len(script.steps)} steps"
           + (f"\n  {script.description}" if script.description else ""))
    return _run_async(lambda: _run_loaded(script, backend))


def _cmd_inspect(args: argparse.Namespace) -> int:
    from actors import NvmlService, render_inventory

    async def show() -> int:
        service = await NvmlService.open(args.host_file, fallback=True)
        try:
            inventory = await service.inventory()
        finally:
            await service.close()
        print(render_inventory(inventory), flush=True)
        return 0

    return _run_async(show)


def _cmd_bench(args: argparse.Namespace) -> int:
    bench_args: list[str] = args.bench_args
    try:
        from benchmarks import churn
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.churn"):
            raise
        if any(a in ("-h", "--help") for a in bench_args):
            args.bench_parser.print_help()
        raise Failure("the churn benchmark is not installed with this package; run it from a source"
                      " checkout: python -m benchmarks.churn --help") from None
    code = churn.main(bench_args)
    return int(code or 0)


def _split_bench(argv: list[str]) -> tuple[list[str], list[str]]:
    """Everything after ``bench`` belongs to the benchmark, options included."""
    for i, arg in enumerate(argv):
        if arg == "bench":
            return argv[: i + 1], argv[i + 1:]
        if arg not in _GLOBAL_OPTIONS:
            break
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see module rules)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, bench_args = _split_bench(argv)
    verbose = any(a in _GLOBAL_OPTIONS for a in argv)
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0) if not isinstance(e.code, str) else 2
        args.bench_args = bench_args
        logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                            format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # a delegated command (bench) exiting
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except UsageError as e:
        print(f"{e}", file=sys.stderr)
        return 2
    except (Failure, ValueError, OSError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, the traceback with --verbose
        if verbose:
            traceback.print_exc()
        print(f"{PROG}: internal error: {type(e).__name__}: {_one_line(e)}"
              + ("" if verbose else " (run with --verbose for the traceback)"), file=sys.stderr)
        return 2


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
