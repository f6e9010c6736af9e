"""``python -m benchmarks.pod_repair`` runs its passes and reports every figure (small, no plugin process)."""

from __future__ import annotations

import json
import sys
from typing import Any

from benchmarks import pod_repair


def test_the_pass_figures_are_reported(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(sys, "argv", ["pod_repair", "--containers", "10", "--passes", "2", "--rest-seconds", "0"])
    pod_repair.main()
    out = capsys.readouterr().out
    assert "one pass over 10 containers (fake PodResources, memory kernel), median of 2:" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["benchmark"] == "pod_repair" and result["containers"] == 10
    assert all(result[f"{kind}_{what}_ms"] > 0 for kind in ("rest", "repair") for what in ("wall", "cpu"))
