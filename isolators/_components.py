"""NvidiaComponents: the actors an NVIDIA GPU isolator shares with its agent.

Rules (Mesos ``gpu/components.hpp``):
- ``await NvidiaComponents.create(flags)`` opens the node's NVML off the
  event loop (the simulated node of ``flags.host_file``; without one, the
  real NVML and nothing else, R-NV-1), computes the GPU resources (R-FL-1:
  invalid flags raise before any actor is spawned), spawns the allocator
  actor over the managed GPUs, and builds the NVIDIA volume for the driver
  version once.
- No usable NVML (no host file, and the library or driver missing or
  failing to initialise) → ``IsolatorError`` naming NVML's own error and
  how to use a host file instead, with the ``NvmlError`` as ``__cause__``;
  nothing is spawned or written. The library never invents GPUs.
- The allocator may be shared by several isolators; the components hold no
  per-container state.
- ``close()`` terminates what it spawned and shuts NVML down (an agent
  restart drops them).
"""

from __future__ import annotations

import logging

import msgspec

from actors import NvidiaGpuAllocator, NvidiaVolume
from actors.flags import Flags
from actors.nvml import NodeInventory, NvmlError, NvmlService, NvmlUnavailable
from actors.resources import Resources

from ._errors import IsolatorError

logger = logging.getLogger(__name__)


class NvidiaComponents(msgspec.Struct):
    """The allocator, volume and NVML service of one node (a holder of handles:
    never encoded)."""

    flags: Flags
    resources: Resources
    """The node's ``gpus`` resource (R-FL-1)."""
    allocator: NvidiaGpuAllocator
    volume: NvidiaVolume
    nvml: NvmlService
    inventory: NodeInventory

    @classmethod
    async def create(cls, flags: Flags) -> "NvidiaComponents":
        """Build the components for ``flags`` (see the module rules)."""
        try:
            nvml = await NvmlService.open(flags.host_file)
        except NvmlError as exc:
            raise IsolatorError(_nvml_failed(flags, exc)) from exc
        allocator = volume = None
        try:
            resources = await nvml.call(NvidiaGpuAllocator.resources, flags, nvml.nvml)
            inventory = await nvml.inventory()
            allocator = await NvidiaGpuAllocator.create(flags, resources, nvml=nvml)
            volume = await NvidiaVolume.create(flags.volume_dir, inventory.driver_version, ld_cache=flags.ld_cache)
        except BaseException:
            if allocator is not None:
                await allocator.close()
            await nvml.close()
            raise
        return cls(flags, resources, allocator, volume, nvml, inventory)

    async def close(self) -> None:
        """Terminate the component actors and shut NVML down."""
        await self.volume.close()
        await self.allocator.close()
        await self.nvml.close()


def _nvml_failed(flags: Flags, error: NvmlError) -> str:
    """Why NVML cannot serve this node, and what to do instead."""
    if flags.host_file is not None:
        return f"Failed to initialize the simulated node {flags.host_file!r}: {error}"
    message = f"Failed to initialize NVML (no host file given, so the real NVML is required): {error}"
    if not isinstance(error, NvmlUnavailable):  # its message already says how
        message += "; without the driver, set '--host_file' (Flags.host_file) to a host file to use a simulated node"
    return message
