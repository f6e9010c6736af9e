"""R-SV-1 recovery on the real kernel (root; cgroups v1 and v2): ``serve``
stopped with SIGTERM mid-way leaves running commands alone -- the kernel
keeps enforcing their grants -- and a new ``serve`` recovers them from its
records and the kernel: same GPUs, commands, processes; a client still
alive cleans up through it, one that died meanwhile is released once its
command is gone, and nothing it holds is handed out again."""

from __future__ import annotations

import os

import pytest

from tests.support.kernel import KERNEL_BACKENDS
from tests.support.nodes import Node
from tests.support.probes import GRANTED
from tests.support.services import gpus_of


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_serve_restarted_mid_way_recovers_the_running_containers(backend: str, serve_factory,
                                                                  gpu_nodes: dict[int, str]) -> None:
    service = serve_factory(backend).start()
    node: Node = service.node
    paths = sorted(gpu_nodes.values())
    alive = service.probe(*paths, gpus=2, hold=True)
    orphaned = service.probe(*paths, gpus=1, hold=True)
    alive_probe, orphaned_probe = service.probe_result(alive), service.probe_result(orphaned)
    before = service.state()
    held = gpus_of(before)
    names = {view["pid"]: name for name, view in before["containers"].items()}
    alive_name, orphaned_name = names[alive_probe["pid"]], names[orphaned_probe["pid"]]

    assert service.stop() == 0  # SIGTERM: a clean stop that leaves the containers running
    grants = node.kernel_grants()
    assert {name: sorted(grants[name]) for name in held} == held  # still enforced by the kernel
    for name, probe in ((alive_name, alive_probe), (orphaned_name, orphaned_probe)):
        with open(os.path.join(node.cgroup_dir(name), "cgroup.procs")) as procs:
            assert str(probe["pid"]) in procs.read().split()
    orphaned.kill()  # its client dies while no service runs
    orphaned.wait()

    service.listen = service.address
    service.start()
    assert "2 container(s) recovered" in service.ready_line
    after = service.wait_state(lambda s: s["containers"][orphaned_name]["state"] == "releasing")
    assert gpus_of(after) == held
    for name, probe in ((alive_name, alive_probe), (orphaned_name, orphaned_probe)):
        view = after["containers"][name]
        assert view["pid"] == probe["pid"] and view["command"] == before["containers"][name]["command"]
    assert after["containers"][alive_name]["state"] == "running"

    newcomer = service.probe(*paths, gpus=1, hold=True)
    newcomer_probe = service.probe_result(newcomer)
    state = service.state()
    newcomer_name = next(n for n, v in state["containers"].items() if v["pid"] == newcomer_probe["pid"])
    fresh = set(state["containers"][newcomer_name]["gpus"])
    assert len(fresh) == 1 and fresh.isdisjoint(held[alive_name] + held[orphaned_name])
    assert [newcomer_probe["access"][gpu_nodes[m]] for m in sorted(fresh)] == [GRANTED]

    orphaned.stdin.close()  # its command ends: released by the service itself
    service.wait_state(lambda s: orphaned_name not in s["containers"])
    alive.stdin.close()  # its client cleans up through the new service
    assert service.finish(alive)[0] == 0
    newcomer.stdin.close()
    assert service.finish(newcomer)[0] == 0
    service.wait_state(lambda s: not s["containers"] and s["free"] == [0, 1, 2, 3])
    assert node.cgroups() == []
    assert service.stop() == 0
