"""Write upgrade fixtures with an earlier release's own code (SPEC R-SH-3).

Rules:
- A fixture is what an earlier release *wrote*, not what this release
  thinks it wrote: each writer (``tests/upgrades/writers/<name>.py``) runs
  with the earlier commit's tree first on ``sys.path`` (a ``git worktree``
  of that commit, removed afterwards), in that tree as its working
  directory, and writes under the folder it is given.
- A writer is run as ``python <writer> <out_dir>``; it may start that
  release's front doors as subprocesses (``python -m isolators.cli ...``
  with the same environment) and must stop them before it returns. What it
  writes lands in ``tests/upgrades/fixtures/<release>/<name>/``, replacing
  what was there, with ``WRITTEN_BY`` naming the commit.
- A writer uses only what both releases have (the standard library, the
  project's dependencies, and the earlier release's own modules); the tests
  that read the fixtures run with this release's code.
- This is a developer's tool, not run by the suite: the fixtures are
  committed, and the suite reads them.

Usage::

    python -m tests.upgrades.write_fixtures --commit 2603e17 --release 0.1.0 NAME [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(HERE))
WRITERS = os.path.join(HERE, "writers")
FIXTURES = os.path.join(HERE, "fixtures")

# The last commit of release 0.1.0 before file format versions (issue 48).
DEFAULT_COMMIT = "2603e17"
DEFAULT_RELEASE = "0.1.0"


def fixture_dir(release: str, name: str) -> str:
    """Where the fixtures ``name`` written by ``release`` live."""
    return os.path.join(FIXTURES, release, name)


def write(commit: str, release: str, names: list[str]) -> None:
    full = subprocess.run(["git", "-C", REPOSITORY, "rev-parse", commit], check=True,
                          capture_output=True, text=True).stdout.strip()
    scratch = tempfile.mkdtemp(prefix="gpu-isolator-old-")
    tree = os.path.join(scratch, "tree")
    subprocess.run(["git", "-C", REPOSITORY, "worktree", "add", "--detach", tree, full], check=True,
                   capture_output=True)
    try:
        for name in names:
            writer = os.path.join(WRITERS, f"{name}.py")
            if not os.path.isfile(writer):
                raise SystemExit(f"no writer {writer}: writers are {sorted(os.listdir(WRITERS))}")
            out = os.path.join(scratch, "out", name)
            os.makedirs(out)
            env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
            subprocess.run([sys.executable, writer, out], cwd=tree, env=env, check=True)
            with open(os.path.join(out, "WRITTEN_BY"), "w") as handle:
                handle.write(f"release {release}, commit {full}, writer tests/upgrades/writers/{name}.py\n")
            target = fixture_dir(release, name)
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copytree(out, target, symlinks=True)
            print(f"wrote {os.path.relpath(target, REPOSITORY)}")
    finally:
        subprocess.run(["git", "-C", REPOSITORY, "worktree", "remove", "--force", tree], check=False,
                       capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="the earlier release's commit")
    parser.add_argument("--release", default=DEFAULT_RELEASE, help="the earlier release's version")
    parser.add_argument("names", nargs="+", help="writers to run (tests/upgrades/writers/NAME.py)")
    arguments = parser.parse_args(argv)
    write(arguments.commit, arguments.release, arguments.names)


if __name__ == "__main__":
    main()
