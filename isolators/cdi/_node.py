"""The node's static CDI spec (``gpu-isolator cdi generate``), kind ``nvidia.com/gpu``.

Rules:
- One device per GPU named by its NVML index (``nvidia.com/gpu=0``), one
  per GPU named by its UUID (``nvidia.com/gpu=GPU-...``), in index order,
  and ``all`` with every GPU: NVIDIA's own generator's names. Each holds
  only its GPU node(s).
- MIG devices (R-MG-3), when the node has them: one device per MIG device
  named ``<gpu index>:<mig index>`` and one named by its ``MIG-…`` UUID (as
  NVIDIA's generator names them), after the GPUs' names of each kind; each
  holds its parent's node and its two capability nodes
  (``/dev/nvidia-caps/nvidia-cap<minor>``, read-only: ``r``, mode 0444,
  as real capability nodes are). ``all`` holds every GPU node and every
  MIG device's capability nodes, each once (compute instances of one GPU
  instance share its capability node). Their facts come from ``--proc_dir``; a
  node whose MIG devices have none is one clear error.
- The shared edits (applied once whatever devices are asked for) hold the
  control devices and the driver volume as ``DriverInjection.edits`` gives
  it: its read-only bind mount at ``/usr/local/nvidia``, its binaries at
  ``/usr/bin``, the hook that puts its libraries in the container's loader
  cache -- never a PATH or LD_LIBRARY_PATH (R-DR-2).
  ``NVIDIA_VISIBLE_DEVICES`` is not set here: two devices asked for
  together would each set it. A per-container spec sets it exactly.
- Device nodes carry type, numbers, mode 0666 and ``rwm``; ``hostPath``
  appears only when ``dev_dir`` is not ``/dev``; ``cdiVersion`` is the
  lowest the fields need (0.5.0 here: device names by index start with a
  digit).
- ``generate_node_spec`` reads the node: NVML (or the host file; without
  either it fails with NVML's error, never inventing a GPU), the control
  devices from ``dev_dir`` (or the host file's numbers), and builds the
  driver volume under ``volume_dir``. It needs a running ``Runtime``.
  ``read_node_facts`` is that reading for a node whose inventory and
  volume a caller already has (the kubelet plugin's components; the hook's
  program from ``Flags.cdi_hook``, the binaries from the volume's ``bin/``);
  ``NodeFacts.spec`` renders the same spec from them.
- A simulated node reads no fact of this machine unless asked (as
  ``SimulatedNode`` does): ``loader_cache=False`` builds the volume from no
  loader cache and no search path (no library or binary of this machine in
  it), ``kernel_facts=False`` reads nothing from ``proc_dir`` (MIG devices
  then have no capability facts: an error that names ``proc_dir``).
"""

from __future__ import annotations

from typing import Mapping

import msgspec

from actors import NvidiaVolume
from actors.devices import DeviceRule
from actors.flags import Flags
from actors.nvml import NodeInventory, NvmlService
from runtime import Executor

from actors.mig import MigCapabilities, read_mig_capabilities

from .._types import ContainerBindMount
from ._container import device_node
from ._driver import DriverInjection, hook_program, volume_binaries
from ._grant import capability_devices, control_device, gpu_device
from ._model import CdiContainerEdits, CdiDevice, CdiSpec
from ._rules import CdiSpecError, required_version

__all__ = ["NODE_KIND", "NodeFacts", "node_spec", "read_node_facts", "generate_node_spec"]

NODE_KIND = "nvidia.com/gpu"


def node_spec(
    inventory: NodeInventory,
    control_devices: Mapping[str, DeviceRule],
    dev_dir: str,
    *,
    volume: ContainerBindMount | None = None,
    injection: DriverInjection | None = None,
    caps: MigCapabilities | None = None,
) -> CdiSpec:
    """The static spec of a node (see the module rules); ``injection``: how the volume is injected (needed
    with a volume); ``caps``: the MIG capability facts (needed when the node has MIG devices)."""
    if volume is not None and injection is None:
        raise CdiSpecError("A node spec with the driver volume needs its DriverInjection (mounts, binaries, hook)")
    gpus = sorted(inventory.gpus, key=lambda info: info.index)
    if not gpus:
        raise CdiSpecError(f"The node ({inventory.source}) has no GPUs: there is no CDI device to describe")
    nodes = {info.index: device_node(gpu_device(info.gpu, dev_dir)) for info in gpus}
    migs = sorted(inventory.mig_devices, key=lambda mig: (mig.parent_index, mig.index))
    if migs:
        if caps is None:
            raise CdiSpecError(f"The node ({inventory.source}) has MIG devices but no capability facts were read")
        caps.require(mig.device for mig in migs)
    mig_nodes = {
        mig.device: [nodes[mig.parent_index]]
        + [device_node(device) for device in capability_devices(mig.device, caps, dev_dir)]
        for mig in migs
    }
    devices = [CdiDevice(name=str(info.index), container_edits=CdiContainerEdits(device_nodes=[nodes[info.index]]))
               for info in gpus]
    devices += [CdiDevice(name=f"{mig.parent_index}:{mig.index}",
                          container_edits=CdiContainerEdits(device_nodes=mig_nodes[mig.device])) for mig in migs]
    devices += [CdiDevice(name=info.uuid, container_edits=CdiContainerEdits(device_nodes=[nodes[info.index]]))
                for info in gpus]
    devices += [CdiDevice(name=mig.uuid, container_edits=CdiContainerEdits(device_nodes=mig_nodes[mig.device]))
                for mig in migs]
    every = list(nodes.values()) + [node for mig in migs for node in mig_nodes[mig.device][1:]]
    every = list({node.path: node for node in every}.values())  # compute instances of one GPU instance share its cap
    devices.append(CdiDevice(name="all", container_edits=CdiContainerEdits(device_nodes=every)))
    driver = injection.edits([volume]) if volume is not None and injection is not None else CdiContainerEdits()
    shared = CdiContainerEdits(
        device_nodes=[device_node(control_device(path, rule)) for path, rule in control_devices.items()],
        mounts=driver.mounts,
        hooks=driver.hooks,
    )
    spec = CdiSpec(cdi_version="0.3.0", kind=NODE_KIND, devices=devices,
                   container_edits=None if shared.is_empty() else shared)
    return msgspec.structs.replace(spec, cdi_version=required_version(spec))


class NodeFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What a node's spec (and a grant on it) needs beyond the inventory:
    the control devices by path, the driver volume's mount and how it is
    injected (binaries, hook), and the MIG capability facts (None on a node
    without MIG devices)."""

    control_devices: dict[str, DeviceRule]
    volume: ContainerBindMount | None
    injection: DriverInjection
    caps: MigCapabilities | None = None

    def spec(self, inventory: NodeInventory, dev_dir: str) -> CdiSpec:
        """The node's static spec from these facts."""
        return node_spec(inventory, self.control_devices, dev_dir, volume=self.volume,
                         injection=self.injection, caps=self.caps)


async def read_node_facts(flags: Flags, inventory: NodeInventory, volume: NvidiaVolume, *,
                          kernel_facts: bool = True) -> NodeFacts:
    """The facts of the node ``inventory`` describes: control devices from
    ``flags.dev_dir`` (or the host file's numbers), the volume's mount and
    environment, capability facts from ``flags.proc_dir`` (blocking reads on
    a one-thread executor of their own); ``kernel_facts=False``: nothing is
    read from ``proc_dir`` (see the module rules)."""
    from .._startup import find_control_devices  # the isolator imports this package

    host_numbers = dict(inventory.control_devices) if inventory.kind == "simulated" else None
    control = await executor_run_once(find_control_devices, flags, host_numbers, kernel_facts)
    caps = None
    if inventory.mig_devices:
        if not kernel_facts:
            raise CdiSpecError(f"The node ({inventory.source}) has MIG devices, whose capability facts come from a"
                               " proc dir; this simulated node reads none of this machine's: name one (proc_dir)")
        caps = await executor_run_once(read_mig_capabilities, flags.proc_dir)
    mount = ContainerBindMount(host_path=volume.host_path, container_path=volume.container_path)
    binaries = await executor_run_once(volume_binaries, volume.host_path)
    injection = DriverInjection(program=hook_program(flags.cdi_hook), binaries=binaries)
    return NodeFacts(control_devices=dict(control), volume=mount, injection=injection, caps=caps)


async def generate_node_spec(flags: Flags, *, loader_cache: bool = True, kernel_facts: bool = True) -> CdiSpec:
    """Read the node named by ``flags`` (host_file, dev_dir, volume_dir, ld_cache,
    proc_dir) into its static spec; ``loader_cache`` / ``kernel_facts``: read
    ``ld_cache`` and the search path / ``proc_dir`` at all (see the module rules)."""
    nvml = await NvmlService.open(flags.host_file)
    try:
        inventory = await nvml.inventory()
    finally:
        await nvml.close()
    volume = await NvidiaVolume.create(flags.volume_dir, inventory.driver_version,
                                       ld_cache=flags.ld_cache if loader_cache else None,
                                       search_path=None if loader_cache else "")
    try:
        facts = await read_node_facts(flags, inventory, volume, kernel_facts=kernel_facts)
    finally:
        await volume.close()
    return facts.spec(inventory, flags.dev_dir)


async def executor_run_once(function, *args):
    """``function(*args)`` on a one-thread executor of its own (blocking file reads)."""
    executor = Executor(1, name="cdi-generate")
    try:
        return await executor.run(function, *args)
    finally:
        executor.shutdown(wait=False)
