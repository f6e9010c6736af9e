"""MIG (multi-instance GPU) devices as allocation units (SPEC section 14).

``MigDevice`` is a MIG device's identity (parent ``Gpu``, GPU-instance id,
compute-instance id) and ``MigDeviceInfo`` what an inventory knows of it;
``_profile`` names MIG profiles (``1g.18gb``) and their ``mig-<profile>``
resources; ``MigCapabilities`` reads the capability nodes a holder needs
from ``<proc_dir>``. Rules of each piece are at the top of its module.
"""

from ._caps import (
    CAPS_DEV_SUBDIR,
    CAPS_DEVICE_NAME,
    MIG_MINORS_FILE,
    MigCapabilities,
    MigCapabilityError,
    read_mig_capabilities,
)
from ._device import MigDevice, MigDeviceInfo, Unit, as_unit, format_units, is_unit, unit_sort_key
from ._profile import (
    MIG_RESOURCE_PREFIX,
    MigProfile,
    gpu_instance_profile,
    parse_profile,
    profile_from_attributes,
    profile_memory_mib,
    profile_of_resource,
    resource_of_profile,
)

__all__ = [
    "CAPS_DEV_SUBDIR", "CAPS_DEVICE_NAME", "MIG_MINORS_FILE", "MigCapabilities", "MigCapabilityError",
    "read_mig_capabilities", "MigDevice", "MigDeviceInfo", "Unit", "as_unit", "format_units", "is_unit",
    "unit_sort_key", "MIG_RESOURCE_PREFIX", "MigProfile", "gpu_instance_profile", "parse_profile",
    "profile_from_attributes", "profile_memory_mib", "profile_of_resource", "resource_of_profile",
]
