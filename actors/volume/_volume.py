"""The NVIDIA volume actor and its handle.

Rules:
- ``NvidiaVolumeProcess`` owns one host volume directory
  (``<volume_dir>/nvidia_<driver version>``, see ``_build``). Each build --
  the first at ``create``, later ones at ``refresh`` -- is one job on the
  process's own single-thread ``Executor``: nothing blocks the event loop,
  and builds of the volume never overlap, even when asked for concurrently.
- ``await NvidiaVolume.create(volume_dir, driver_version, ld_cache=...,
  search_path=None)`` spawns the process and waits for the first build
  (``ld_cache=None``: no loader cache, no library; ``search_path=""``: no
  binary -- a simulated node's volume, copying nothing of this machine); if
  the build fails, the process is terminated and the error (a
  ``VolumeError``: ``LdCacheError``, ``ElfError``, ...) is raised.
- The handle gives ``host_path``, ``container_path`` (``/usr/local/nvidia``)
  and the last ``report``; ``should_inject(manifest)`` and ``env(manifest)``
  are pure (R-VO-2, R-VO-3) and run in the caller.
- ``refresh()`` rebuilds from the current loader cache and search path; the
  volume only grows. ``close()`` terminates the process (the files stay).
"""

from __future__ import annotations

import logging

from runtime import Executor, PID, Process, dispatch, generate_id, spawn, terminate, wait

from ..manifest import ImageManifest
from ._build import VolumeReport, build_volume, volume_host_path
from ._injection import CONTAINER_PATH, should_inject, volume_env
from ._ldcache import DEFAULT_LD_CACHE

__all__ = ["NvidiaVolume", "NvidiaVolumeProcess"]

logger = logging.getLogger(__name__)


class NvidiaVolumeProcess(Process):
    """The actor that builds and grows one NVIDIA volume directory."""

    def __init__(
        self,
        volume_dir: str,
        driver_version: str,
        ld_cache: str | None = DEFAULT_LD_CACHE,
        search_path: str | None = None,
    ) -> None:
        super().__init__(id=generate_id("nvidia-volume"))
        self.host_path = volume_host_path(volume_dir, driver_version)
        self.volume_dir = volume_dir
        self.driver_version = driver_version
        self.ld_cache = ld_cache
        self.search_path = search_path
        self.report: VolumeReport | None = None
        self._executor = Executor(max_workers=1, name="nvidia-volume")

    async def build(self) -> VolumeReport:
        """Create or grow the volume (one executor job); returns its report."""
        report = await self._executor.run(
            build_volume, self.volume_dir, self.driver_version, self.ld_cache,
            self.search_path)
        self.report = report
        return report

    def finalize(self) -> None:
        self._executor.shutdown(wait=False)


class NvidiaVolume:
    """Handle on a built NVIDIA volume (see module rules)."""

    def __init__(self, pid: PID, host_path: str, report: VolumeReport) -> None:
        self._pid = pid
        self._host_path = host_path
        self._report = report

    @classmethod
    async def create(
        cls,
        volume_dir: str,
        driver_version: str,
        ld_cache: str | None = DEFAULT_LD_CACHE,
        search_path: str | None = None,
    ) -> NvidiaVolume:
        """Spawn the volume actor and build the volume (R-VO-1)."""
        process = NvidiaVolumeProcess(volume_dir, driver_version, ld_cache, search_path)
        pid = spawn(process)
        try:
            report = await dispatch(pid, NvidiaVolumeProcess.build)
        except BaseException:
            terminate(pid)
            await wait(pid)
            raise
        return cls(pid, process.host_path, report)

    @property
    def pid(self) -> PID:
        return self._pid

    @property
    def host_path(self) -> str:
        """The volume directory on the host."""
        return self._host_path

    @property
    def container_path(self) -> str:
        """Where the volume is mounted in a container: ``/usr/local/nvidia``."""
        return CONTAINER_PATH

    @property
    def report(self) -> VolumeReport:
        """What the latest build (``create`` or ``refresh``) did."""
        return self._report

    async def refresh(self) -> VolumeReport:
        """Rebuild from the current cache and search path; only adds files."""
        self._report = await dispatch(self._pid, NvidiaVolumeProcess.build)
        return self._report

    async def close(self) -> None:
        """Terminate the volume actor; the volume's files stay."""
        terminate(self._pid)
        await wait(self._pid)

    def should_inject(self, manifest: ImageManifest) -> bool:
        """Whether containers of this image get the volume (R-VO-2)."""
        return should_inject(manifest)

    def env(self, manifest: ImageManifest) -> dict[str, str]:
        """PATH and LD_LIBRARY_PATH for such a container (R-VO-3)."""
        return volume_env(manifest, CONTAINER_PATH)
