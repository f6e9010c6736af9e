"""The image's build context: the wheelhouse the ``Containerfile`` installs
from, offline (SPEC R-SH-1). One place for the docs' commands and the
tests' build (``tests/image``).

Rules:
- ``Containerfile`` (at the repository root) installs ``gpu-isolator==VERSION``
  with ``pip install --no-index --find-links`` from ``wheelhouse/`` of its
  build context: no index, no network inside the build. This module makes
  that wheelhouse outside the build, with the network pip is configured
  for; ``.dockerignore`` (which podman reads too) sends only
  ``wheelhouse/`` to the build.
- ``wheelhouse(directory)``: the project's own wheel (``pip wheel
  --no-deps``, built from a copy of its sources, never in the checkout: a
  stale ``build/`` there could ship deleted modules) and every runtime
  dependency's wheel as ``pip download`` picks it for the image's Python
  (``python_version``, default 3.11: the default base's and Debian
  bookworm's ``python3``), CPython on glibc ``glibc`` (default 2.36,
  bookworm's) for ``machine`` (default this one's). Binary wheels only: the
  build has no compiler. The ``*.whl`` files a previous run left there are
  removed first, so the wheelhouse holds one version of each.
- ``debian_base(tar)``: a base without a registry, from Debian's packages:
  ``mmdebstrap`` (as root; it reaches Debian's mirror) of ``bookworm``'s
  essential packages with ``python3``, ``python3-venv``, ``libstdc++6``
  (grpcio's compiled module needs it) and ``mount`` (the MPS daemons'
  launcher binds a unit's shared memory with it; Debian's slim images have
  it, the essential set does not), without
  manuals, docs (copyright files kept) and locales, dpkg's fsyncs skipped
  (mmdebstrap's eatmydata hook), as a tarball for ``podman import``. The
  ``essential`` variant, not ``apt``: an image installs nothing after its
  build, and fewer packages unpack faster.
- ``context(directory)``: a build context of its own (the ``Containerfile``,
  ``.dockerignore`` and the wheelhouse) outside the checkout, for builds
  that must not write into it (the tests).
- ``VERSION`` is ``pyproject.toml``'s version: the ``Containerfile``'s
  default ``VERSION`` argument must equal it (a test holds them together),
  and the build checks that the installed ``gpu-isolator --version`` says
  it.
- ``python -m scripts.image wheelhouse [DIR]`` makes ``DIR`` (default
  ``wheelhouse/`` of the checkout, what ``podman build .`` reads);
  ``python -m scripts.image debian-base TAR`` makes a Debian base. Each
  command run is printed; a failed one is the error (exit 1).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "Containerfile"
IGNORE_FILE = ROOT / ".dockerignore"
WHEELHOUSE = "wheelhouse"
"""The wheelhouse's directory in a build context (what the Containerfile copies)."""

_PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DISTRIBUTION: str = _PYPROJECT["project"]["name"]
VERSION: str = _PYPROJECT["project"]["version"]
PYTHON_VERSION = "3.11"
"""The default base's Python (python:3.11-slim-bookworm) and Debian bookworm's python3."""
GLIBC = "2.36"
"""Debian bookworm's glibc: the newest manylinux tag the image's Python takes."""
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "libstdc++6", "mount")
"""What a Debian base needs for the Containerfile: python3, its venv module, the C++ runtime grpcio's
compiled module loads (manylinux wheels take it from the system; Debian's slim images have it, with apt),
and ``mount``, which the MPS daemons' launcher runs (``actors.mps``; util-linux's ``unshare`` is essential)."""
EATMYDATA = Path("/usr/share/mmdebstrap/hooks/eatmydata")
"""mmdebstrap's hook that runs dpkg without fsync (a root filesystem is written once, then packed)."""
_SOURCE_FILES = ("pyproject.toml", "README.md")
_SOURCE_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o", "*.egg-info")


class BuildError(Exception):
    """A step of the wheelhouse failed: the command and its output."""


def _run(argv: Sequence[str], timeout: float) -> None:
    print("+", shlex.join(argv), flush=True)
    try:
        done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise BuildError(f"{shlex.join(argv)} did not finish within {timeout:g}s") from error
    if done.returncode != 0:
        raise BuildError(f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stdout.strip()}")


def _package_dirs() -> list[Path]:
    """The import packages' directories (pyproject's ``packages.find`` include patterns)."""
    patterns = _PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(p for p in ROOT.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists() and any(fnmatch.fnmatch(p.name, x) for x in patterns))


def platforms(machine: str, glibc: str = GLIBC) -> list[str]:
    """The ``--platform`` tags of a glibc ``glibc`` Linux on ``machine``, newest first
    (manylinux_2_17 is manylinux2014's other name, the oldest binary wheels in use)."""
    major, minor = (int(part) for part in glibc.split("."))
    if major != 2 or minor < 17:
        raise ValueError(f"glibc {glibc!r}: expected 2.17 or newer (as 2.36)")
    return [f"manylinux_2_{m}_{machine}" for m in range(minor, 16, -1)] + [f"manylinux2014_{machine}"]


def wheelhouse(directory: str | os.PathLike[str], *, python_version: str = PYTHON_VERSION, glibc: str = GLIBC,
               machine: str | None = None, timeout: float = 300.0) -> list[Path]:
    """Make ``directory`` the image's wheelhouse (see module rules); its wheels, sorted."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="gpu-isolator-sources-") as scratch:
        sources = Path(scratch) / "src"
        sources.mkdir()
        for name in _SOURCE_FILES:
            shutil.copy2(ROOT / name, sources / name)
        for package in _package_dirs():
            shutil.copytree(package, sources / package.name, ignore=_SOURCE_IGNORE)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
              "--wheel-dir", str(directory), str(sources)], timeout)
    [own] = directory.glob(f"{DISTRIBUTION.replace('-', '_')}-{VERSION}-*.whl")
    major, minor = python_version.split(".")
    target = [option for tag in platforms(machine or platform.machine(), glibc) for option in ("--platform", tag)]
    _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
          *target, "--python-version", python_version, "--implementation", "cp", "--abi", f"cp{major}{minor}",
          "--dest", str(directory), str(own)], timeout)
    return sorted(directory.glob("*.whl"))


def debian_base_command(tar: str | os.PathLike[str], suite: str = DEBIAN_SUITE) -> list[str]:
    """The ``mmdebstrap`` command of ``debian_base`` (see module rules)."""
    command = ["mmdebstrap", "--variant=essential", f"--include={','.join(DEBIAN_PACKAGES)}",
               *(f"--dpkgopt=path-exclude=/usr/share/{part}/*" for part in ("man", "doc", "info", "locale")),
               "--dpkgopt=path-include=/usr/share/doc/*/copyright"]
    if EATMYDATA.is_dir():
        command.append(f"--hook-directory={EATMYDATA}")
    return [*command, suite, str(tar)]


def debian_base(tar: str | os.PathLike[str], suite: str = DEBIAN_SUITE, timeout: float = 600.0) -> Path:
    """A base image's root filesystem made from Debian's packages, as the tarball ``tar`` (see rules)."""
    if shutil.which("mmdebstrap") is None:
        raise BuildError("mmdebstrap is not installed (apt-get install -y mmdebstrap)")
    _run(debian_base_command(tar, suite), timeout)
    return Path(tar)


def context(directory: str | os.PathLike[str], **options: object) -> Path:
    """A build context at ``directory``: the Containerfile, the ignore file and a wheelhouse (see rules)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy2(CONTAINERFILE, directory / CONTAINERFILE.name)
    shutil.copy2(IGNORE_FILE, directory / IGNORE_FILE.name)
    wheelhouse(directory / WHEELHOUSE, **options)  # type: ignore[arg-type]
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.image",
        description="Make the image's build context: the wheels the Containerfile installs offline.",
        epilog=f"Then: podman build -t REGISTRY/{DISTRIBUTION}:{VERSION} .",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    house = commands.add_parser(
        "wheelhouse", help="the project's wheel and its dependencies' wheels, for the image's Python",
        description="Build the project's wheel and download its dependencies' binary wheels for the"
                    " image's Python into DIR (its old wheels removed first).")
    house.add_argument("directory", metavar="DIR", nargs="?", default=str(ROOT / WHEELHOUSE),
                       help=f"where (default: {WHEELHOUSE}/ of the checkout, what 'podman build .' reads)")
    house.add_argument("--python-version", default=PYTHON_VERSION,
                       help=f"the image's Python, MAJOR.MINOR (default {PYTHON_VERSION}: the default base's)")
    house.add_argument("--glibc", default=GLIBC, help=f"the image's glibc (default {GLIBC}: Debian bookworm's)")
    house.add_argument("--machine", default=platform.machine(),
                       help="the image's architecture as uname -m names it (default: this machine's)")
    base = commands.add_parser(
        "debian-base", help="a base image's root filesystem from Debian's packages (mmdebstrap, as root)",
        description=f"Make TAR, a root filesystem of Debian's {', '.join(DEBIAN_PACKAGES)} and their"
                    " essential system (mmdebstrap reaches Debian's mirror), for 'podman import TAR IMAGE' and"
                    " 'podman build --build-arg BASE=IMAGE .'.")
    base.add_argument("tar", metavar="TAR", help="the tarball to write")
    base.add_argument("--suite", default=DEBIAN_SUITE, help=f"the Debian release (default {DEBIAN_SUITE})")
    args = parser.parse_args(argv)
    try:
        if args.command == "debian-base":
            debian_base(args.tar, args.suite)
            print(f"{args.tar}: Debian {args.suite} with {', '.join(DEBIAN_PACKAGES)}")
            return 0
        wheels = wheelhouse(args.directory, python_version=args.python_version, glibc=args.glibc,
                            machine=args.machine)
    except (BuildError, ValueError) as error:
        print(f"python -m scripts.image: error: {error}", file=sys.stderr)
        return 1
    print(f"{args.directory}: {len(wheels)} wheels for CPython {args.python_version} ({DISTRIBUTION} {VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
