"""Fixtures for the image tests (SPEC R-SH-1).

- ``image`` (session): the project's image, built once, offline, from a
  Debian base and the wheels made outside the build
  (``tests.support.image.ImageBuild``); every container and image it made,
  its storage and its build context removed at the end of the session.
  Skips with the reason where root, podman, runc or mmdebstrap is missing.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.image import ImageBuild, image_skip_reason


@pytest.fixture(scope="session")
def image() -> Iterator[ImageBuild]:
    reason = image_skip_reason()
    if reason:
        pytest.skip(reason)
    directory = Path(tempfile.mkdtemp(prefix="gpu-isolator-image-"))
    try:
        built = ImageBuild.make(directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    try:
        yield built
    finally:
        built.close()
