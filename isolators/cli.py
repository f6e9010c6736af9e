"""The ``gpu-isolator`` command line.

Commands:
- ``demo``: the built-in script on a simulated 8-GPU node, in-memory devices.
- ``run SCRIPT [--backend B]``: run a message script; exit 0 only if every
  expectation held, 1 if one did not, 2 for a bad script or bad arguments.
- ``inspect [--host-file F]``: the node's GPUs and topology (real NVML
  without ``--host-file``).
- ``bench [...]``: the container churn benchmark (``benchmarks.churn``).

Errors are one line on stderr (``gpu-isolator: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from importlib import resources as importlib_resources
from typing import Sequence

from runtime import Failure, Runtime

PROG = "gpu-isolator"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Mesos' NVIDIA GPU isolator on an actor runtime: give every container exactly its GPUs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every isolator line to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="run the built-in demo on a simulated 8-GPU node (no root, no GPU)",
                          description="Run the built-in demo script on a simulated 8-GPU NVLink node with in-memory devices.")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser("run", help="run a message script (YAML or JSON)",
                         description="Run a message script; exit 0 only if every expectation holds.")
    run.add_argument("script", help="path to a .yaml or .json script")
    run.add_argument("--backend", choices=["memory", "cgroups_v1", "cgroups_v2"],
                     help="device backend (default: the script's node.backend)")
    run.set_defaults(func=_cmd_run)

    inspect = sub.add_parser("inspect", help="show the node's GPUs and topology",
                             description="Show the GPUs NVML reports (or a simulated node's) and their topology.")
    inspect.add_argument("--host-file", help="a simulated node (TOML or JSON); default: the real NVML")
    inspect.set_defaults(func=_cmd_inspect)

    bench = sub.add_parser("bench", help="container churn benchmark",
                           description="Concurrent container churn against the raw-kernel floor.")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for benchmarks.churn (see --help there)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def _run_async(coro) -> int:
    async def main() -> int:
        async with Runtime():
            return await coro

    return asyncio.run(main())


def _print(line: str) -> None:
    print(line, flush=True)


async def _run_loaded(script, backend: str | None) -> int:
    from ._script import run_script

    report = await run_script(script, backend, echo=_print)
    return 0 if report.passed else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._script import load_script

    text = importlib_resources.files("isolators").joinpath("demo/demo.yaml").read_text()
    script = load_script(text, "demo.yaml")
    print("gpu-isolator demo: a simulated 8-GPU node (two NVLink islands of 4), in-memory device control\n")
    return _run_async(_run_loaded(script, None))


def _cmd_run(args: argparse.Namespace) -> int:
    from ._script import load_script_file

    script = load_script_file(args.script)
    if args.backend in ("cgroups_v1", "cgroups_v2") and os.geteuid() != 0:
        raise Failure(f"the {args.backend} backend needs root; use --backend memory")
    return _run_async(_run_loaded(script, args.backend))


def _cmd_inspect(args: argparse.Namespace) -> int:
    from actors import render_inventory

    print(render_inventory(args.host_file))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks import churn

    return churn.main(args.args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (Failure, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
