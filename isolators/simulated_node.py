"""The simulated node: the demo's, message scripts', tests' and benchmarks' node with no GPU.

Rules:
- ``SimulatedNode`` is a node with no GPU: a host file (a simulated NVML),
  an empty dev dir (control devices then come from the host file), runtime,
  work and volume dirs, all inside one directory, and a cgroups root of its
  own (``<prefix><random hex>``). Its flags are those paths, the device
  backend, its hierarchy and root, then ``extra`` (flags the caller adds),
  then what one call changes; they are read as a flags file is
  (``Flags.from_dict``: dashes or underscores, text or typed values).
- Construction does no I/O; ``create_files()`` makes the directory (a fresh
  temp dir when none was given, removed again by ``close()``), the dev dir
  and the host file, and for a host with MIG devices their capability
  facts under ``<dir>/proc``; ``await setup()`` does the same off the event loop.
- A node reads no host facts unless asked to: its ``proc_dir`` is
  ``<dir>/proc`` (no ``devices`` file unless a MIG host's facts are
  written there, so the host's ``/proc/devices`` never judges its control
  devices) and its ``ld_cache`` is ``<dir>/ld.so.cache``, an empty loader
  cache (its volume copies no host library). ``extra`` may point either at
  the host's on purpose.
- ``await start()`` builds components and an isolator from the flags (inside
  a ``runtime.Runtime``) and keeps them as ``components`` / ``isolator``;
  ``stop()`` drops every actor and cleans nothing up (an agent crash);
  ``restart()`` is stop, start and recover the containers the isolator held.
  ``async with node:`` is setup, start and an empty recover, then ``close()``.
- ``close()`` leaves nothing: it cleans up every container (starting an
  isolator to find them if none runs), removes the cgroups root, stops the
  actors and removes a directory it made. ``discard()`` is the blocking,
  forceful version for a finalizer: it forgets the in-memory cgroups of the
  root, or removes the kernel cgroup tree (``remove_cgroup_tree``).
- ``backend_unavailable(backend)`` says why a backend cannot run on this
  machine (kernel backends need root and their hierarchy), None when it can.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiofiles.os

from actors.flags import NODE_BACKENDS, Flags
from actors.mig.testing import write_proc_dir
from actors.nvml import HostFileError, load_host_file
from actors.volume.testing import write_ld_cache
from actors.devices import MemoryBackend, default_hierarchy

from ._components import NvidiaComponents
from ._handle import NvidiaGpuIsolator
from ._process import NvidiaGpuIsolatorProcess
from ._types import ContainerID, ContainerState

__all__ = [
    "DRIVER_VERSION", "SimulatedNode", "backend_unavailable",
    "host_document", "remove_cgroup_tree",
]

logger = logging.getLogger(__name__)

DRIVER_VERSION = "550.54.15"
_HIERARCHY_MARKER = {"cgroups_v1": "devices.allow", "cgroups_v2": "cgroup.controllers"}


def host_document(gpus: int = 8, driver_version: str = DRIVER_VERSION,
                  control_devices: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A host file's content: ``gpus`` plain GPUs (a count) of one driver."""
    document: dict[str, Any] = {"driver_version": driver_version, "gpu_count": gpus}
    if control_devices is not None:
        document["control_devices"] = dict(control_devices)
    return document


def backend_unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run on this machine; None when it can."""
    if backend not in NODE_BACKENDS:
        return f"unknown backend {backend!r} (expected one of {', '.join(NODE_BACKENDS)})"
    if backend == "memory":
        return None
    if os.geteuid() != 0:
        return f"{backend} needs root"
    hierarchy = default_hierarchy(backend)
    if hierarchy is None or not os.path.isfile(os.path.join(hierarchy, _HIERARCHY_MARKER[backend])):
        return f"no {backend} hierarchy at {hierarchy}"
    return None


def remove_cgroup_tree(root: str, evict: Callable[[str], None] | None = None, busy_timeout: float = 0.0) -> None:
    """Remove the cgroup ``root`` and every cgroup below it, deepest first
    (cgroups are only ever rmdir'ed). ``evict(path)`` runs before each rmdir
    (tests kill their probes there); an rmdir that fails with EBUSY is
    retried, evicting again, for ``busy_timeout`` seconds. A missing root is
    nothing to do; any other failure raises its ``OSError``."""
    if not os.path.isdir(root):
        return
    below = sorted((os.path.join(d, name) for d, subdirs, _ in os.walk(root) for name in subdirs),
                   key=lambda path: path.count("/"), reverse=True)
    for directory in [*below, root]:
        deadline = time.monotonic() + busy_timeout
        while True:
            if evict is not None:
                evict(directory)
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError as error:  # an evicted process takes a moment to leave
                if error.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)


class _Inside:
    """A path inside the node's directory (``node.path(name)``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, node: "SimulatedNode | None", owner: type | None = None) -> Any:
        return self if node is None else node.path(self.name)


class SimulatedNode:
    """A simulated node and the isolator running on it (see the module rules).

    ``directory``: where its files go (default: a temp dir of its own).
    ``host``: a host document (``host_document()`` by default, ``gpus``
    plain GPUs) or the path of an existing host file. ``cgroups_root``:
    default ``<root_prefix><12 hex>``. ``hierarchy``: default the backend's
    usual one. ``extra``: flags added to the node's own."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, backend: str = "memory", *,
                 gpus: int = 8, host: Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 cgroups_root: str | None = None, root_prefix: str = "gpu-isolator-node-",
                 hierarchy: str | None = None, extra: Mapping[str, Any] | None = None) -> None:
        if backend not in NODE_BACKENDS:
            raise ValueError(f"Unknown backend {backend!r}: expected one of {', '.join(NODE_BACKENDS)}")
        self.backend = backend
        self.hierarchy = hierarchy if hierarchy is not None else default_hierarchy(backend)
        self.cgroups_root = cgroups_root or f"{root_prefix}{uuid.uuid4().hex[:12]}"
        self._owns_directory = directory is None
        self.tmp: str | None = None if directory is None else os.fspath(directory)
        if isinstance(host, (str, os.PathLike)):
            self._host: Mapping[str, Any] | None = None
            self.host_file: str | None = os.path.abspath(os.fspath(host))
        else:
            self._host = host if host is not None else host_document(gpus)
            self.host_file = None
        self.extra: dict[str, Any] = dict(extra or {})
        self.components: NvidiaComponents | None = None
        self.isolator: NvidiaGpuIsolator | None = None

    # -- files ------------------------------------------------------------------
    def create_files(self) -> "SimulatedNode":
        """Make the directory, the dev dir and the host file (blocking)."""
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="gpu-isolator-node-")
        os.makedirs(self.dev_dir, exist_ok=True)
        os.makedirs(self.proc_dir, exist_ok=True)
        if not os.path.exists(self.ld_cache):
            write_ld_cache(self.ld_cache)
        if self.host_file is None:
            self.write_host(self._host)
        else:
            self._write_mig_facts()
        return self

    def _write_mig_facts(self) -> None:
        """A host with MIG devices gets the capability facts a driver would have
        under ``<dir>/proc`` (``actors.mig.testing.write_proc_dir``)."""
        try:
            spec = load_host_file(self.host_file)
        except HostFileError:
            return  # a bad host file is the start's error to report, not this one's
        if any(gpu.mig_devices for gpu in spec.gpus):
            write_proc_dir(self.proc_dir, spec)

    async def setup(self) -> "SimulatedNode":
        """``create_files()`` off the event loop."""
        await aiofiles.os.wrap(self.create_files)()
        return self

    def write_host(self, data: Mapping[str, Any] | None = None, *, toml: str | None = None,
                   name: str = "host.json") -> str:
        """Write a host file (JSON from ``data``, or TOML text) and use it from now on."""
        if toml is not None:
            path = self.path(name if name.endswith(".toml") else "host.toml")
            with open(path, "w") as handle:
                handle.write(toml)
        else:
            path = self.path(name)
            with open(path, "w") as handle:
                json.dump(dict(data or {}), handle)
        self.host_file = path
        self._write_mig_facts()
        return path

    def path(self, *names: str) -> str:
        """A path inside the node's directory."""
        if self.tmp is None:
            raise RuntimeError("the node has no directory yet: call create_files() or setup() first")
        return os.path.join(self.tmp, *names)

    dev_dir = _Inside("dev")
    runtime_dir = _Inside("run")
    work_dir = _Inside("work")
    volume_dir = _Inside("volume")
    proc_dir = _Inside("proc")
    """The node's kernel facts (``--proc_dir``): a MIG host's capability facts, no ``devices`` otherwise."""
    ld_cache = _Inside("ld.so.cache")
    """The node's loader cache (``--ld_cache``): empty, no driver library to copy."""

    # -- flags and actors -----------------------------------------------------------
    def flag_values(self, changes: Mapping[str, Any] | None = None, /, **more: Any) -> dict[str, Any]:
        """The node's flags as a mapping: its own, then ``extra``, then
        ``changes`` and ``more`` (a mapping as a script or flags file writes it)."""
        return {
            "host_file": self.host_file,
            "dev_dir": self.dev_dir,
            "runtime_dir": self.runtime_dir,
            "work_dir": self.work_dir,
            "volume_dir": self.volume_dir,
            "device_backend": self.backend,
            "cgroups_hierarchy": self.hierarchy,
            "cgroups_root": self.cgroups_root,
            "proc_dir": self.proc_dir,
            "ld_cache": self.ld_cache,
            **self.extra,
            **(changes or {}),
            **more,
        }

    def flags(self, changes: Mapping[str, Any] | None = None, /, **more: Any) -> Flags:
        """The node's ``Flags`` (see ``flag_values``)."""
        return Flags.from_dict(self.flag_values(changes, **more))

    async def start(self, changes: Mapping[str, Any] | None = None, /, *, devices: Any = None,
                    **more: Any) -> tuple[NvidiaComponents, NvidiaGpuIsolator]:
        """Components and an isolator from the flags (inside a Runtime); kept
        on the node. ``devices``: a device control to use instead of the
        flags' (fault injection)."""
        flags = self.flags(changes, **more)
        components = await NvidiaComponents.create(flags)
        try:
            isolator = await NvidiaGpuIsolatorProcess.create(flags, components, devices=devices)
        except BaseException:
            await components.close()
            raise
        self.components, self.isolator = components, isolator
        return components, isolator

    async def stop(self) -> None:
        """Drop every actor and clean nothing up (an agent crash or restart)."""
        isolator, components = self.isolator, self.components
        self.isolator = self.components = None
        try:
            if isolator is not None:
                await isolator.close()
        finally:
            if components is not None:
                await components.close()

    async def restart(self, known: Iterable[str] | None = None, orphans: Iterable[str] = (), *,
                      recover: bool = True, changes: Mapping[str, Any] | None = None,
                      **start: Any) -> tuple[NvidiaComponents, NvidiaGpuIsolator]:
        """Drop every actor, start again (``start(changes, **start)``) and
        recover ``known`` containers (default: every one the isolator held)
        and ``orphans``."""
        if known is None:
            known = list((await self.isolator.containers()).keys()) if self.isolator is not None else []
        known = sorted(known)
        await self.stop()
        components, isolator = await self.start(changes, **start)
        if recover:
            await isolator.recover([ContainerState(ContainerID.parse(c)) for c in known],
                                   {ContainerID.parse(o) for o in orphans})
        return components, isolator

    async def clean_all(self) -> bool:
        """Clean up every container the isolator knows and remove the cgroups
        root; whether the root is gone."""
        if self.isolator is None:
            return False
        for cid in sorted(await self.isolator.containers()):
            await self.isolator.cleanup(ContainerID.parse(cid))
        return await self.isolator.devices.remove_root()

    async def close(self) -> None:
        """Leave nothing behind (see the module rules); failures are logged."""
        try:
            if self.isolator is None and self.tmp is not None and self.host_file is not None:
                try:
                    await self.start()
                    await self.isolator.recover([], set())
                except Exception as e:
                    logger.warning("simulated node %s: cannot start an isolator to clean up: %s", self.cgroups_root, e)
            if self.isolator is not None:
                for cid in sorted(await self.isolator.containers()):
                    try:
                        await self.isolator.cleanup(ContainerID.parse(cid))
                    except Exception as e:
                        logger.warning("simulated node %s: cleanup of %s failed: %s", self.cgroups_root, cid, e)
                if not await self.isolator.devices.remove_root():
                    logger.warning("simulated node: the cgroups root %s was not removed", self.cgroups_root)
        finally:
            await self.stop()
            if self._owns_directory and self.tmp is not None:
                await aiofiles.os.wrap(shutil.rmtree)(self.tmp, ignore_errors=True)

    async def __aenter__(self) -> "SimulatedNode":
        try:
            await self.setup()
            await self.start()
            await self.isolator.recover([], set())
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def discard(self, evict: Callable[[str], None] | None = None, busy_timeout: float = 0.0) -> None:
        """Forget the root's in-memory cgroups, or remove its kernel cgroup tree
        (``remove_cgroup_tree`` with ``evict``); blocking, for finalizers."""
        if self.backend == "memory":
            MemoryBackend.drop_shared(self.root)
        else:
            remove_cgroup_tree(self.root, evict, busy_timeout)

    # -- what the kernel holds -------------------------------------------------------
    @property
    def root(self) -> str:
        """The cgroups root: its directory on a kernel backend, the in-memory
        table's name (``memory:/<cgroups_root>``) otherwise."""
        if self.hierarchy is None:
            return f"memory:/{self.cgroups_root}"
        return os.path.join(self.hierarchy, self.cgroups_root)

    def cgroups(self) -> list[str]:
        """Every cgroup below the root (relative names), as the kernel (or the
        in-memory table) lists them."""
        if self.backend == "memory":
            return sorted(MemoryBackend.shared_table(self.root) or {})
        if not os.path.isdir(self.root):
            return []
        return sorted(os.path.relpath(os.path.join(d, name), self.root)
                      for d, subdirs, _ in os.walk(self.root) for name in subdirs)

    def cgroup_exists(self, name: str) -> bool:
        return name in self.cgroups()

    def root_exists(self) -> bool:
        if self.backend == "memory":
            return MemoryBackend.shared_table(self.root) is not None
        return os.path.isdir(self.root)
