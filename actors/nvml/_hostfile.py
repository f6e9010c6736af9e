"""Host files: a simulated node described in TOML or JSON.

Rules (SPEC section 4):
- A host file is either ``gpu_count = N`` (N plain GPUs, minors 0..N-1) or a
  list ``gpus`` of tables, each with ``minor`` (default: its position),
  ``uuid``, ``name``, ``pci_bus_id``, ``memory_total_mib``, ``numa_node``,
  ``pcie_switch``, ``nvlink`` (peer index -> link count) and ``mig``; plus
  ``driver_version`` and an optional ``control_devices`` table
  (``nvidiactl = "195:255"``, ``nvidia-uvm = "235:0"``,
  ``nvidia-uvm-tools = "235:1"``, ``nvidia-modeset = "195:254"`` are the
  defaults).
- Also accepted per GPU, all optional: ``host_bridge`` and ``board`` (more
  topology facts), ``memory_used_mib``, ``utilization_gpu``,
  ``utilization_memory`` (percent), ``power_mw`` and ``temperature_c``
  (usage readings the simulation reports), and ``supported_events`` (the
  health events the GPU can raise, what ``nvmlDeviceGetSupportedEventTypes``
  answers: a list of ``"xid"`` and ``"ecc"``; default both; ``[]`` for a
  GPU that reports none).
- MIG (R-MG-1): a GPU with ``mig = true`` may list ``mig_devices``, tables
  of ``gi`` and ``ci`` (GPU- and compute-instance ids), ``profile`` (e.g.
  ``"1g.18gb"``), and optional ``uuid`` (``MIG-…``; default derived from the
  GPU's UUID and the ids), ``memory_total_mib`` (default: the profile's GB
  figure x 960 MiB, a little under it as real MIG memory is) and
  ``memory_used_mib``. A MIG device's index on its GPU is its position in
  the list. Checked: ``mig_devices`` only with ``mig = true``; at most
  ``MAX_MIG_DEVICES`` a GPU; a profile of NVIDIA's form; no (gi, ci) twice;
  devices of one GPU instance agree on its profile; UUIDs start with
  ``MIG-`` and are unique among GPUs and MIG devices; the MIG devices'
  memory (one count per GPU instance) fits in the GPU's.
- Topology between two GPUs follows from those facts, closest first: same
  ``board`` → INTERNAL; same ``pcie_switch`` → SINGLE; same ``host_bridge``
  → HOSTBRIDGE; same ``numa_node`` → NODE; otherwise SYSTEM. A pair where
  neither GPU has any of those facts has no known topology (NVML's "not
  supported"). NVLink links are symmetric: giving one side is enough; both
  sides must agree.
- Loading validates everything and fails with ONE ``HostFileError`` naming
  the file and the field: unreadable file, bad TOML/JSON, wrong types,
  unknown keys (control devices too: only the four above), negative or
  duplicate minors, a minor that is a control device's, duplicate UUIDs or bus ids, malformed bus ids or device numbers,
  NVLink peers out of range or to itself, and absurd sizes (more than
  ``MAX_GPUS`` GPUs, more than ``NVLINK_MAX_LINKS`` links on one GPU).
- The result, ``HostSpec``, is fully resolved (every default filled in) and
  is what ``SimulatedNvml`` serves.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import uuid as uuid_module
from typing import Annotated, Any, Literal

import msgspec

from actors.mig import gpu_instance_profile, parse_profile, profile_memory_mib

from ._errors import HostFileError
from ._port import (
    DEFAULT_CONTROL_DEVICES,
    MAX_MIG_DEVICES,
    NVLINK_MAX_LINKS,
    TOPOLOGY_HOSTBRIDGE,
    TOPOLOGY_INTERNAL,
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    TOPOLOGY_SYSTEM,
)

__all__ = [
    "HostMigDevice",
    "SimMigDevice",
    "HostGpu",
    "HostFile",
    "HostSpec",
    "SimGpu",
    "MAX_GPUS",
    "DEFAULT_DRIVER_VERSION",
    "load_host_file",
    "parse_host_file",
    "host_spec_from_dict",
]

MAX_GPUS = 1024
"""More GPUs than this in one host file is a mistake, not a node."""

DEFAULT_DRIVER_VERSION = "550.54.15"
DEFAULT_GPU_NAME = "NVIDIA Simulated GPU"
DEFAULT_MEMORY_MIB = 16384
MAX_MINOR = (1 << 20) - 1  # Linux minor numbers are 20 bits

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Percent = Annotated[int, msgspec.Meta(ge=0, le=100)]
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=80)]
_Group = int | str

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")
_DEVICE_NUMBER = re.compile(r"^(\d+):(\d+)$")


_InstanceId = Annotated[int, msgspec.Meta(ge=0, le=255)]


class HostMigDevice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One MIG device as a host file writes it."""

    gi: _InstanceId
    ci: _InstanceId
    profile: Annotated[str, msgspec.Meta(min_length=1, max_length=40)]
    uuid: _Text | None = None
    memory_total_mib: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None
    memory_used_mib: _NonNegative = 0


class HostGpu(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One GPU as a host file writes it (everything optional)."""

    minor: Annotated[int, msgspec.Meta(ge=0, le=MAX_MINOR)] | None = None
    uuid: _Text | None = None
    name: _Text | None = None
    pci_bus_id: str | None = None
    memory_total_mib: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] = DEFAULT_MEMORY_MIB
    memory_used_mib: _NonNegative = 0
    numa_node: _NonNegative | None = None
    pcie_switch: _Group | None = None
    host_bridge: _Group | None = None
    board: _Group | None = None
    nvlink: dict[_NonNegative, Annotated[int, msgspec.Meta(ge=1, le=NVLINK_MAX_LINKS)]] = {}
    mig: bool = False
    mig_devices: Annotated[list[HostMigDevice], msgspec.Meta(max_length=64)] = []
    utilization_gpu: _Percent = 0
    utilization_memory: _Percent = 0
    power_mw: _NonNegative | None = None
    temperature_c: Annotated[int, msgspec.Meta(ge=0, le=200)] | None = None
    supported_events: tuple[Literal["xid", "ecc"], ...] = ("xid", "ecc")


class HostFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A host file as written: ``gpu_count`` or ``gpus``, plus node facts."""

    gpu_count: Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS)] | None = None
    gpus: Annotated[list[HostGpu], msgspec.Meta(max_length=MAX_GPUS)] | None = None
    driver_version: _Text = DEFAULT_DRIVER_VERSION
    control_devices: dict[str, str] = {}


class SimMigDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One MIG device of a resolved simulated node."""

    index: int
    """Its position on its GPU (the MIG device index)."""
    gi: int
    ci: int
    profile: str
    uuid: str
    memory_total_mib: int
    memory_used_mib: int


class SimGpu(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU of a resolved simulated node (every default filled in)."""

    index: int
    minor: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_mib: int
    memory_used_mib: int
    numa_node: int | None
    pcie_switch: _Group | None
    host_bridge: _Group | None
    board: _Group | None
    nvlink: dict[int, int]
    mig: bool
    utilization_gpu: int
    utilization_memory: int
    power_mw: int | None
    temperature_c: int | None
    mig_devices: list[SimMigDevice] = []
    supported_events: tuple[str, ...] = ("xid", "ecc")
    """Health events this GPU can raise (``"xid"``, ``"ecc"``)."""

    def has_topology(self) -> bool:
        return any(
            fact is not None for fact in (self.board, self.pcie_switch, self.host_bridge, self.numa_node)
        )


class HostSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A resolved simulated node: what ``SimulatedNvml`` serves."""

    source: str
    driver_version: str
    gpus: list[SimGpu]
    control_devices: dict[str, str]

    def topology_level(self, first: int, second: int) -> int | None:
        """The NVML topology level between two GPU indices (None: unknown)."""
        a, b = self.gpus[first], self.gpus[second]
        if first == second:
            return TOPOLOGY_INTERNAL
        if not a.has_topology() and not b.has_topology():
            return None
        if a.board is not None and a.board == b.board:
            return TOPOLOGY_INTERNAL
        if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
            return TOPOLOGY_SINGLE
        if a.host_bridge is not None and a.host_bridge == b.host_bridge:
            return TOPOLOGY_HOSTBRIDGE
        if a.numa_node is not None and a.numa_node == b.numa_node:
            return TOPOLOGY_NODE
        return TOPOLOGY_SYSTEM


# ----------------------------------------------------------------- loading


def load_host_file(path: str | os.PathLike[str]) -> HostSpec:
    """Read and validate a host file (TOML or JSON); one HostFileError if bad."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise HostFileError(f"Cannot read host file {path!r}: {exc.strerror or exc}") from None
    return parse_host_file(data, path)


def parse_host_file(data: bytes | str, path: str = "<host file>") -> HostSpec:
    """Validate host-file text; the format is JSON for ``*.json`` or text
    starting with ``{``, TOML otherwise."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HostFileError(f"Invalid host file {path!r}: not UTF-8 text ({exc})") from None
    else:
        text = data
    lowered = path.lower()
    is_json = lowered.endswith(".json") or (not lowered.endswith(".toml") and text.lstrip().startswith("{"))
    try:
        document = json.loads(text) if is_json else tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        kind = "JSON" if is_json else "TOML"
        raise HostFileError(f"Invalid host file {path!r}: not valid {kind}: {exc}") from None
    return host_spec_from_dict(document, path)


def host_spec_from_dict(document: Any, path: str = "<host file>") -> HostSpec:
    """Validate an already-decoded host file (a dict)."""

    def fail(field: str, problem: str) -> HostFileError:
        where = f" {field}:" if field else ""
        return HostFileError(f"Invalid host file {path!r}:{where} {problem}")

    if not isinstance(document, dict):
        raise fail("", f"expected a table at the top level, got {type(document).__name__}")
    document = _normalise_nvlink_keys(document)
    try:
        raw = msgspec.convert(document, HostFile)
    except msgspec.ValidationError as exc:
        field, problem = _explain(exc, document)
        raise fail(field, problem) from None

    if raw.gpu_count is not None and raw.gpus is not None:
        raise fail("gpu_count", "give either 'gpu_count' or a 'gpus' list, not both")
    if raw.gpu_count is None and raw.gpus is None:
        raise fail("gpus", "missing: give 'gpu_count = N' or a list of '[[gpus]]' tables")
    entries = raw.gpus if raw.gpus is not None else [HostGpu() for _ in range(raw.gpu_count or 0)]
    count = len(entries)

    control: dict[str, str] = dict(DEFAULT_CONTROL_DEVICES)
    for name, number in raw.control_devices.items():
        if name not in DEFAULT_CONTROL_DEVICES:
            raise fail(
                f"control_devices.{name[:40]}",
                f"unknown control device {name[:40]!r} (known: {', '.join(DEFAULT_CONTROL_DEVICES)})",
            )
        match = _DEVICE_NUMBER.match(number)
        if match is None or int(match.group(2)) > MAX_MINOR:
            raise fail(f"control_devices.{name}", f"expected 'major:minor' like '195:255', got {_short(number)}")
        control[name] = f"{int(match.group(1))}:{int(match.group(2))}"
    reserved = {}
    for name, number in control.items():
        major, minor = (int(part) for part in number.split(":"))
        if major == 195:
            reserved[minor] = name

    gpus: list[SimGpu] = []
    minors: dict[int, int] = {}
    uuids: dict[str, str] = {}  # UUID -> where it is used ("gpus[0]", "gpus[0].mig_devices[1]")
    bus_ids: dict[str, int] = {}
    links: dict[tuple[int, int], int] = {}
    for index, entry in enumerate(entries):
        at = f"gpus[{index}]"
        minor = index if entry.minor is None else entry.minor
        if minor in minors:
            raise fail(f"{at}.minor", f"minor {minor} is already used by gpus[{minors[minor]}]")
        if minor in reserved:
            raise fail(f"{at}.minor", f"minor {minor} is the control device {reserved[minor]!r} (195:{minor})")
        minors[minor] = index
        gpu_uuid = entry.uuid or _default_uuid(index)
        if gpu_uuid in uuids:
            raise fail(f"{at}.uuid", f"UUID {gpu_uuid!r} is already used by {uuids[gpu_uuid]}")
        uuids[gpu_uuid] = at
        if entry.pci_bus_id is None:
            bus_id = _default_bus_id(index)
        else:
            bus_id = _normalise_bus_id(entry.pci_bus_id)
            if bus_id is None:
                raise fail(
                    f"{at}.pci_bus_id",
                    f"expected a PCI bus id like '00000000:3B:00.0', got {_short(entry.pci_bus_id)}",
                )
        if bus_id in bus_ids:
            raise fail(f"{at}.pci_bus_id", f"bus id {bus_id!r} is already used by gpus[{bus_ids[bus_id]}]")
        bus_ids[bus_id] = index
        if entry.memory_used_mib > entry.memory_total_mib:
            raise fail(
                f"{at}.memory_used_mib",
                f"{entry.memory_used_mib} MiB used is more than memory_total_mib {entry.memory_total_mib}",
            )
        for peer, count_links in entry.nvlink.items():
            if peer >= count:
                raise fail(f"{at}.nvlink", f"peer {peer} is not a GPU index (the node has {count} GPUs)")
            if peer == index:
                raise fail(f"{at}.nvlink", f"a GPU cannot have NVLink links to itself (peer {peer})")
            pair = (min(index, peer), max(index, peer))
            if pair in links and links[pair] != count_links:
                raise fail(
                    f"{at}.nvlink",
                    f"{count_links} links to gpus[{peer}], but gpus[{peer}].nvlink says {links[pair]}",
                )
            links[pair] = count_links
        mig_devices = _mig_devices(entry, at, gpu_uuid, uuids, fail)
        gpus.append(
            SimGpu(
                index=index,
                minor=minor,
                uuid=gpu_uuid,
                name=entry.name or DEFAULT_GPU_NAME,
                pci_bus_id=bus_id,
                memory_total_mib=entry.memory_total_mib,
                memory_used_mib=entry.memory_used_mib,
                numa_node=entry.numa_node,
                pcie_switch=entry.pcie_switch,
                host_bridge=entry.host_bridge,
                board=entry.board,
                nvlink={},
                mig=entry.mig,
                utilization_gpu=entry.utilization_gpu,
                utilization_memory=entry.utilization_memory,
                power_mw=entry.power_mw,
                temperature_c=entry.temperature_c,
                mig_devices=mig_devices,
                supported_events=tuple(sorted(set(entry.supported_events), key=("xid", "ecc").index)),
            )
        )

    # Mirror NVLink links so both sides know them; cap links per GPU.
    per_gpu: list[dict[int, int]] = [{} for _ in gpus]
    for (a, b), count_links in sorted(links.items()):
        per_gpu[a][b] = count_links
        per_gpu[b][a] = count_links
    for index, peers in enumerate(per_gpu):
        total = sum(peers.values())
        if total > NVLINK_MAX_LINKS:
            raise fail(
                f"gpus[{index}].nvlink",
                f"{total} NVLink links in all, more than a GPU has ({NVLINK_MAX_LINKS})",
            )
    gpus = [msgspec.structs.replace(gpu, nvlink=dict(sorted(per_gpu[gpu.index].items()))) for gpu in gpus]
    return HostSpec(source=path, driver_version=raw.driver_version, gpus=gpus, control_devices=control)


# ----------------------------------------------------------------- helpers


def _mig_devices(entry: HostGpu, at: str, gpu_uuid: str, uuids: dict[str, Any], fail) -> list[SimMigDevice]:
    """Validate and resolve one GPU's ``mig_devices`` (see module rules)."""
    if not entry.mig_devices:
        return []
    if not entry.mig:
        raise fail(f"{at}.mig_devices", "MIG devices are listed but 'mig' is not true (MIG mode is off)")
    if len(entry.mig_devices) > MAX_MIG_DEVICES:
        raise fail(
            f"{at}.mig_devices",
            f"{len(entry.mig_devices)} MIG devices, more than a GPU has ({MAX_MIG_DEVICES})",
        )
    devices: list[SimMigDevice] = []
    places: dict[tuple[int, int], int] = {}
    instances: dict[int, tuple[str, int, int]] = {}  # gi -> (GI profile, memory, first position)
    for position, mig in enumerate(entry.mig_devices):
        where = f"{at}.mig_devices[{position}]"
        try:
            parse_profile(mig.profile)
        except ValueError as exc:
            raise fail(f"{where}.profile", str(exc)[0].lower() + str(exc)[1:]) from None
        place = (mig.gi, mig.ci)
        if place in places:
            raise fail(
                f"{where}", f"gi {mig.gi} ci {mig.ci} is already {at}.mig_devices[{places[place]}]"
            )
        places[place] = position
        memory = mig.memory_total_mib if mig.memory_total_mib is not None else profile_memory_mib(mig.profile)
        gi_profile = gpu_instance_profile(mig.profile)
        if mig.gi in instances:
            known, known_memory, first = instances[mig.gi]
            if known != gi_profile:
                raise fail(
                    f"{where}.profile",
                    f"{mig.profile!r} puts GPU instance {mig.gi} in profile {gi_profile!r}, but"
                    f" {at}.mig_devices[{first}] puts it in {known!r}",
                )
            if known_memory != memory:
                raise fail(
                    f"{where}.memory_total_mib",
                    f"{memory} MiB, but {at}.mig_devices[{first}] of the same GPU instance {mig.gi}"
                    f" says {known_memory} MiB (compute instances share their GPU instance's memory)",
                )
        else:
            instances[mig.gi] = (gi_profile, memory, position)
        if mig.memory_used_mib > memory:
            raise fail(
                f"{where}.memory_used_mib",
                f"{mig.memory_used_mib} MiB used is more than its memory_total_mib {memory}",
            )
        mig_uuid = mig.uuid or _default_mig_uuid(gpu_uuid, mig.gi, mig.ci)
        if not mig_uuid.startswith("MIG-"):
            raise fail(f"{where}.uuid", f"a MIG device UUID starts with 'MIG-', got {_short(mig_uuid)}")
        if mig_uuid in uuids:
            raise fail(f"{where}.uuid", f"UUID {mig_uuid!r} is already used by {uuids[mig_uuid]}")
        uuids[mig_uuid] = where
        devices.append(
            SimMigDevice(
                index=position,
                gi=mig.gi,
                ci=mig.ci,
                profile=mig.profile,
                uuid=mig_uuid,
                memory_total_mib=memory,
                memory_used_mib=mig.memory_used_mib,
            )
        )
    total = sum(memory for _profile, memory, _first in instances.values())
    if total > entry.memory_total_mib:
        raise fail(
            f"{at}.mig_devices",
            f"the GPU instances need {total} MiB in all, more than the GPU's memory_total_mib"
            f" {entry.memory_total_mib}",
        )
    return devices


def _default_mig_uuid(gpu_uuid: str, gi: int, ci: int) -> str:
    return "MIG-" + str(uuid_module.uuid5(uuid_module.NAMESPACE_URL, f"gpu-isolator/simulated/{gpu_uuid}/gi{gi}/ci{ci}"))


def _default_uuid(index: int) -> str:
    return "GPU-" + str(uuid_module.uuid5(uuid_module.NAMESPACE_URL, f"gpu-isolator/simulated/{index}"))


def _default_bus_id(index: int) -> str:
    domain, bus = divmod(index, 0xF0)
    return f"{domain:08X}:{bus + 0x10:02X}:00.0"


def _normalise_bus_id(text: str) -> str | None:
    """NVML's form ``DDDDDDDD:BB:DD.F`` (upper case), or None if malformed."""
    match = _BUS_ID.match(text.strip())
    if match is None:
        return None
    domain = int(match.group(1) or "0", 16)
    return f"{domain:08X}:{int(match.group(2), 16):02X}:{int(match.group(3), 16):02X}.{match.group(4)}"


def _normalise_nvlink_keys(document: dict) -> dict:
    """TOML and JSON keys are text; NVLink peers are indices ("1" -> 1)."""
    gpus = document.get("gpus")
    if not isinstance(gpus, list):
        return document
    fixed = []
    for entry in gpus:
        if isinstance(entry, dict) and isinstance(entry.get("nvlink"), dict):
            nvlink = {}
            for key, value in entry["nvlink"].items():
                if isinstance(key, str) and key.strip().isdigit():
                    key = int(key.strip())
                nvlink[key] = value
            entry = {**entry, "nvlink": nvlink}
        fixed.append(entry)
    return {**document, "gpus": fixed}


_AT = re.compile(r" - at `\$(.*)`$")
_AT_KEY = re.compile(r" - at `key` in `\$(.*)`$")


def _explain(exc: msgspec.ValidationError, document: Any) -> tuple[str, str]:
    """Turn msgspec's message into (field path, problem with the value found)."""
    message = str(exc)
    key = _AT_KEY.search(message)
    if key is not None:
        path = key.group(1).lstrip(".")
        problem = message[: key.start()]
        return path.replace("[...]", ""), f"keys must be peer GPU indices ({problem[0].lower() + problem[1:]})"
    match = _AT.search(message)
    path = ""
    if match is not None:
        message = message[: match.start()]
        path = match.group(1).lstrip(".")
    unknown = re.match(r"Object contains unknown field `(.*)`", message)
    if unknown is not None:
        key = unknown.group(1) if len(unknown.group(1)) <= 40 else unknown.group(1)[:40] + "..."
        field = f"{path}.{key}" if path else key
        return field, f"unknown key {key!r} (check the spelling; see the host-file schema)"
    message = message.replace(" | null", "")
    value = _lookup(document, path)
    if value is not _MISSING:
        message = message.split(", got `")[0] + f", got {_short(value)}"
    return path.replace("[...]", "") or "(top level)", message[0].lower() + message[1:]


_MISSING = object()


def _short(value: Any) -> str:
    """``repr(value)``, cut short: a hostile file must not make a huge message."""
    text = repr(value)
    if len(text) <= 80:
        return text
    size = f" ({type(value).__name__} of {len(value)} items)" if isinstance(value, (list, dict, str)) else ""
    return text[:60] + "..." + size


def _lookup(document: Any, path: str) -> Any:
    node = document
    for part in re.findall(r"[^.\[\]]+|\[\d+\]|\[\.\.\.\]", path):
        if part == "[...]":
            return _MISSING
        if part.startswith("["):
            index = int(part[1:-1])
            if not isinstance(node, list) or index >= len(node):
                return _MISSING
            node = node[index]
        else:
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
    return node
