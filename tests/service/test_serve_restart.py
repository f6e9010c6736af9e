"""R-SV-1 recovery on the real kernel (root; cgroups v1 and v2): ``serve``
stopped with SIGTERM mid-way leaves running commands alone -- the kernel
keeps enforcing their grants, their supervisors keep talking to their
clients -- and a new ``serve`` recovers them from its records and the
kernel: same GPUs, commands, processes, owners. A client that stayed gets
its command's exit status across the restart and its GPUs back through
the new service; one killed meanwhile took its command with it, and its
container is released by the new service; nothing held is handed out
again."""

from __future__ import annotations

import os

import pytest

from tests.support.kernel import KERNEL_BACKENDS, wait_gone
from tests.support.nodes import Node
from tests.support.probes import GRANTED
from tests.support.services import gpus_of


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_serve_restarted_mid_way_recovers_the_running_containers(backend: str, serve_factory,
                                                                  gpu_nodes: dict[int, str]) -> None:
    service = serve_factory(backend).start()
    node: Node = service.node
    paths = sorted(gpu_nodes.values())
    alive = service.probe(*paths, gpus=2, hold=True, code=3)
    orphaned = service.probe(*paths, gpus=1, hold=True)
    alive_probe, orphaned_probe = service.probe_result(alive), service.probe_result(orphaned)
    before = service.state_naming(alive_probe, orphaned_probe)
    held = gpus_of(before)
    names = {view["pid"]: name for name, view in before["containers"].items()}
    alive_name, orphaned_name = names[alive_probe["pid"]], names[orphaned_probe["pid"]]

    assert service.stop() == 0  # SIGTERM: a clean stop that leaves the containers running
    grants = node.kernel_grants()
    assert {name: sorted(grants[name]) for name in held} == held  # still enforced by the kernel
    for name, probe in ((alive_name, alive_probe), (orphaned_name, orphaned_probe)):
        with open(os.path.join(node.cgroup_dir(name), "cgroup.procs")) as procs:
            assert str(probe["pid"]) in procs.read().split()
    orphaned.kill()  # its client dies while no service runs: its supervisor kills the command
    orphaned.wait()
    assert wait_gone(orphaned_probe["pid"])

    service.start()
    assert "2 container(s) recovered" in service.ready_line
    after = service.wait_state(lambda s: orphaned_name not in s["containers"])  # empty: released
    assert gpus_of(after) == {alive_name: held[alive_name]}
    view = after["containers"][alive_name]
    assert (view["pid"], view["command"], view["user"], view["state"]) == (
        alive_probe["pid"], before["containers"][alive_name]["command"], "root", "running")

    newcomer = service.probe(*paths, gpus=2, hold=True)
    newcomer_probe = service.probe_result(newcomer)
    state = service.state_naming(newcomer_probe)
    newcomer_name = next(n for n, v in state["containers"].items() if v["pid"] == newcomer_probe["pid"])
    fresh = set(state["containers"][newcomer_name]["gpus"])
    assert len(fresh) == 2 and fresh.isdisjoint(held[alive_name])
    assert [newcomer_probe["access"][gpu_nodes[m]] for m in sorted(fresh)] == [GRANTED, GRANTED]

    alive.stdin.close()  # its command ends: its client gets the status, the new service the release
    assert service.finish(alive)[0] == 3
    newcomer.stdin.close()
    assert service.finish(newcomer)[0] == 0
    service.wait_state(lambda s: not s["containers"] and s["free"] == [0, 1, 2, 3])
    assert node.cgroups() == []
    assert service.stop() == 0
