"""Fixtures for the image tests (SPEC R-SH-1).

- ``image`` (session): the project's image, built once, offline, from a
  Debian base and the wheels made outside the build
  (``tests.support.image.ImageBuild``), in the background from early in
  the session (``tests.support.image.session_build``, started by the
  suite's conftest); every container and image it made, its storage and
  its build context removed at the end of the session. Skips with the
  reason where root, podman, runc or mmdebstrap is missing.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.image import ImageBuild, image_skip_reason, session_build


@pytest.fixture(scope="session")
def image() -> Iterator[ImageBuild]:
    reason = image_skip_reason()
    if reason:
        pytest.skip(reason)
    build = session_build()
    assert build is not None
    build.taken = True
    built = build.wait()
    try:
        yield built
    finally:
        built.close()
