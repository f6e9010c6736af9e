"""What a container holding an MPS share gets through CDI (R-MP-3).

Rules:
- ``mps_edits(pipe_dir, shm_dir)``: the daemon's pipe directory bound at
  ``MPS_PIPE_DIRECTORY`` (``/tmp/nvidia-mps``, R-MP-8) with
  ``CUDA_MPS_PIPE_DIRECTORY`` naming it, and the unit's shared-memory
  directory bound at ``/dev/shm`` (MPS clients and their server meet
  there too), both read-write, ``nosuid``, ``nodev`` -- the edits NVIDIA's
  DRA driver gives an MPS claim's containers. Nothing else: the unit's
  device nodes are the grant's (``container_grant``), and no other unit's
  pipe directory, log or shared memory is named.
- ``add_mps(spec, pipe_dir, shm_dir)`` adds those edits to a container's
  one-device spec (``container_spec``) and returns the new spec; a spec
  that already has an MPS pipe directory, ``/dev/shm`` mount or
  ``CUDA_MPS_PIPE_DIRECTORY`` is refused (``ValueError``): a container has
  one share, since two daemons' pipes cannot both be at one path.
- Both paths must be absolute. Pure: no I/O.
"""

from __future__ import annotations

import posixpath

import msgspec

from ._model import CdiContainerEdits, CdiMount, CdiSpec
from ._rules import required_version

__all__ = ["MPS_PIPE_DIRECTORY", "MPS_PIPE_ENV", "MPS_SHM", "mps_edits", "add_mps"]

MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_SHM = "/dev/shm"
_OPTIONS = ["rw", "nosuid", "nodev", "rbind"]


def mps_edits(pipe_dir: str, shm_dir: str) -> CdiContainerEdits:
    """The edits of one MPS share (see module rules)."""
    for what, path in (("pipe directory", pipe_dir), ("shared-memory directory", shm_dir)):
        if not posixpath.isabs(path):
            raise ValueError(f"The MPS {what} must be an absolute path, got {path!r}")
    return CdiContainerEdits(
        env=[f"{MPS_PIPE_ENV}={MPS_PIPE_DIRECTORY}"],
        mounts=[
            CdiMount(host_path=pipe_dir, container_path=MPS_PIPE_DIRECTORY, options=list(_OPTIONS)),
            CdiMount(host_path=shm_dir, container_path=MPS_SHM, options=list(_OPTIONS)),
        ],
    )


def add_mps(spec: CdiSpec, pipe_dir: str, shm_dir: str) -> CdiSpec:
    """``spec`` with one MPS share's edits added to its one device (see module rules)."""
    if len(spec.devices) != 1:
        raise ValueError(f"An MPS share is added to a container's one-device spec, got {len(spec.devices)} devices")
    device = spec.devices[0]
    edits = device.container_edits
    taken = [m.container_path for m in edits.mounts if m.container_path in (MPS_PIPE_DIRECTORY, MPS_SHM)]
    taken += [e.split("=", 1)[0] for e in edits.env if e.split("=", 1)[0] == MPS_PIPE_ENV]
    if taken:
        raise ValueError(f"Container device {device.name!r} already has {', '.join(taken)}: a container holds"
                         " one MPS share")
    extra = mps_edits(pipe_dir, shm_dir)
    merged = msgspec.structs.replace(edits, env=[*edits.env, *extra.env], mounts=[*edits.mounts, *extra.mounts])
    spec = msgspec.structs.replace(spec, devices=[msgspec.structs.replace(device, container_edits=merged)])
    return msgspec.structs.replace(spec, cdi_version=required_version(spec))
