"""The DRA prepare benchmark runs end to end at tiny counts and reports its figures (how fast is never checked)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import dra_prepare


@pytest.mark.skipif(os.geteuid() != 0, reason="the benchmark's node mknods its device nodes: run as root")
def test_it_prepares_one_at_a_time_and_at_once_and_prints_one_json_line(capsys: pytest.CaptureFixture) -> None:
    assert dra_prepare.main(["--n", "3", "--concurrent", "4", "--repeat", "1", "--json-only"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    result = json.loads(line)
    assert (result["benchmark"], result["n"], result["concurrent"]) == ("dra_prepare", 3, 4)
    assert 0 < result["one_p50_ms"] <= result["one_p90_ms"]
    assert result["concurrent_claims_per_s"] > 0 and len(result["load_average"]) == 3
