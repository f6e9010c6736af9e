"""Fixtures for the runtime tests.

- ``anyio_backend``: tests marked ``@pytest.mark.anyio`` (the core set:
  dispatch, ordering, futures, clock, links, executor) run on asyncio and on
  trio through anyio's pytest plugin. The rest use ``@pytest.mark.asyncio``.
- Every test leaves the global Clock running and without timers, even when
  it failed inside a paused clock.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime import _clock


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _fresh_clock() -> Iterator[None]:
    _clock._state.reset()
    yield
    _clock._state.reset()
