"""How a test judges the kernel (``tests.support.probes.verdict``): DENIED
iff EPERM, GRANTED for any answer past the device cgroup. On a GPU host the
driver serves major 195, so a granted open succeeds (0) or fails with
ENODEV for a minor it lacks, never ENXIO as here; these tests emulate that
with majors this kernel does serve: 1:3 (/dev/null: opens with 0) and a
free misc minor (10:N: the misc driver answers ENODEV), on v1 and v2."""

from __future__ import annotations

import errno
import os

import pytest

from actors.devices import CgroupsV1Backend, CgroupsV2Backend, DeviceRule
from tests.support.probes import ABSENT, DENIED, GRANTED, mknod_nodes, verdict, verdicts

R = DeviceRule.parse


def test_the_verdict_is_denied_iff_eperm() -> None:
    assert [verdict(code) for code in (0, errno.ENXIO, errno.ENODEV, errno.EIO, errno.EBUSY)] == [GRANTED] * 5
    assert verdict(errno.EPERM) == DENIED
    assert (verdict(errno.ENOENT), verdict(errno.EACCES)) == (ABSENT, "unreached(EACCES)")  # never reached it
    assert verdicts({"a": "OK", "b": "ENXIO", "c": "ENODEV", "d": "EPERM", "e": "ENOENT", "f": "No such thing"}) == {
        "a": GRANTED, "b": GRANTED, "c": GRANTED, "d": DENIED, "e": ABSENT, "f": "unknown(No such thing)"}


def free_misc_minor() -> int:
    """A misc minor no driver registered here (its open answers ENODEV)."""
    with open("/proc/misc") as handle:
        taken = {int(line.split()[0]) for line in handle if line.strip()}
    for minor in (77, 78, 79):  # no module alias claims these, so opening them loads nothing
        if minor not in taken:
            return minor
    pytest.skip("misc minors 77..79 are all registered on this host")


def test_a_major_the_kernel_serves_is_judged_by_the_cgroup_alone(sandbox, tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod device nodes")
    misc = free_misc_minor()
    nodes = mknod_nodes(str(tmp_path), [("c", 1, 3), ("c", 1, 5), ("c", 10, misc)])
    kind = CgroupsV2Backend if sandbox.v2 else CgroupsV1Backend
    backend = kind(sandbox.hierarchy, sandbox.cgroups_root)
    backend.configure("c1", [R("c 1:3 rwm"), R(f"c 10:{misc} rwm")], [])
    probe = sandbox.probe("c1")
    assert probe.open(nodes["c", 1, 3]) == 0  # served and granted: it opens, as 195 does on a GPU host
    assert probe.open(nodes["c", 10, misc]) == errno.ENODEV  # served, no such minor: a GPU the driver lacks
    assert probe.access(nodes["c", 1, 3]) == GRANTED
    assert probe.access(nodes["c", 10, misc]) == GRANTED
    assert probe.access(nodes["c", 1, 5]) == DENIED  # served too, but the cgroup refuses it
    assert (probe.may_mknod(str(tmp_path), "c", 1, 3), probe.may_mknod(str(tmp_path), "c", 1, 5)) == (GRANTED, DENIED)
    if sandbox.v2:
        sandbox.attached("c1")  # its program is checked to be freed at teardown
