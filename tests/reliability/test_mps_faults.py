"""The node ledger's fault run with MPS shares, small (SPEC R-MP-6, R-MP-1, R-NL-3; issue 49): both Kubernetes
front doors share GPUs through MPS (``kubelet-plugin --mps_replicas=2``, ``dra-plugin --sharing=mps``, the
stand-in control daemon) on one node ledger and one runtime directory; pods and claims come and go, the front
doors (now or mid-call) and their daemons are SIGKILLed at random (pods going while the device plugin is
down); as root each front door runs in cgroups of its own, its daemons in another (``--mps_cgroup``), and a kill
stops its whole "container". Judged after every step by PodResources, the DRA checkpoint, the lease files and the daemons' processes: no unit with shares
of two front doors or without its front door's lease, no share without a daemon that answers, no daemon left
without a share, no hang, no lease or daemon left at the end. ``python -m tests.reliability.mps_fault_run
--steps 200 --seed N`` is the long run (and replays a seed)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.reliability.mps_fault_run import containers_here, end_stand_ins, run

SEED = 10


def test_shares_of_front_doors_and_daemons_killed_at_random_keep_one_owner_and_one_daemon(mps_control: Path) -> None:
    figures = run(steps=20, seed=SEED, control=mps_control)  # as root: front doors in containers, stopped as such
    assert figures.containers == containers_here()
    replay = f"replay: python -m tests.reliability.mps_fault_run --steps 20 --seed {SEED}"
    assert (figures.double_grants, figures.unleased_grants, figures.shares_without_daemon,
            figures.daemons_without_share, figures.hangs, figures.leaks) == (0, 0, 0, 0, 0, 0), \
        f"{figures.line()}; {replay}\n" + "\n".join(figures.problems)
    # the faults that matter happened: front doors (also mid-call) and daemons killed, a pod gone while its plugin
    # was down
    assert (figures.plugin_kills and figures.driver_kills and figures.daemon_kills and figures.pods_gone_while_down
            and figures.mid_call_kills), f"{figures.line()}; {replay}"
    assert figures.pod_lifecycles and figures.claim_lifecycles and figures.refused, f"{figures.line()}; {replay}"
    assert figures.judgements == figures.steps + 2
    assert end_stand_ins("/nonexistent", os.path.realpath(mps_control)) == []  # no stand-in daemon left running
