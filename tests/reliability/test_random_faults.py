"""The random fault run, small (issue 20): a few rounds of 32-way churn on
each kernel with the device worker SIGKILLed or SIGSTOPped/SIGCONTed and the
agent SIGKILLed at random moments; judged by the kernel (a probe in each
cgroup opening the GPU nodes): no GPU two cgroups can open, every call
answered within its bound (a failure: an IsolatorError), nothing left after
the last cleanup.
``python -m tests.reliability.fault_run --rounds 50`` is the long run."""

from __future__ import annotations

import pytest

from isolators.simulated_node import backend_unavailable
from tests.reliability.fault_run import run
from tests.support.kernel import KERNEL_BACKENDS


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_random_worker_and_agent_faults_never_double_grant_hang_or_leak(backend: str) -> None:
    reason = backend_unavailable(backend)
    if reason is not None:
        pytest.skip(reason)
    figures = run(backend, rounds=2, seed=20, round_seconds=(0.5, 1.5))
    assert figures.agent_kills == 2 and figures.judgements >= 2 and figures.lifecycles > 0
    assert (figures.double_grants, figures.hangs, figures.leaks, figures.wrong_error_types) == (0, 0, 0, 0), (
        "\n".join(figures.problems))
