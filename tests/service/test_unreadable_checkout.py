"""A checkout only its owner can enter (issue 38): the throwaway-user tests
still run from it, and the CLI names an installation its user cannot read.

A copy of this checkout's packages in a root-owned 0700 directory stands
for a clone under ``/root``. From there, as root, a real throwaway user
runs ``gpu-isolator kubelet-plugin --help`` (whose parser imports the
kubelet command's module after the privileges are dropped): through
``tests.support.users``' readable copy it works; pointed at the 0700
checkout itself, the CLI says which path that user cannot read and that
the installation must be readable by the user running it (exit 2), not
"internal error"."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterator

import pytest

from tests.support.users import COPIED, ROOT

PROBE = r"""
import json, subprocess, sys
from tests.support import users
assert str(users.ROOT) == sys.argv[1], (users.ROOT, sys.argv[1])
answers = {}
with users.throwaway_users(1) as (user,):
    for name, root in (("copy", None), ("checkout", users.ROOT)):
        process = user.cli("kubelet-plugin", "--help", root=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = process.communicate(timeout=60)
        answers[name] = [process.returncode, out.decode(), err.decode()]
    answers["user"] = user.name
print(json.dumps(answers))
"""


@pytest.fixture
def private_checkout() -> Iterator[str]:
    """This checkout's packages in a 0700 directory of root's."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the throwaway user accounts")
    private = tempfile.mkdtemp(prefix="gpu-isolator-test-private-", dir="/tmp")
    os.chmod(private, 0o700)
    checkout = os.path.join(private, "checkout")
    try:
        for name in COPIED:
            source, target = ROOT / name, os.path.join(checkout, name)
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(source, target)
        yield checkout
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_a_throwaway_user_runs_the_cli_from_a_0700_checkout_and_is_told_what_it_cannot_read(
        private_checkout: str) -> None:
    env: dict[str, Any] = dict(os.environ, PYTHONPATH=private_checkout)
    done = subprocess.run([sys.executable, "-c", PROBE, private_checkout], cwd=private_checkout, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    code, out, err = answers["copy"]
    assert code == 0, err
    assert "usage: gpu-isolator kubelet-plugin" in out
    code, out, err = answers["checkout"]
    private = os.path.dirname(private_checkout)
    assert code == 2 and out == ""
    # the first of its own modules the parser imports after the drop (a command's)
    assert re.match(r"gpu-isolator: error: cannot import isolators\.\w+: this installation "
                    + re.escape(f"({private_checkout}/isolators) is not readable by user {answers['user']} (uid "),
                    err), err
    assert f"{private} (mode 0700, owner uid 0) is in the way" in err
    assert "The installation must be readable by the user running gpu-isolator" in err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1
