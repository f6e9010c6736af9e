"""The project's image, built offline by real podman, for tests (SPEC R-SH-1).

Rules:
- ``image_skip_reason()`` says why the image cannot be built here (not
  root; podman, runc, unshare or mmdebstrap missing); tests skip with it.
  CI installs them (``.ci/run``: ``apt-get install -y podman runc
  mmdebstrap``).
- ``ImageBuild.make(directory)`` builds it as the docs say, with what
  ``scripts.image`` makes: a Debian base (``debian_base``: mmdebstrap of
  bookworm's python3, python3-venv and libstdc++6, reaching Debian's
  mirror) and, in a thread meanwhile, a build context of its own
  (``context``: the Containerfile, the ignore file, the wheelhouse pip
  made outside the build); then ``podman import`` of the base and ``podman build
  --network=none --build-arg BASE=<that base>``: the build reaches no
  network. The base's tarball is deleted once imported. Everything
  lives in a ``PodmanEngine`` of its own (storage, configuration, cgroups
  under its directory; overlay storage: each container started on vfs
  copies the whole root filesystem, ~10 s each); ``close()`` removes every
  container and image it made, and the directory. Each step is bounded
  and timed (``timings``), for the report.
- ``BackgroundBuild``: ``ImageBuild.make`` in a thread of its own, for a
  session that will use the image: the build (a minute or two, mostly
  mmdebstrap unpacking ~90 packages on one core) overlaps the suite on the
  machine's other core instead of adding to its time. ``session_build()``
  is the session's one (started at the first call); ``wait()`` joins it
  (bounded: ``WAIT_S``) and returns the image or raises the build's error;
  ``close()`` waits and removes what it made. The suite's conftest starts
  it as the first test outside ``tests/benchmarks`` starts (their smoke
  tests measure ratios and run first) when the session holds image tests.
- ``ImageBuild.run(args, volumes=)`` runs the image's entrypoint to
  completion (``--rm``, no network, the sandbox's rlimits).
- ``ImagePluginCommand(image, args, directory, volumes, options=())`` is
  ``tests.support.kubelet.PluginCommand`` run in a container of the image
  (``podman run --rm`` in the foreground, ``volumes`` mounted, ``options``
  more of ``podman run``'s, as a pod's spec gives them): the same
  ``start()``, ``wait_log()``, ``stop(signal)`` (sent to podman, which
  hands it to the container: ``--sig-proxy``; the status is the
  container's) and ``close()`` (podman killed; ``ImageBuild.close()``
  removes the container).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

from scripts import image as image_script

from .engines import PodmanEngine
from .kubelet import PluginCommand

BUILD_TIMEOUT = 480.0
"""Seconds each build step (mmdebstrap, the wheelhouse, import, build) may take before the fixture fails."""
RUN_TIMEOUT = 90.0
"""Seconds one container may run."""


def image_skip_reason() -> str | None:
    """Why the image cannot be built here, or None."""
    if os.geteuid() != 0:
        return "building the image needs root (mmdebstrap's root mode, podman's storage and runc)"
    for tool, package in (("podman", "podman"), ("runc", "runc"), ("unshare", "util-linux"),
                          ("mmdebstrap", "mmdebstrap")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (CI installs it: apt-get install -y {package})"
    return None


class ImageBuild:
    """The image built once (see module rules)."""

    def __init__(self, directory: Path, engine: PodmanEngine, base: str, tag: str, output: str,
                 timings: dict[str, float]) -> None:
        self.directory = directory
        self.engine = engine
        self.base = base
        self.tag = tag
        self.output = output
        """What ``podman build`` printed."""
        self.timings = timings

    @classmethod
    def make(cls, directory: Path) -> "ImageBuild":
        timings: dict[str, float] = {}
        built: dict[str, object] = {}

        def make_context() -> None:
            started = time.monotonic()
            try:
                built["context"] = image_script.context(directory / "context", timeout=BUILD_TIMEOUT)
            except BaseException as error:  # handed to the fixture's thread
                built["error"] = error
            timings["wheelhouse"] = time.monotonic() - started

        thread = threading.Thread(target=make_context, name="image-context", daemon=True)
        started = time.monotonic()
        thread.start()
        tar = directory / "base.tar"
        try:
            image_script.debian_base(tar, timeout=BUILD_TIMEOUT)
            timings["mmdebstrap"] = time.monotonic() - started
        finally:
            thread.join(BUILD_TIMEOUT)
        if thread.is_alive():
            raise AssertionError(f"the wheelhouse was not made within {BUILD_TIMEOUT:g}s")
        if "error" in built:
            raise built["error"]  # type: ignore[misc]
        suffix = uuid.uuid4().hex[:12]
        engine = PodmanEngine(str(directory / "podman"), str(directory / "cdi"), storage_driver="overlay")
        try:
            base = f"localhost/gpu-isolator-test-base:{suffix}"
            started = time.monotonic()
            engine.import_tar(str(tar), base, timeout=BUILD_TIMEOUT)
            tar.unlink()
            timings["import"] = time.monotonic() - started
            tag = f"localhost/gpu-isolator-test:{image_script.VERSION}-{suffix}"
            started = time.monotonic()
            result = engine.build(str(built["context"]), tag, {"BASE": base}, timeout=BUILD_TIMEOUT)
            timings["build"] = time.monotonic() - started
            if result.returncode != 0:
                raise AssertionError(f"podman build failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                                     f"{result.stderr[-4000:]}")
        except BaseException:
            engine.close()
            raise
        return cls(directory, engine, base, tag, result.stdout, timings)

    def inspect(self, reference: str | None = None) -> dict:
        return self.engine.inspect_image(reference or self.tag)

    def run(self, args: Iterable[str], *, volumes: Iterable[str] = (), timeout: float = RUN_TIMEOUT,
            entrypoint: str | None = None) -> subprocess.CompletedProcess:
        """The image's entrypoint (or ``entrypoint``) with ``args``, to completion."""
        return self.engine.run(self.tag, list(args), volumes=volumes, entrypoint=entrypoint, timeout=timeout)

    def close(self) -> None:
        """Every container and image made, their storage and cgroups, the context: removed."""
        try:
            self.engine.close(timeout=BUILD_TIMEOUT)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


WAIT_S = 4 * BUILD_TIMEOUT + 60
"""The most ``BackgroundBuild.wait`` waits: the build's four steps' bounds, and a minute."""


class BackgroundBuild:
    """``ImageBuild.make`` in a thread, started once; its image or its error (see module rules)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="gpu-isolator-image-"))
        self.built: ImageBuild | None = None
        self.error: BaseException | None = None
        self.taken = False
        """Whether a fixture took the image (and so closes it)."""
        self.thread = threading.Thread(target=self._make, name="image-build", daemon=True)
        self.thread.start()

    def _make(self) -> None:
        try:
            self.built = ImageBuild.make(self.directory)
        except BaseException as error:  # handed to whoever waits
            self.error = error

    def wait(self) -> ImageBuild:
        self.thread.join(WAIT_S)
        if self.thread.is_alive():
            raise AssertionError(f"the image was not built within {WAIT_S:g}s")
        if self.error is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise self.error
        assert self.built is not None
        return self.built

    def close(self) -> None:
        try:
            self.wait().close()
        except BaseException:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)


_session_build: BackgroundBuild | None = None


def session_build(start: bool = True) -> BackgroundBuild | None:
    """The session's one background build, started by the first call (``start=False``: only if started)."""
    global _session_build
    if _session_build is None and start:
        _session_build = BackgroundBuild()
    return _session_build


class ImagePluginCommand(PluginCommand):
    """``gpu-isolator kubelet-plugin`` in a container of the image, podman in the foreground (see module rules)."""

    def __init__(self, image: ImageBuild, args: list[str], directory: str | os.PathLike[str],
                 volumes: Iterable[str], options: Iterable[str] = ()) -> None:
        super().__init__(args, directory)
        self.image = image
        self.volumes = list(volumes)
        self.options = list(options)

    def _spawn(self, log: Any) -> subprocess.Popen:
        engine = self.image.engine
        return engine.popen(engine.run_args(self.image.tag, [self.COMMAND, *self.args], volumes=self.volumes,
                                            options=self.options),
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
