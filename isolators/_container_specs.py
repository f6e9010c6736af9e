"""The isolator's transient CDI specs: one per top-level container (R-CD-1).

Rules:
- Nothing is written unless ``Flags.cdi_spec_dir`` is set (``enabled``);
  ``grant`` works either way (every launch info carries the grant for
  ``to_oci()``).
- ``grant(gpus, extras)``: the container's GPU nodes by minor (a MIG
  device: its parent's node and its capability nodes), the control
  devices, ``NVIDIA_VISIBLE_DEVICES`` (``MIG-…`` UUIDs for MIG devices), and -- when the driver volume is
  injected -- its read-only mount and its PATH / LD_LIBRARY_PATH as the
  grant's ``loader_environment`` (``isolators.cdi.container_grant``; for
  ``to_oci()``). The spec renders the volume through the
  ``DriverInjection`` (its mount, binaries at ``/usr/bin``, the
  loader-cache hook) and never sets PATH or LD_LIBRARY_PATH (R-DR-2). ``extras_for(config)`` decides the
  volume part from the docker manifest as Mesos does (R-VO-2), with or
  without a rootfs: an engine brings its own.
- ``attach`` (prepare) writes the spec and gives the launch info its grant
  and ``cdi_devices``; ``attach_nested`` gives a nested container's launch
  info its top-level container's.
- ``write`` renders the one-device spec (``container_spec``) and writes it
  atomically: ONE executor job. The extras are remembered per container,
  so an update rewrites the same mounts and environment. ``remove`` is one
  job too. A spec that cannot be written or removed raises an
  ``IsolatorError`` with the ``CdiWriteError`` chained; nothing half-written
  stays (temp + rename).
- ``ensure`` (reconcile) rewrites a spec only when it is missing or its
  bytes differ from the grant, and says which.
- ``recover(known, untouched)``: one job reads our specs (a recovered
  container keeps the volume part its spec had), one job rewrites the
  missing or stale ones and removes ours that name no known container,
  and the temporaries a crashed write left. A spec of a known container
  that cannot be read (not a CDI document, a ``cdiVersion`` this release
  does not know: CDI's own format version is the spec's) is moved aside
  first in that job (``actors.file_format.set_aside``:
  ``<name>.unreadable-<time>``, which no engine reads: they read only
  ``*.json`` and ``*.yaml``) and rewritten from the grant the kernel
  showed; its line goes to the errors (SPEC R-SH-3). Specs of containers in
  ``untouched`` (device state unknown) stay as they are. Only files named
  ``gpu-isolator-container_*`` are ever touched.
- Ids are checked (``check_container_id``) before a file name is made.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from actors import Gpu, NvidiaVolume
from actors.file_format import set_aside
from actors.devices import DeviceRule
from actors.mig import MigCapabilities
from actors.nvml import NodeInventory
from runtime import Executor

from ._errors import IsolatorError
from ._types import ContainerBindMount, ContainerConfig, ContainerGrant, ContainerID, ContainerLaunchInfo
from .cdi import (
    CONTAINER_SPEC_PREFIX,
    CdiSpecError,
    CdiWriteError,
    apply_spec_changes,
    container_device_name,
    container_grant,
    container_qualified_name,
    container_spec,
    container_spec_file_name,
    decode_spec,
    encode_spec,
    ensure_spec_file,
    is_temporary_name,
    list_spec_files,
    read_spec_files,
    remove_spec_file,
    spec_extras,
    write_spec_file,
)
from .cdi import DriverInjection, hook_program

__all__ = ["ContainerSpecs", "SpecExtras"]

SpecExtras = tuple[tuple[ContainerBindMount, ...], dict[str, str]]
"""The volume part of a grant: its bind mounts and their environment."""

_NONE: SpecExtras = ((), {})


class ContainerSpecs:
    """Transient CDI specs of one isolator's containers (see the module rules)."""

    def __init__(self, directory: str | None, dev_dir: str, inventory: NodeInventory,
                 control_devices: Mapping[str, DeviceRule], volume: NvidiaVolume, executor: Executor,
                 caps: MigCapabilities | None = None, injection: DriverInjection | None = None) -> None:
        self.directory = directory
        self.dev_dir = dev_dir
        self.uuids: dict[Any, str] = {info.gpu: info.uuid for info in inventory.gpus}
        self.uuids.update({mig.device: mig.uuid for mig in inventory.mig_devices})
        self.caps = caps
        """MIG capability facts (a node handing out MIG devices)."""
        self.control_devices = dict(control_devices)
        self.volume = volume
        self.injection = injection or DriverInjection(program=hook_program())
        """How a spec injects the driver volume (mount, binaries, hook)."""
        self.executor = executor
        self._extras: dict[ContainerID, SpecExtras] = {}

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    # -- the grant ----------------------------------------------------------------
    def extras_for(self, config: ContainerConfig) -> SpecExtras:
        """The driver volume's mount and environment when it is injected for ``config``."""
        manifest = config.docker_manifest
        if manifest is None or not self.volume.should_inject(manifest):
            return _NONE
        mount = ContainerBindMount(host_path=self.volume.host_path, container_path=self.volume.container_path)
        return (mount,), self.volume.env(manifest)

    def grant(self, container_id: ContainerID, gpus: Iterable[Gpu], extras: SpecExtras | None = None) -> ContainerGrant:
        """The grant of a container holding ``gpus`` (its remembered extras unless given)."""
        mounts, env = extras if extras is not None else self._extras.get(container_id.root(), _NONE)
        return container_grant(gpus, self.uuids, self.control_devices, self.dev_dir,
                               volume=mounts[0] if mounts else None, volume_env=env, caps=self.caps)

    def names(self, container_id: ContainerID) -> list[str]:
        """The ``cdi_devices`` of a launch info: the top-level container's device (none when disabled)."""
        return [container_qualified_name(container_id)] if self.enabled else []

    async def attach(self, container_id: ContainerID, gpus: Iterable[Gpu], config: ContainerConfig,
                     launch: ContainerLaunchInfo | None) -> ContainerLaunchInfo | None:
        """Prepare: write the container's spec (when enabled) and give the launch
        info its grant and ``cdi_devices``; when enabled, a launch info even
        without a rootfs."""
        extras = self.extras_for(config)
        if self.enabled:
            await self.write(container_id, gpus, extras)
            launch = launch if launch is not None else ContainerLaunchInfo()
            launch.cdi_devices = self.names(container_id)
        if launch is not None:
            launch.grant = self.grant(container_id, gpus, extras)
        return launch

    def attach_nested(self, container_id: ContainerID, launch: ContainerLaunchInfo | None,
                      root_gpus: Iterable[Gpu]) -> ContainerLaunchInfo | None:
        """A nested container's launch info: its top-level container's grant and device."""
        if launch is None and self.enabled:
            launch = ContainerLaunchInfo()
        if launch is not None:
            launch.grant = self.grant(container_id.root(), root_gpus)
            launch.cdi_devices = self.names(container_id)
        return launch

    def _document(self, container_id: ContainerID, gpus: Iterable[Gpu], extras: SpecExtras) -> tuple[str, bytes]:
        spec = container_spec(container_device_name(container_id), self.grant(container_id, gpus, extras),
                               self.injection)
        return container_spec_file_name(container_id), encode_spec(spec)

    def path(self, container_id: ContainerID) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, container_spec_file_name(container_id))

    # -- files (one executor job each) -----------------------------------------------
    async def write(self, container_id: ContainerID, gpus: Iterable[Gpu], extras: SpecExtras | None = None) -> None:
        """Write (or rewrite) the container's spec; remembers ``extras`` once written."""
        if self.directory is None:
            return
        extras = extras if extras is not None else self._extras.get(container_id, _NONE)
        name, data = self._document(container_id, gpus, extras)
        try:
            await self.executor.run(write_spec_file, self.directory, name, data)
        except CdiWriteError as error:
            raise IsolatorError(str(error)) from error
        self._extras[container_id] = extras

    async def remove(self, container_id: ContainerID) -> None:
        """Remove the container's spec (a missing one is fine) and forget its extras."""
        if self.directory is None:
            return
        try:
            await self.executor.run(remove_spec_file, self.directory, container_spec_file_name(container_id))
        except CdiWriteError as error:
            raise IsolatorError(str(error)) from error
        self._extras.pop(container_id, None)

    async def ensure(self, container_id: ContainerID, gpus: Iterable[Gpu]) -> str | None:
        """Reconcile: rewrite a missing or changed spec; the repair said in words, or None."""
        if self.directory is None:
            return None
        name, data = self._document(container_id, gpus, self._extras.get(container_id, _NONE))
        try:
            state = await self.executor.run(ensure_spec_file, self.directory, name, data)
        except CdiWriteError as error:
            raise IsolatorError(str(error)) from error
        if state is None:
            return None
        what = "was missing" if state == "missing" else "differed from the grant"
        return f"CDI spec '{self.path(container_id)}' {what}; rewritten"

    async def recover(self, known: Mapping[ContainerID, Iterable[Gpu]],
                      untouched: Iterable[ContainerID]) -> tuple[list[str], list[str]]:
        """Bring the directory in line with the recovered containers: the report
        lines, and the errors (specs nobody could read, moved aside)."""
        if self.directory is None:
            return [], []
        directory = self.directory
        try:
            found, present = await self.executor.run(_read_ours, directory)
        except CdiWriteError as error:
            raise IsolatorError(str(error)) from error
        report: list[str] = []
        unreadable: dict[str, str] = {}
        writes: list[tuple[str, bytes]] = []
        keep = {container_spec_file_name(cid) for cid in untouched}
        for cid, gpus in known.items():
            name = container_spec_file_name(cid)
            keep.add(name)
            extras = _NONE
            if name in found:
                try:
                    extras = spec_extras(decode_spec(found[name], "json", f"'{os.path.join(directory, name)}'"))
                except CdiSpecError as error:
                    unreadable[name] = f"Container {cid}: {error}"
            self._extras[cid] = extras
            name, data = self._document(cid, gpus, extras)
            if name in unreadable:
                writes.append((name, data))
            elif found.get(name) != data:
                writes.append((name, data))
                what = "was missing" if name not in found else "did not match the recovered grant"
                report.append(f"Container {cid}: CDI spec '{os.path.join(directory, name)}' {what}; rewritten")
        removals = [name for name in present if name not in keep]
        for name in removals:
            if not is_temporary_name(name):
                report.append(f"CDI spec '{os.path.join(directory, name)}' names no known container; removed")
        errors: list[str] = []
        if writes or removals:
            try:
                moved = await self.executor.run(_apply_recovery, directory, sorted(unreadable), writes, removals)
            except CdiWriteError as error:
                raise IsolatorError(str(error)) from error
            errors = [f"{unreadable[name]}; moved aside to '{moved[name]}' and rewritten from the recovered grant"
                      for name in sorted(unreadable)]
        return report, errors


def _apply_recovery(directory: str, unreadable: list[str], writes: list[tuple[str, bytes]],
                    removals: list[str]) -> dict[str, str]:
    """One blocking call: move the unreadable specs aside, then write and remove (``apply_spec_changes``)."""
    moved: dict[str, str] = {}
    for name in unreadable:
        try:
            moved[name] = set_aside(os.path.join(directory, name))
        except OSError as error:
            raise CdiWriteError(f"Failed to move the unreadable CDI spec '{os.path.join(directory, name)}'"
                                f" aside: {error.strerror}") from error
    apply_spec_changes(directory, writes, removals)
    return moved


def _read_ours(directory: str) -> tuple[dict[str, bytes], list[str]]:
    """Our specs' bytes and every file of ours (temporaries too): one blocking call."""
    return read_spec_files(directory, CONTAINER_SPEC_PREFIX), list_spec_files(directory, CONTAINER_SPEC_PREFIX)
