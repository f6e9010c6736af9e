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
- ``join_ledger(owner)``: the front door these components serve joins the
  node ledger ``flags`` name (SPEC R-NL-1; ``actors.ledger.node_ledger_dir``:
  on by default on the real NVML, off on a simulated node unless given) as
  ``owner`` (``actors.ledger.isolator_owner(work_dir)``,
  ``serve_owner(socket)``, ``kubelet_plugin_owner(resource)``,
  ``dra_plugin_owner(driver)``), saying at start where the ledger is or that
  it is off; from then on the allocator takes and returns its leases. A
  failure (another process of that owner runs, an untrusted directory) is
  an ``IsolatorError`` naming it. The isolator's ``create`` calls it; a
  front door without an isolator (the Kubernetes plugins) calls it itself.
- ``close()`` terminates what it spawned and shuts NVML down (an agent
  restart drops them); the allocator first returns the leases no holder
  has and releases the owner's lock.
"""

from __future__ import annotations

import logging

import msgspec

from actors import NvidiaGpuAllocator, NvidiaVolume
from actors.allocator import LedgerState
from actors.flags import Flags
from actors.ledger import describe_node_ledger, node_ledger_dir
from actors.nvml import NodeInventory, NvmlError, NvmlService, NvmlUnavailable
from actors.resources import Resources

from ._errors import IsolatorError, as_isolator_error

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

    async def join_ledger(self, owner: str) -> LedgerState | None:
        """Join the node ledger of ``self.flags`` as ``owner`` (see module rules);
        its state as joined, None when the ledger is off."""
        try:
            directory = node_ledger_dir(self.flags)
            if directory is None:  # turned off on the real NVML: a warning; a simulated node has none by default
                simulated = self.flags.host_file is not None and self.flags.node_ledger is None
                logger.log(logging.INFO if simulated else logging.WARNING, "%s", describe_node_ledger(self.flags))
                return None
            logger.info("%s (as %s)", describe_node_ledger(self.flags), owner)
            return await self.allocator.join_ledger(directory, owner)
        except Exception as error:
            raise as_isolator_error(error) from error

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
