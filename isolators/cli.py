"""The ``gpu-isolator`` command line (also ``python -m isolators``).

Commands:
- ``--version``: ``gpu-isolator VERSION``, the installed distribution's version
  (``importlib.metadata``; SPEC R-SH-1), what the image's labels and tag carry.
- ``demo``: the built-in script (``isolators/demo/demo.yaml``) on a simulated
  8-GPU node with in-memory devices: no root, no GPU.
- ``run SCRIPT [--backend B]``: run a message script, printing each step as it
  completes and a summary.
- ``inspect [--host-file F | --simulated]``: the node's GPUs and topology:
  the real NVML (R-NV-1: without a usable NVML this is an error, never a
  made-up node), a host file's simulated node, or, when asked for by
  ``--simulated``, the embedded 8-GPU example node; a simulated node says
  so on its first line.
- ``cdi generate [--host-file F] [--dev-dir D] [--format json|yaml]
  [--output PATH]``: the node's static CDI spec (``isolators.cdi``); JSON
  on stdout is the document alone. A ``--host-file`` node reads no fact of
  this machine unless asked (``--ld-cache``, ``--proc-dir``): its driver
  volume copies no library or binary of this machine.
- ``serve``, ``exec``, ``status``: the isolator as a service and its
  clients (``isolators.service``; SPEC section 16).
- ``ledger [--json]``, ``ledger release --owner OWNER``: the node ledger
  (``isolators._ledger_command``; SPEC section 22): which front door holds
  each unit of the node, and the operator's release of a dead one's.
- ``kubelet-plugin``: the Kubernetes device plugin (``isolators.kubernetes.device_plugin``;
  SPEC section 18).
- ``dra-plugin``: the Kubernetes DRA driver (``isolators.kubernetes.dra``; SPEC
  section 21).
- The churn benchmark is not a command: it lives in the source tree
  (``python -m benchmarks.churn`` from a checkout), not in the installed
  package.

An installation the running user cannot read (a checkout or venv under a
0700 home, run by another user) is named as such when one of this
project's own modules fails to import: which path that user cannot read,
and that the installation must be readable by the user running it (exit
2), never an "internal error".

Exit codes: 0 when every expectation held (or the command succeeded); 1 when
a script ran and an expectation did not hold; 2 for bad arguments, a bad
script or a node that cannot start (no NVML included): one line on stderr
(``gpu-isolator: error: ...``), never a traceback (``--verbose`` adds one
for unexpected errors); 130 on Ctrl-C. Every error of every command exits
non-zero. A reader that closes the pipe early (``gpu-isolator inspect |
head``) ends the command quietly, as other CLIs do: no message, status 141
(128 + SIGPIPE, what a process the signal ended reports), and nothing more
is written to the closed pipe. ``main(argv)`` returns the code instead of
exiting, so tests call it directly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import traceback
from importlib import resources as importlib_resources
from typing import Any, Awaitable, Callable, NoReturn, Sequence

from actors.flags import KERNEL_BACKENDS, NODE_BACKENDS
from runtime import Failure, Runtime

PROG = "gpu-isolator"
_GLOBAL_OPTIONS = ("-v", "--verbose")

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """Bad command-line arguments (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that raise instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


class _Version(argparse.Action):
    """``--version``: ``gpu-isolator VERSION``, the installed distribution's
    version (its metadata, what the image's label and the chart's tag name),
    read only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        print(f"{PROG} {version()}")
        parser.exit()


def version() -> str:
    """The installed ``gpu-isolator`` distribution's version (its metadata);
    an ``OSError`` naming the next step when it is not installed (a bare
    checkout on ``sys.path``)."""
    from importlib import metadata

    try:
        return metadata.version(PROG)
    except metadata.PackageNotFoundError:
        raise OSError(f"the {PROG} distribution is not installed, so it has no version: install it"
                      " ('pip install .' or 'pip install -e .')") from None


def _commands(parser: argparse.ArgumentParser, dest: str, required: bool = True) -> Any:
    """``parser``'s sub-commands, each a ``_Parser`` (its usage errors name it)."""
    return parser.add_subparsers(dest=dest, metavar="COMMAND", parser_class=_Parser, required=required)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Apache Mesos' NVIDIA GPU isolator on an actor runtime: give every container"
                    " exactly the GPUs it was granted.",
        epilog="Start with '%(prog)s demo'. Each command has its own --help.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what the isolator does (INFO) to stderr")
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    sub = _commands(parser, "command")

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
    run.add_argument("--backend", choices=NODE_BACKENDS,
                     help="device control backend (default: the script's node.backend); the cgroups"
                          " backends need root and create cgroups only under a root of their own")
    run.set_defaults(func=_cmd_run)

    inspect = sub.add_parser(
        "inspect", help="show the node's GPUs and topology",
        description="Show the GPUs NVML reports and their topology matrix (like 'nvidia-smi topo -m')."
                    " Without an option: this machine's GPUs through the real NVML (an error when"
                    " NVML is not available). --host-file or --simulated show a simulated node instead.",
    )
    node = inspect.add_mutually_exclusive_group()
    node.add_argument("--host-file", metavar="FILE", help="a simulated node (TOML or JSON host file)")
    node.add_argument("--simulated", action="store_true",
                      help="the embedded simulated 8-GPU example node (the demo's), not this machine's GPUs")
    inspect.set_defaults(func=_cmd_inspect)

    cdi = sub.add_parser(
        "cdi", help="CDI specs for container engines (podman, containerd, CRI-O, Docker)",
        description="CDI (Container Device Interface) specs: what podman, containerd, CRI-O and Docker read"
                    " from /etc/cdi and /var/run/cdi to inject devices.",
    )
    cdi_sub = _commands(cdi, "cdi_command")
    generate = cdi_sub.add_parser(
        "generate", help="the node's static CDI spec (kind nvidia.com/gpu)",
        description="Write the node's static CDI spec, kind nvidia.com/gpu: one device per GPU named by its"
                    " index and one named by its UUID, one per MIG device named '<gpu>:<mig index>' and one by"
                    " its MIG UUID, plus 'all'; the shared edits hold the control devices"
                    " and the driver volume (built under --volume-dir). Reads the real NVML, or --host-file;"
                    " without either it fails. JSON on stdout unless --output.",
    )
    generate.add_argument("--host-file", metavar="FILE", help="a simulated node (TOML or JSON host file)")
    generate.add_argument("--dev-dir", metavar="DIR", default="/dev",
                          help="where the nvidia* device nodes are (default: /dev)")
    generate.add_argument("--volume-dir", metavar="DIR", default=None,
                          help="where the driver volume is built (default: the isolator's,"
                               " /var/run/gpu-isolator/volume)")
    generate.add_argument("--proc-dir", metavar="DIR", default=None,
                          help="where the MIG capability facts are read (driver/nvidia-caps/mig-minors, devices;"
                               " default: /proc; a --host-file node reads none unless given)")
    generate.add_argument("--ld-cache", metavar="FILE", default=None,
                          help="the loader cache the driver libraries are found in (default: /etc/ld.so.cache;"
                               " a --host-file node's volume copies no library or binary of this machine"
                               " unless given)")
    generate.add_argument("--cdi-hook", metavar="PATH", default=None,
                          help="the program container engines run on the host for the loader-cache hook"
                               " (<PATH> update-ldcache ...; e.g. /usr/local/bin/gpu-isolator-cdi-hook; default:"
                               " this installation's Python running the hook)")
    generate.add_argument("--format", choices=("json", "yaml"), default=None,
                          help="json or yaml (default: from --output's extension, else json)")
    generate.add_argument("--output", metavar="PATH",
                          help="write the spec to PATH (atomically; e.g. /etc/cdi/nvidia.yaml) instead of stdout")
    generate.set_defaults(func=_cmd_cdi_generate)

    from ._ledger_command import add_command as add_ledger_command
    from .kubernetes import add_commands as add_kubernetes_commands  # kubelet-plugin, dra-plugin
    from .service import add_commands  # serve, exec, status

    add_commands(sub)
    add_ledger_command(sub)
    add_kubernetes_commands(sub)
    return parser


def _run_async(make: Callable[[], Awaitable[int]]) -> int:
    async def main() -> int:
        async with Runtime():
            return await make()

    return asyncio.run(main())


def _print(line: str) -> None:
    print(line, flush=True)


def _check_backend(backend: str) -> None:
    if backend in KERNEL_BACKENDS and os.geteuid() != 0:
        raise UsageError(f"{PROG} run: error: the {backend} backend needs root; run as root or use"
                         " --backend memory")


async def _run_loaded(script: Any, backend: str | None) -> int:
    from . import run_script

    report = await run_script(script, backend, echo=_print)
    return 0 if report.passed else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import load_script

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
    from . import load_script_file

    script = load_script_file(args.script)
    backend = args.backend or script.node.backend
    _check_backend(backend)
    _print(f"{args.script}: {script.name} on {backend}, {len(script.steps)} steps"
           + (f"\n  {script.description}" if script.description else ""))
    return _run_async(lambda: _run_loaded(script, backend))


def _cmd_inspect(args: argparse.Namespace) -> int:
    from actors.nvml import NvmlError, NvmlService, embedded_simulated_node

    from .inventory_table import render_inventory

    async def show() -> int:
        if args.simulated:
            service = NvmlService(embedded_simulated_node())
            _print("--simulated: the built-in example node (the demo's), not this machine's GPUs")
        else:
            try:
                service = await NvmlService.open(args.host_file)
            except NvmlError as e:
                if args.host_file is not None:
                    raise
                raise Failure(
                    f"cannot read this machine's GPUs: {e.headline}; is the NVIDIA driver installed and"
                    " loaded? Without one, inspect a simulated node: --host-file FILE, or --simulated"
                    " for the built-in example"
                ) from None
        try:
            inventory = await service.inventory()
        finally:
            await service.close()
        print(render_inventory(inventory), flush=True)
        return 0

    return _run_async(show)


def _cmd_cdi_generate(args: argparse.Namespace) -> int:
    from actors.flags import Flags
    from actors.nvml import NvmlUnavailable

    from .cdi import encode_spec, generate_node_spec, spec_format, write_spec_file

    output = os.path.abspath(args.output) if args.output else None
    spec_kind = args.format
    if output is not None:
        try:
            from_name = spec_format(output)
        except ValueError:
            raise UsageError(f"{PROG} cdi generate: error: --output {args.output!r} must end in .json or .yaml"
                             " (engines read no other names)") from None
        if spec_kind is not None and spec_kind != from_name:
            raise UsageError(f"{PROG} cdi generate: error: --format {spec_kind} does not match --output"
                             f" {args.output!r} (engines read a file by its extension)")
        spec_kind = from_name
    defaults = Flags()
    flags = Flags(host_file=args.host_file, dev_dir=args.dev_dir, proc_dir=args.proc_dir or defaults.proc_dir,
                  volume_dir=args.volume_dir or defaults.volume_dir, ld_cache=args.ld_cache or defaults.ld_cache,
                  cdi_hook=args.cdi_hook)
    real = args.host_file is None  # a simulated node reads no fact of this machine unless asked

    async def generate() -> int:
        try:
            spec = await generate_node_spec(flags, loader_cache=real or args.ld_cache is not None,
                                            kernel_facts=real or args.proc_dir is not None)
        except NvmlUnavailable as error:  # the library's hint names the flag; here it is an option
            raise Failure(f"{error.headline}; is the NVIDIA driver installed and loaded?"
                          " Without a GPU, pass --host-file FILE to describe a simulated node") from error
        data = encode_spec(spec, spec_kind or "json")
        if output is None:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        else:
            write_spec_file(os.path.dirname(output), os.path.basename(output), data)
            _print(f"Wrote {output}: kind {spec.kind}, cdiVersion {spec.cdi_version}, devices "
                   + ", ".join(spec.qualified_names()))
        return 0

    return _run_async(generate)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see module rules)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in _GLOBAL_OPTIONS for a in argv)
    try:
        parser = _parser()
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0) if not isinstance(e.code, str) else 2
        if extra and not getattr(args, "accepts_flags", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra  # serve: the isolator's flags (--name=value)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                            format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _stdout_to_devnull()  # the interpreter's last flush must not hit the closed pipe again
        return PIPE_CLOSED
    except UsageError as e:
        print(f"{e}", file=sys.stderr)
        return 2
    except (Failure, ValueError, OSError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except ImportError as e:
        unreadable = _unreadable_installation(e)
        if unreadable is None:
            raise
        print(f"{PROG}: error: {unreadable}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, the traceback with --verbose
        if verbose:
            traceback.print_exc()
        print(f"{PROG}: internal error: {type(e).__name__}: {_one_line(e)}"
              + ("" if verbose else " (run with --verbose for the traceback)"), file=sys.stderr)
        return 2


PIPE_CLOSED = 128 + signal.SIGPIPE
"""The status of a command whose reader closed the pipe (see module rules)."""


def _stdout_to_devnull() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no stdout to speak of: nothing will be flushed to it
        pass


OWN_PACKAGES = ("runtime", "actors", "isolators")


def _unreadable_installation(error: ImportError) -> str | None:
    """What to say when one of this project's modules failed to import
    because the running user cannot read the installation (None: another
    cause, a bug to report as one)."""
    name = error.name or ""
    if name.split(".")[0] not in OWN_PACKAGES:
        return None
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):  # the deepest package already imported
        package = sys.modules.get(".".join(parts[:depth]))
        if package is not None and getattr(package, "__path__", None):
            break
    else:
        return None
    directory = os.path.abspath(list(package.__path__)[0])
    blocked = _first_unreadable(directory)
    if blocked is None:
        return None
    try:
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        user = str(os.getuid())
    try:
        info = os.stat(blocked)
        whose = f" (mode {info.st_mode & 0o7777:04o}, owner uid {info.st_uid})"
    except OSError:
        whose = ""
    return (f"cannot import {name}: this installation ({directory}) is not readable by user {user} "
            f"(uid {os.getuid()}): {blocked}{whose} is in the way. The installation must be readable by the user "
            f"running {PROG}: install it where that user can read it (e.g. a venv under /opt), or run it as "
            f"its owner")


def _first_unreadable(directory: str) -> str | None:
    """The first path from / down to ``directory`` this process may not
    traverse (or, for ``directory`` itself, list); None when all may be."""
    path = os.sep
    for part in [p for p in directory.split(os.sep) if p]:
        if not os.access(path, os.X_OK):
            return path
        path = os.path.join(path, part)
    return None if os.access(path, os.R_OK | os.X_OK) else path


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
