"""Building the NVIDIA volume on the host (R-VO-1): blocking file work only.

Rules:
- The volume of driver version V is ``<volume_dir>/nvidia_V`` with ``bin/``,
  ``lib/`` (32-bit libraries) and ``lib64/`` (64-bit libraries).
- ``bin/`` gets each of ``BINARIES`` found on the search path (PATH-style;
  default the process's ``PATH``; an empty one finds none), copied from its
  real path. With ``ld_cache=None`` no loader cache is read: a node with
  no driver libraries (a simulated one that was not pointed at any).
- For each name in ``LIBRARIES`` (Mesos' list, from libnvidia-container),
  every ELF entry of the loader cache whose name starts with it is copied by
  its real path into ``lib/`` or ``lib64/`` according to its ELF class, and
  a symlink from the cache name points at the copy; a ``libGLX_nvidia``
  entry also gets ``libGLX_indirect…`` pointing at it (GLVND indirect GLX).
- Skipped: the vendor-neutral GL names (``libGL.so``, ``libEGL.so``,
  ``libGLESv1_CM.so``, ``libGLESv2.so``) unless a NEEDED entry starts with
  ``libGLdispatch.so``, ``libnvidia-gl`` or ``libnvidia-egl`` (GLVND or
  NVIDIA's own; Mesos compares the first exactly and so misses the real
  ``libGLdispatch.so.0``); ``libnvidia-tls`` unless its ABI note is
  2.3.99 (Mesos fails the whole volume when the note is missing; here it is
  a skip); cache entries whose file no longer exists (a stale cache), with a
  warning.
- The volume only grows: an existing file or link is never replaced or
  removed (containers running on it keep their files), so a rebuild only
  adds what is new. Copies land under a temporary name and are renamed into
  place, so a crash never leaves a half-written library under its real name.
- If the volume's filesystem is ``noexec``, a tmpfs is mounted over it first
  (see ``_mount``).
- Errors: ``VolumeError`` / ``LdCacheError`` / ``ElfError`` naming the
  offending path, in Mesos' wording where it has one.
"""

from __future__ import annotations

import logging
import os
import shutil

import msgspec

from ._elf import ElfInfo, read_elf
from ._errors import VolumeError
from ._ldcache import DEFAULT_LD_CACHE, read_ld_cache
from ._mount import ensure_executable

__all__ = [
    "BINARIES", "LIBRARIES", "VolumeReport", "build_volume", "volume_host_path",
    "library_skip_reason",
]

logger = logging.getLogger(__name__)

# Driver binaries copied into bin/ (Mesos' BINARIES).
BINARIES: tuple[str, ...] = (
    "nvidia-smi",                 # System management interface.
    "nvidia-debugdump",           # GPU coredump utility.
    "nvidia-persistenced",        # Persistence mode utility.
    "nvidia-cuda-mps-control",    # Multi process service CLI.
    "nvidia-cuda-mps-server",     # Multi process service server.
)

# Prefixes of the driver libraries copied into lib/ and lib64/ (Mesos'
# LIBRARIES, in its order; libGLX.so, libOpenGL.so and libGLdispatch.so are
# commented out there -- the GLVND loaders belong to the image).
LIBRARIES: tuple[str, ...] = (
    # Utility
    "libnvidia-ml.so",            # Management library.
    "libnvidia-cfg.so",           # GPU configuration.
    # Compute
    "libcuda.so",                 # CUDA driver library.
    "libnvidia-opencl.so",        # NVIDIA OpenCL ICD.
    "libnvidia-ptxjitcompiler.so",  # PTX-SASS JIT compiler.
    "libnvidia-fatbinaryloader.so",  # fatbin loader.
    "libnvidia-compiler.so",      # NVVM-PTX compiler for OpenCL.
    # Video
    "libvdpau_nvidia.so",         # NVIDIA VDPAU ICD.
    "libnvidia-encode.so",        # Video encoder.
    "libnvcuvid.so",              # Video decoder.
    # Graphics
    "libnvidia-eglcore.so",       # EGL core.
    "libnvidia-glcore.so",        # OpenGL core.
    "libnvidia-tls.so",           # Thread local storage.
    "libnvidia-glsi.so",          # OpenGL system interaction.
    "libnvidia-fbc.so",           # Framebuffer capture.
    "libnvidia-ifr.so",           # OpenGL framebuffer capture.
    # Graphics (GLVND)
    "libGLX_nvidia.so",           # OpenGL/GLX ICD.
    "libEGL_nvidia.so",           # EGL ICD.
    "libGLESv2_nvidia.so",        # OpenGL ES v2 ICD.
    "libGLESv1_CM_nvidia.so",     # OpenGL ES v1 ICD.
    # Graphics (compat): legacy libraries _or_ GLVND loaders / wrappers.
    "libGL.so",
    "libEGL.so",
    "libGLESv1_CM.so",
    "libGLESv2.so",
)

VENDOR_NEUTRAL: frozenset[str] = frozenset(
    {"libGL.so", "libEGL.so", "libGLESv1_CM.so", "libGLESv2.so"})
GLVND_NEEDED_PREFIXES: tuple[str, ...] = (
    "libGLdispatch.so", "libnvidia-gl", "libnvidia-egl")
TLS_LIBRARY = "libnvidia-tls.so"
TLS_ABI_VERSION = "2.3.99"
GLX_LIBRARY = "libGLX_nvidia.so"

SUBDIRECTORIES: tuple[str, ...] = ("bin", "lib", "lib64")


class VolumeReport(msgspec.Struct, frozen=True):
    """What one build did: paths added (relative to ``host_path``), skips."""

    host_path: str
    added: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    tmpfs_mounted: bool = False


def volume_host_path(volume_dir: str, driver_version: str) -> str:
    """``<volume_dir>/nvidia_<driver_version>``; rejects unusable versions."""
    if (not driver_version or "/" in driver_version or "\0" in driver_version
            or driver_version in (".", "..")):
        raise VolumeError(
            f"Invalid driver version {driver_version!r}: it names the volume"
            " directory, so it must be non-empty and contain no '/'")
    return os.path.join(volume_dir, f"nvidia_{driver_version}")


def library_skip_reason(library: str, info: ElfInfo) -> str | None:
    """Why the cache entry matching ``library`` stays out, or ``None``."""
    if library in VENDOR_NEUTRAL:
        if not any(dep.startswith(GLVND_NEEDED_PREFIXES) for dep in info.needed):
            return ("vendor-neutral GL library that is neither GLVND's nor"
                    f" NVIDIA's (NEEDED: {', '.join(info.needed) or 'none'})")
    if library == TLS_LIBRARY and info.abi_version != TLS_ABI_VERSION:
        found = info.abi_version or "none"
        return f"TLS library with ABI {found}, not {TLS_ABI_VERSION}"
    return None


class _Builder:
    def __init__(self, host_path: str) -> None:
        self.host_path = host_path
        self.added: list[str] = []
        self.skipped: list[str] = []

    def skip(self, what: str, reason: str, warn: bool = False) -> None:
        self.skipped.append(f"{what}: {reason}")
        (logger.warning if warn else logger.debug)(
            "NVIDIA volume '%s': skipping %s: %s", self.host_path, what, reason)

    def mkdir(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise VolumeError(f"Failed to os::mkdir '{path}': {exc.strerror}") from None

    def copy(self, source: str, relative: str) -> None:
        target = os.path.join(self.host_path, relative)
        if os.path.lexists(target):
            return
        directory, name = os.path.split(target)
        partial = os.path.join(directory, f".{name}.partial-{os.getpid()}")
        try:
            shutil.copy2(source, partial)
            os.rename(partial, target)
        except OSError as exc:
            try:
                os.unlink(partial)
            except OSError:
                pass
            raise VolumeError(
                f"Failed to copy '{source}' to '{target}': {exc.strerror or exc}") from None
        self.added.append(relative)

    def link(self, relative: str, points_to: str) -> None:
        target = os.path.join(self.host_path, relative)
        if os.path.lexists(target):
            return
        try:
            os.symlink(points_to, target)
        except FileExistsError:
            return
        except OSError as exc:
            raise VolumeError(
                f"Failed to fs::symlink '{target}' -> '{points_to}': {exc.strerror}") from None
        self.added.append(relative)


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..")


def build_volume(
    volume_dir: str,
    driver_version: str,
    ld_cache: str | None = DEFAULT_LD_CACHE,
    search_path: str | None = None,
) -> VolumeReport:
    """Create or grow the volume for ``driver_version`` (blocking; R-VO-1)."""
    host_path = volume_host_path(volume_dir, driver_version)
    builder = _Builder(host_path)
    builder.mkdir(host_path)
    tmpfs_mounted = ensure_executable(host_path)
    for directory in SUBDIRECTORIES:
        builder.mkdir(os.path.join(host_path, directory))

    if search_path is None:
        search_path = os.environ.get("PATH", os.defpath)
    for binary in BINARIES:
        if os.path.lexists(os.path.join(host_path, "bin", binary)):
            continue
        found = shutil.which(binary, path=search_path)
        if found is None:
            builder.skip(binary, "not found on the search path")
            continue
        builder.copy(os.path.realpath(found), os.path.join("bin", binary))

    entries = read_ld_cache(ld_cache) if ld_cache is not None else []
    elves: dict[str, ElfInfo] = {}
    for library in LIBRARIES:
        for entry in entries:
            if not entry.is_elf or not entry.name.startswith(library):
                continue
            if not _safe_name(entry.name):
                builder.skip(f"{entry.name!r} ({entry.path})",
                             "not a plain file name", warn=True)
                continue
            real = os.path.realpath(entry.path)
            if not os.path.exists(real):
                builder.skip(f"{entry.name} ({entry.path})",
                             "the ld.so cache names a file that does not exist"
                             " (stale cache? run ldconfig)", warn=True)
                continue
            info = elves.get(real)
            if info is None:
                info = elves[real] = read_elf(real)
            reason = library_skip_reason(library, info)
            if reason is not None:
                builder.skip(f"{entry.name} ({real})", reason)
                continue
            subdir = "lib" if info.elf_class == 32 else "lib64"
            basename = os.path.basename(real)
            builder.copy(real, os.path.join(subdir, basename))
            builder.link(os.path.join(subdir, entry.name), basename)
            if library == GLX_LIBRARY:
                indirect = entry.name.replace("GLX_nvidia", "GLX_indirect")
                builder.link(os.path.join(subdir, indirect), basename)

    logger.info(
        "NVIDIA volume '%s' is ready: %d files and links added, %d cache"
        " entries or binaries skipped", host_path, len(builder.added),
        len(builder.skipped))
    return VolumeReport(
        host_path=host_path,
        added=tuple(builder.added),
        skipped=tuple(builder.skipped),
        tmpfs_mounted=tmpfs_mounted,
    )
