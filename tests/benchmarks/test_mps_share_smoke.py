"""``python -m benchmarks.mps_share`` grants and returns shares, warm and cold, and reports every figure (small)."""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

import pytest

from benchmarks import mps_share


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: the benchmark builds the stand-in")
def test_the_share_figures_are_reported(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(sys, "argv", ["mps_share", "--shares", "3", "--cold", "2"])
    mps_share.main()
    out = capsys.readouterr().out
    assert "an MPS share on the stand-in control daemon (simulated 1-GPU node), p50 / p99 in ms:" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["benchmark"] == "mps_share" and (result["shares"], result["cold"]) == (3, 2)
    assert all(result[f"{kind}_{verb}_{q}_ms"] > 0 for kind in ("warm", "cold") for verb in ("share", "release")
               for q in ("p50", "p99"))
