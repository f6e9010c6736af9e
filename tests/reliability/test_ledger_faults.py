"""The node ledger's random fault run, small (SPEC R-NL-3, issue 43): two isolator
agents, ``serve`` and both Kubernetes plugins on one 8-GPU node, each SIGKILLed
and started again at random moments while they over-ask for GPUs; judged by the
kernel, the plugins' grants (PodResources' pods, prepared claims) and the lease
files: no GPU two front doors grant, none granted without its front door's
lease, no hang, and every unit free once all have released, restarted and
stopped. ``python -m tests.reliability.ledger_fault_run --steps 200`` is the
long run."""

from __future__ import annotations

import pytest

from isolators.simulated_node import backend_unavailable
from tests.reliability.ledger_fault_run import run
from tests.support.kernel import KERNEL_BACKENDS


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_front_doors_killed_at_random_never_share_a_gpu_hang_or_leak_a_lease(backend: str) -> None:
    reason = backend_unavailable(backend)
    if reason is not None:
        pytest.skip(reason)
    figures = run(backend, steps=12, seed=43)
    assert figures.judgements >= 4 and figures.agent_kills + figures.serve_kills + figures.plugin_kills >= 1
    assert figures.lifecycles > 0 and figures.serve_lifecycles > 0 and figures.refused_grants > 0
    assert figures.pod_lifecycles + figures.claim_lifecycles > 0
    assert (figures.double_grants, figures.unleased_grants, figures.hangs, figures.leaks,
            figures.wrong_error_types) == (0, 0, 0, 0, 0), "\n".join(figures.problems)
