"""``DeviceControl.confine`` (SPEC R-SC-8) on the real kernel, cgroups v1 and
v2: GPUs denied to a cgroup outside device control's root and to every
cgroup below it (one made later too), every other device kept; applying it
again repairs what was undone and changes nothing else; the root itself, an
ancestor of it and a cgroup inside it are refused. Judged by probes opening
mknod'ed nodes (``tests.support.probes``)."""

from __future__ import annotations

import os

import pytest

from actors.devices import DeviceControl, InvalidCgroupError
from runtime import Runtime
from tests.support.kernel import attached_programs, detach_programs
from tests.support.probes import DENIED, GRANTED

pytestmark = pytest.mark.asyncio

GPUS = [f"c 195:{minor} rwm" for minor in range(4)]


async def test_a_confined_cgroup_and_those_below_it_open_no_gpu_and_keep_every_other_device(
        kernel: str, sandbox, device_nodes) -> None:
    backend = {"v1": "cgroups_v1", "v2": "cgroups_v2"}[kernel]
    users = os.path.join(sandbox.root, "users")
    os.makedirs(os.path.join(users, "session-1"))
    probes = {"users": sandbox.probe("users"), "session": sandbox.probe("users/session-1")}
    gpus = [device_nodes["c", 195, minor] for minor in range(4)]
    other = device_nodes["c", 240, 0]
    assert all(probe.access(path) == GRANTED for probe in probes.values() for path in [*gpus, other])
    confined = f"{sandbox.cgroups_root}/users"
    async with Runtime():
        control = await DeviceControl.create(backend, sandbox.hierarchy, cgroups_root=f"{sandbox.cgroups_root}/iso")
        try:
            first = await control.confine(confined, GPUS[:3])  # GPU 3 is not handed out here
            assert first, "the first confine says what it did"
            os.mkdir(os.path.join(users, "session-2"))  # a session started later
            probes["later"] = sandbox.probe("users/session-2")
            for name, probe in probes.items():
                assert [probe.access(path) for path in gpus] == [DENIED, DENIED, DENIED, GRANTED], name
                assert probe.access(other) == GRANTED, name
                assert probe.access(device_nodes["c", 195, 255]) == GRANTED, name  # nvidiactl alone opens nothing
            if kernel == "v2":
                assert await control.confine(confined, GPUS[:3]) == []  # already in place: nothing to do
                detach_programs(users)  # someone takes it away ...
                assert probes["session"].access(gpus[0]) == GRANTED
                repaired = await control.confine(confined, GPUS[:3])  # ... the next tick puts it back
                assert repaired == [f"{users}: attached the missing device program"]
                assert len(attached_programs(users)) == 1
            else:
                assert await control.confine(confined, GPUS[:3]) == first  # written again: v1 cannot read it back
            assert probes["session"].access(gpus[0]) == DENIED
            for refused in (sandbox.cgroups_root, f"{sandbox.cgroups_root}/iso", f"{sandbox.cgroups_root}/iso/c1"):
                with pytest.raises(InvalidCgroupError, match="holds or lies inside device control's own root"):
                    await control.confine(refused, GPUS)
            with pytest.raises(InvalidCgroupError, match="must be relative"):
                await control.confine("/" + confined, GPUS)
            with pytest.raises(Exception, match="does not exist"):
                await control.confine(f"{sandbox.cgroups_root}/nobody", GPUS)
        finally:
            await control.close()
