"""``gpu-isolator cdi generate`` run in-process for a test.

Rules:
- ``generate(capsys, directory, *argv)`` runs the command with a node's
  own host facts and volume under ``directory`` (``own_fact_args``; an
  option in ``argv`` given again wins) and answers its exit code, stdout
  and stderr.
- ``spec_with_slash_dev(capsys, directory, *argv)`` is the spec it writes
  (decoded, and as written)
  with ``--dev-dir /dev``, on a machine whose ``/dev`` has no NVIDIA nodes
  (elsewhere the test is skipped: the host file's numbers would not be
  used); a failed run fails the test with its stderr.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from .host_facts import own_fact_args


def generate(capsys: pytest.CaptureFixture[str], directory: str | os.PathLike[str], *argv: str) -> tuple[int, str, str]:
    from isolators import cli

    code = cli.main(["cdi", "generate", "--volume-dir", os.path.join(directory, "volume"), *own_fact_args(directory),
                     *argv])
    out, err = capsys.readouterr()
    return code, out, err


def spec_with_slash_dev(capsys: pytest.CaptureFixture[str], directory: str | os.PathLike[str],
                        *argv: str) -> tuple[Any, str]:
    from isolators.cdi import decode_spec

    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has NVIDIA device nodes; the host file's numbers would not be used")
    code, out, err = generate(capsys, directory, *argv, "--dev-dir", "/dev")
    assert code == 0, err
    return decode_spec(out.encode(), "json"), out
