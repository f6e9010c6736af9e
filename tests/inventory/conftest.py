"""Fixtures for the inventory tests: host files, and the fake NVML (C).

The helpers behind them live in ``tests.support.fake_nvml``: the fake NVML
(tests/native/fake_nvml.c, compiled once per session with gcc into
``libnvidia-ml.so.1``) and ``NvmlProbe``, which runs the real ``pynvml`` in
a child process that preloads the fake (``probe``); ``fake_nvml_lib`` is
the suite's (``tests/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fake_nvml import NvmlProbe

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture
def probe(fake_nvml_lib: Path, tmp_path: Path) -> NvmlProbe:
    return NvmlProbe(fake_nvml_lib, tmp_path)
