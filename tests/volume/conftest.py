"""Fixtures for the NVIDIA volume tests: a fake driver built with gcc, real
loader caches written by ``ldconfig``, hand-written caches for the corrupt
cases, and mount hygiene. Everything is built under pytest's tmp dirs; the
helpers behind them live in ``tests.support.fake_driver``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.fake_driver import FakeDriver, build_fake_driver, have_tool, new_cache_bytes
from tests.support.fake_driver import old_cache_bytes, unmount_all_under


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> FakeDriver:
    if not (have_tool("gcc") and have_tool("ldconfig")):
        pytest.skip("the fake driver needs gcc and ldconfig")
    return build_fake_driver(tmp_path_factory.mktemp("fake-driver"))


@pytest.fixture(scope="session")
def driver_cache(fake_driver: FakeDriver) -> Path:
    """The fake driver's cache: lib64 (and lib32 when 32-bit builds work)."""
    dirs = ["lib64"] + (["lib32"] if fake_driver.has_32bit else [])
    return fake_driver.cache("driver", dirs)


@pytest.fixture
def volume_dir(tmp_path: Path):
    """A fresh volume directory; anything mounted under it is unmounted after."""
    path = tmp_path / "volumes"
    path.mkdir()
    try:
        yield path
    finally:
        if os.geteuid() == 0:
            unmount_all_under(str(tmp_path))


@pytest.fixture
def cache_bytes():
    """The hand-written cache builders, as (new_cache_bytes, old_cache_bytes)."""
    return new_cache_bytes, old_cache_bytes
