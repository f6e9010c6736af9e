"""The NVML port: a node's GPUs as NVML (or a simulated node) reports them.

Two implementations of one port (``Nvml``): ``BindingsNvml`` over the
``pynvml`` module and ``SimulatedNvml`` from a host file; ``NvmlService``
runs either off the event loop; ``read_inventory`` turns answers into a
``NodeInventory``; ``register_health_events`` sets up an NVML event set.
Rules of each piece are at the top of its module.
"""

from ._bindings import BindingsNvml
from ._default_node import EMBEDDED_HOST_FILE, embedded_host_spec
from ._errors import HostFileError, NvmlError, NvmlNotSupported, NvmlUnavailable
from ._hostfile import MAX_GPUS, HostFile, HostGpu, HostMigDevice, HostSpec, SimGpu, SimMigDevice
from ._hostfile import host_spec_from_dict, load_host_file, parse_host_file
from ._health import HealthRegistration, register_health_events
from ._inventory import GpuUsage, MigDeviceUsage, NodeInventory, read_inventory, read_mig_devices
from ._inventory import read_mig_usage, read_usage
from ._open import embedded_simulated_node, nvml_available, open_nvml
from ._port import DEFAULT_CONTROL_DEVICES, MAX_MIG_DEVICES, EVENT_TYPE_DOUBLE_BIT_ECC, EVENT_TYPE_XID
from ._port import HEALTH_EVENT_TYPES, NVLINK_MAX_LINKS, TOPOLOGY_HOSTBRIDGE, TOPOLOGY_INTERNAL
from ._port import TOPOLOGY_MULTIPLE, TOPOLOGY_NAMES, TOPOLOGY_NODE, TOPOLOGY_SINGLE, TOPOLOGY_SYSTEM
from ._port import COMPUTE_MODE_DEFAULT, COMPUTE_MODE_EXCLUSIVE_PROCESS, COMPUTE_MODE_NAMES, COMPUTE_MODE_PROHIBITED
from ._port import EventSet, HealthEvent, MemoryInfo, Nvml, Utilization
from ._service import NvmlService
from ._simulated import SimulatedNvml

__all__ = [
    "BindingsNvml", "EMBEDDED_HOST_FILE", "embedded_host_spec", "HostFileError",
    "NvmlError", "NvmlNotSupported", "NvmlUnavailable", "MAX_GPUS", "HostFile",
    "HostGpu", "HostMigDevice", "HostSpec", "SimGpu", "SimMigDevice", "host_spec_from_dict", "load_host_file",
    "parse_host_file", "GpuUsage", "MigDeviceUsage", "NodeInventory", "read_inventory", "read_mig_devices", "read_mig_usage",
    "read_usage",
    "embedded_simulated_node", "nvml_available", "open_nvml",
    "DEFAULT_CONTROL_DEVICES", "MAX_MIG_DEVICES", "EVENT_TYPE_DOUBLE_BIT_ECC", "EVENT_TYPE_XID",
    "HEALTH_EVENT_TYPES", "EventSet", "HealthRegistration", "register_health_events", "NVLINK_MAX_LINKS",
    "TOPOLOGY_HOSTBRIDGE", "TOPOLOGY_INTERNAL", "TOPOLOGY_MULTIPLE", "TOPOLOGY_NAMES",
    "TOPOLOGY_NODE", "TOPOLOGY_SINGLE", "TOPOLOGY_SYSTEM", "HealthEvent", "MemoryInfo",
    "Nvml", "Utilization", "NvmlService", "SimulatedNvml",
    "COMPUTE_MODE_DEFAULT", "COMPUTE_MODE_EXCLUSIVE_PROCESS", "COMPUTE_MODE_NAMES", "COMPUTE_MODE_PROHIBITED",
]
