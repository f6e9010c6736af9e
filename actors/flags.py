"""Flags: the agent's configuration of the GPU isolator (Mesos slave flags).

Rules:
- ``Flags`` is a msgspec Struct; every field has a default, so ``Flags()`` is
  a real node with Mesos' default isolation. Build it directly
  (``Flags(host_file="node.toml")``), from command-line arguments
  (``Flags.from_args(["--nvidia_gpu_devices=0,1", "--resources=gpus:2"])``,
  dashes or underscores, ``--name=value`` or ``--name value``, ``--name`` /
  ``--no-name`` for booleans) or from a TOML/JSON file (``Flags.from_file``).
- An unknown flag is an error ("Failed to load unknown flag 'x'"); a value of
  the wrong type names the flag and the value.
- ``isolation`` is a comma list (Mesos' default
  ``"filesystem/linux,cgroups/devices,gpu/nvidia"``); ``isolators()`` splits it.
- ``nvidia_gpu_devices`` is a list of NVML indices (``"0,1"`` on the command
  line); duplicates are allowed here and rejected by
  ``NvidiaGpuAllocator.resources`` with Mesos' message.
- ``cgroups_root`` must be a non-empty relative path of plain components:
  no ``..`` or ``.``, not absolute, no empty component. Nothing is ever
  written outside ``<hierarchy>/<cgroups_root>``.
- ``device_backend`` is one of ``auto``, ``cgroups_v1``, ``cgroups_v2``,
  ``memory``; ``device_worker`` is ``process`` (default: the kernel work
  in a child process) or ``thread``; ``gpu_allocation`` is ``topology`` (R-AL-2) or ``lowest``
  (Mesos: lowest minors first).
- ``nvidia_mig_strategy`` (R-MG-3) is ``none`` (MIG-enabled GPUs are
  handed out whole), ``single`` (every MIG device is one unit of ``gpus``)
  or ``mixed`` (MIG devices are resources ``mig-<profile>`` beside
  ``gpus``); ``proc_dir`` (default ``/proc``) is where the node's kernel
  facts are read: the MIG capability facts (``driver/nvidia-caps/mig-minors``,
  ``devices``) and the major registered for ``nvidia-uvm`` (``devices``).
- ``cdi_spec_dir`` (None: no CDI specs) is an absolute path when set;
  so is ``cdi_hook`` (None: this installation's Python runs the hook).
- ``reconcile_interval`` is seconds (``None`` = off); on the command line
  it also takes Mesos durations (``30secs``, ``500ms``, ``2mins``) or
  ``off``.
- Health (R-HE-1..3): ``nvidia_health_checks`` (default true) watches NVML
  Xid and double-bit ECC events from the start; ``nvidia_ignored_xids``
  (default ``DEFAULT_IGNORED_XIDS``, the NVIDIA device plugin's list of Xids
  applications cause; ``"13,31"`` on the command line, ``""`` for none)
  are logged and change nothing; ``nvidia_health_wait`` is how long one
  ``nvmlEventSetWait_v2`` waits (at most 60 seconds; a duration on the
  command line): how soon NVML is shut down after the components close;
  ``nvidia_health_backoff`` (default 1 second, at most 30; a duration on the
  command line) is the first wait after a failed ``nvmlEventSetWait_v2``,
  doubled for each failure in a row up to 30 seconds.
- ``nvidia_usage_max_age`` (seconds, a duration on the command line; default
  1, NVML's own longest sample period for utilisation; 0: never) is how
  old the NVML readings a ``usage`` answers with may be: readings taken
  that recently are answered at once, with no NVML call (R-IS-5).
- ``node_ledger`` (SPEC R-NL-1) is the node ledger's directory, absolute;
  ``""`` (``--node_ledger=``) turns it off; unset (None) is the default
  ``actors.ledger.node_ledger_dir`` resolves (the environment's
  ``GPU_ISOLATOR_NODE_LEDGER`` or ``/run/gpu-isolator/ledger`` on the real
  NVML, none on a simulated node).
- Validation runs on every construction (``__post_init__``), so a Flags
  value that exists is a valid one.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

__all__ = ["Flags", "FlagsError", "DEFAULT_ISOLATION", "DEFAULT_IGNORED_XIDS", "parse_duration", "DEVICE_BACKENDS",
           "NODE_BACKENDS", "KERNEL_BACKENDS", "GPU_ALLOCATIONS", "DEVICE_WORKERS", "MIG_STRATEGIES"]

DEFAULT_ISOLATION = "filesystem/linux,cgroups/devices,gpu/nvidia"

DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)
"""Xids caused by applications, not the GPU (the NVIDIA device plugin's list):
13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
processing, 45 preemptive cleanup, 68 video processor exception, 109 context
switch timeout."""

# The choices of the flags, each spelled once here; device control, the
# allocator, the simulated node, scripts, the CLI and the benchmarks use these.
KERNEL_BACKENDS = ("cgroups_v1", "cgroups_v2")
"""The device backends that write the kernel's cgroups (they need root)."""
NODE_BACKENDS = ("memory", *KERNEL_BACKENDS)
"""The device backends a node runs on: in memory (no root, nothing isolated) or the kernel's."""
DEVICE_BACKENDS = ("auto", *sorted(NODE_BACKENDS))
"""Every value of ``--device_backend``: ``auto`` picks one of the others for this machine."""
GPU_ALLOCATIONS = ("topology", "lowest")
"""Every value of ``--gpu_allocation``."""
DEVICE_WORKERS = ("process", "thread")
"""Every value of ``--device_worker``."""
MIG_STRATEGIES = ("none", "single", "mixed")
"""Every value of ``--nvidia_mig_strategy``."""

DeviceBackend = Literal[DEVICE_BACKENDS]  # type: ignore[valid-type]
GpuAllocation = Literal[GPU_ALLOCATIONS]  # type: ignore[valid-type]
DeviceWorker = Literal[DEVICE_WORKERS]  # type: ignore[valid-type]
MigStrategy = Literal[MIG_STRATEGIES]  # type: ignore[valid-type]


class FlagsError(ValueError):
    """A flag is unknown, malformed or invalid; the message names it."""


_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "ms": 1e-3,
    "secs": 1.0,
    "sec": 1.0,
    "s": 1.0,
    "mins": 60.0,
    "min": 60.0,
    "hrs": 3600.0,
    "hr": 3600.0,
    "days": 86400.0,
    "weeks": 604800.0,
}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_duration(text: str) -> float:
    """Parse ``"30secs"``, ``"500ms"``, ``"2mins"`` or a bare number of seconds."""
    match = _DURATION.match(text)
    if match is None or match.group(2) not in ("", *_DURATION_UNITS):
        raise ValueError(
            f"Invalid duration {text!r}: expected seconds or a number with a unit"
            f" ({', '.join(sorted(set(_DURATION_UNITS)))})"
        )
    return float(match.group(1)) * _DURATION_UNITS.get(match.group(2), 1.0)


def validate_cgroups_root(root: str) -> str:
    """Return ``root`` if it is a non-empty relative path of plain components."""
    if not isinstance(root, str) or not root.strip():
        raise FlagsError("Invalid '--cgroups_root': it must not be empty")
    if root.startswith("/"):
        raise FlagsError(f"Invalid '--cgroups_root' {root!r}: it must be a relative path")
    if "\x00" in root or any(ord(c) < 32 for c in root):
        raise FlagsError(f"Invalid '--cgroups_root' {root!r}: control characters are not allowed")
    for component in root.split("/"):
        if component in ("", ".", ".."):
            raise FlagsError(
                f"Invalid '--cgroups_root' {root!r}: every component must be a plain name"
                " (no '..', '.' or empty component)"
            )
    return root


class Flags(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The isolator's flags (SPEC section 4); every field has a default."""

    isolation: str = DEFAULT_ISOLATION
    """Comma list of isolators, as Mesos' ``--isolation``."""
    resources: str | None = None
    """The agent's resources in text form (``"cpus:8;gpus:4"``) or None."""
    nvidia_gpu_devices: list[int] | None = None
    """NVML indices of the GPUs to manage, or None (all of them)."""
    cgroups_hierarchy: str | None = None
    """The devices hierarchy (v1) or the cgroup2 mount (v2); None = detect."""
    cgroups_root: str = "gpu-isolator"
    """Containers' cgroups live at ``<hierarchy>/<cgroups_root>/<container id>``."""
    runtime_dir: str = "/var/run/gpu-isolator"
    """Per-container runtime files (the devices directory)."""
    work_dir: str = "/var/lib/gpu-isolator"
    """Checkpoints live under it."""
    host_file: str | None = None
    """A simulated node (TOML/JSON); None = the real NVML."""
    dev_dir: str = "/dev"
    """Where ``nvidiactl``, ``nvidia-uvm`` and ``nvidiaN`` are found."""
    device_backend: DeviceBackend = "auto"
    """``auto`` | ``cgroups_v1`` | ``cgroups_v2`` | ``memory``."""
    volume_dir: str = "/var/run/gpu-isolator/volume"
    """Prefix of the host NVIDIA volume (``<volume_dir>/nvidia_<driver>``)."""
    ld_cache: str = "/etc/ld.so.cache"
    """The dynamic loader cache the volume reads the driver libraries from."""
    reconcile_interval: float | None = None
    """Seconds between device-rule reconciliations; None = off."""
    gpu_allocation: GpuAllocation = "topology"
    """``topology``: best-connected set (R-AL-2); ``lowest``: Mesos' lowest minors first."""
    nvidia_health_checks: bool = True
    """Watch NVML Xid and double-bit ECC events from the start (R-HE-1); a GPU
    raising a critical one is withheld until ``mark_healthy`` (R-AL-3)."""
    nvidia_ignored_xids: list[int] = msgspec.field(default_factory=lambda: list(DEFAULT_IGNORED_XIDS))
    """Xids that are the application's fault: logged, the GPU is kept (R-HE-3)."""
    nvidia_health_wait: float = 5.0
    """Seconds one ``nvmlEventSetWait_v2`` waits for health events."""
    nvidia_health_backoff: float = 1.0
    """Seconds before the first retry of a failed ``nvmlEventSetWait_v2``,
    doubled for each failure in a row up to 30 (R-HE-3)."""
    nvidia_usage_max_age: float = 1.0
    """Seconds old the NVML readings a ``usage`` answers with may be (0: read
    NVML for every usage)."""
    device_worker: DeviceWorker = "process"
    """Where the kernel device work runs: ``process`` (a device worker process
    of its own, overlapping the event loop) or ``thread`` (a thread here)."""
    cdi_spec_dir: str | None = None
    """Where each container's transient CDI spec is written (the usual value
    is ``/var/run/cdi``, which container engines read); None = write none."""
    cdi_hook: str | None = None
    """The program container engines run on the host for the CDI specs'
    loader-cache hook (``<program> update-ldcache --folder ...``, R-DR-2): a
    path on the host, e.g. ``gpu-isolator-cdi-hook``; None = this
    installation's Python running the hook file (right wherever this
    process runs on the host itself)."""

    nvidia_mig_strategy: MigStrategy = "none"
    """``none`` (MIG GPUs handed out whole) | ``single`` (each MIG device is one
    unit of ``gpus``) | ``mixed`` (MIG devices as ``mig-<profile>`` resources)."""
    proc_dir: str = "/proc"
    """Where the node's kernel facts are read: the MIG capability facts
    (``driver/nvidia-caps/mig-minors``, ``devices``) and the ``nvidia-uvm``
    major (``devices``); tests point it at files of their own."""
    node_ledger: str | None = None
    """The node ledger every front door of the node shares (SPEC R-NL-1): a
    directory (absolute), ``""`` for none, None for the default
    (``actors.ledger.node_ledger_dir``: ``$GPU_ISOLATOR_NODE_LEDGER`` or
    ``/run/gpu-isolator/ledger`` on the real NVML, none on a simulated node)."""

    def __post_init__(self) -> None:
        _check_choice("nvidia_mig_strategy", self.nvidia_mig_strategy)
        _check_choice("device_backend", self.device_backend)
        _check_choice("gpu_allocation", self.gpu_allocation)
        _check_choice("device_worker", self.device_worker)
        validate_cgroups_root(self.cgroups_root)
        if self.nvidia_gpu_devices is not None:
            for index in self.nvidia_gpu_devices:
                if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                    raise FlagsError(
                        f"Invalid '--nvidia_gpu_devices' {self.nvidia_gpu_devices!r}:"
                        f" {index!r} is not a non-negative integer"
                    )
        for xid in self.nvidia_ignored_xids:
            if isinstance(xid, bool) or not isinstance(xid, int) or xid < 0:
                raise FlagsError(
                    f"Invalid '--nvidia_ignored_xids' {self.nvidia_ignored_xids!r}:"
                    f" {xid!r} is not a non-negative integer"
                )
        wait = self.nvidia_health_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait <= 60:
            raise FlagsError(
                f"Invalid '--nvidia_health_wait' {wait!r}: expected seconds, more than 0 and at most 60"
            )
        backoff = self.nvidia_health_backoff
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 < backoff <= 30:
            raise FlagsError(
                f"Invalid '--nvidia_health_backoff' {backoff!r}: expected seconds, more than 0 and at most 30"
            )
        age = self.nvidia_usage_max_age
        if isinstance(age, bool) or not isinstance(age, (int, float)) or not 0 <= age <= 3600:
            raise FlagsError(
                f"Invalid '--nvidia_usage_max_age' {age!r}: expected seconds, from 0 (read NVML for every"
                " usage) to 3600"
            )
        for name in _INTERVALS:
            interval = getattr(self, name)
            if interval is None:
                continue
            if (
                isinstance(interval, bool)
                or not isinstance(interval, (int, float))
                or not 0 < interval < float("inf")
            ):
                raise FlagsError(
                    f"Invalid '--{name}' {interval!r}: expected a positive number of"
                    " seconds (or leave it unset to turn it off)"
                )
        if not self.dev_dir:
            raise FlagsError("Invalid '--dev_dir': it must not be empty")
        if not self.proc_dir:
            raise FlagsError("Invalid '--proc_dir': it must not be empty")
        _check_absolute("node_ledger", None if self.node_ledger == "" else self.node_ledger,
                        "an absolute directory (the default is /run/gpu-isolator/ledger on a node with NVIDIA's"
                        " driver), or an empty value to turn it off")
        _check_absolute("cdi_spec_dir", self.cdi_spec_dir,
                        "an absolute path (container engines read /etc/cdi and /var/run/cdi), or leave it unset to"
                        " write no CDI specs")
        _check_absolute("cdi_hook", self.cdi_hook,
                        "the absolute path of a program on the host (e.g. /usr/local/bin/gpu-isolator-cdi-hook),"
                        " or leave it unset for this installation's own")

    # ------------------------------------------------------------- queries

    def isolators(self) -> list[str]:
        """The ``isolation`` list, split and trimmed, empties dropped."""
        return [token.strip() for token in self.isolation.split(",") if token.strip()]

    def replace(self, **changes: Any) -> "Flags":
        """A copy with some fields changed (validated again)."""
        return msgspec.structs.replace(self, **changes)

    # ------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Flags":
        """Build from a mapping of flag names (dashes or underscores) to values."""
        normalised: dict[str, Any] = {}
        for key, value in values.items():
            name = _flag_name(str(key))
            normalised[name] = _coerce(name, value)
        try:
            return msgspec.convert(normalised, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise FlagsError(_describe(exc, normalised)) from None

    @classmethod
    def from_args(cls, args: Iterable[str]) -> "Flags":
        """Build from ``--name=value`` arguments (see module rules)."""
        values: dict[str, Any] = {}
        items = list(args)
        i = 0
        while i < len(items):
            arg = items[i]
            i += 1
            if not arg.startswith("--") or arg == "--":
                raise FlagsError(f"Failed to load flag from {arg!r}: expected '--name=value'")
            body = arg[2:]
            if "=" in body:
                name, value = body.split("=", 1)
                name = _flag_name(name)
            else:
                name = _flag_name(body)
                if name not in _FIELDS and name.startswith("no_") and _flag_name(name[3:]) in _BOOL_FIELDS:
                    values[_flag_name(name[3:])] = False
                    continue
                if name in _BOOL_FIELDS:
                    values[name] = True
                    continue
                if name in _FIELDS and i < len(items) and not items[i].startswith("--"):
                    value = items[i]
                    i += 1
                else:
                    raise FlagsError(f"Failed to load flag '{name}': missing value ('--{name}=VALUE')")
            values[name] = value
        return cls.from_dict(values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Flags":
        """Build from a TOML or JSON file of flag names to values."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise FlagsError(f"Failed to read flags file {path!r}: {exc.strerror or exc}") from None
        values = _decode_document(path, data)
        if not isinstance(values, dict):
            raise FlagsError(f"Flags file {path!r} must hold a table of flag names to values")
        return cls.from_dict(values)


_FIELDS = set(Flags.__struct_fields__)
_INTERVALS = ("reconcile_interval",)
_LIST_EXAMPLES = {"nvidia_gpu_devices": "0,1", "nvidia_ignored_xids": "13,31"}
_INDEX_LISTS = tuple(_LIST_EXAMPLES)
_CHOICES = {
    "device_backend": DEVICE_BACKENDS,
    "gpu_allocation": GPU_ALLOCATIONS,
    "device_worker": DEVICE_WORKERS,
    "nvidia_mig_strategy": MIG_STRATEGIES,
}


def _check_absolute(name: str, value: Any, expected: str) -> None:
    """``--name``, when set, must be an absolute path (no NUL); else one error saying what is ``expected``."""
    if value is not None and (not isinstance(value, str) or not value.startswith("/") or "\x00" in value):
        raise FlagsError(f"Invalid '--{name}' {value!r}: expected {expected}")


def _check_choice(name: str, value: Any) -> None:
    if value not in _CHOICES[name]:
        raise FlagsError(
            f"Invalid '--{name}' {value!r}: expected one of {', '.join(_CHOICES[name])}"
        )

_BOOL_FIELDS = {name for name, hint in typing.get_type_hints(Flags).items() if hint is bool}
_OPTIONAL_TEXT_NONE = {"", "none", "null"}


def _flag_name(name: str) -> str:
    name = name.strip().replace("-", "_")
    if name not in _FIELDS and not (name.startswith("no_") and name[3:] in _BOOL_FIELDS):
        raise FlagsError(f"Failed to load unknown flag '{name}'")
    return name


def _coerce(name: str, value: Any) -> Any:
    """Turn command-line text into the field's type; other values pass through."""
    if name == "isolation" and isinstance(value, list):
        return ",".join(str(item) for item in value)
    if name in _CHOICES:
        _check_choice(name, value)
    if not isinstance(value, str):
        return value
    text = value.strip()
    if name in _INDEX_LISTS:
        body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        indices = []
        for token in body.split(","):
            token = token.strip()
            if not token:
                continue
            if not re.fullmatch(r"\d+", token):
                raise FlagsError(
                    f"Failed to load flag '{name}': {token!r} in {value!r} is not a"
                    f" non-negative integer (expected e.g. {_LIST_EXAMPLES[name]!r})"
                )
            indices.append(int(token))
        return indices
    if name in ("nvidia_health_wait", "nvidia_health_backoff", "nvidia_usage_max_age"):
        try:
            return parse_duration(text)
        except ValueError as exc:
            raise FlagsError(f"Failed to load flag '{name}': {exc}") from None
    if name in _INTERVALS:
        if text.lower() in _OPTIONAL_TEXT_NONE | {"off"}:
            return None
        try:
            return parse_duration(text)
        except ValueError as exc:
            raise FlagsError(f"Failed to load flag '{name}': {exc}") from None
    if name in _BOOL_FIELDS:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise FlagsError(f"Failed to load flag '{name}': {value!r} is not a boolean")
    if name in ("resources", "host_file", "cgroups_hierarchy", "cdi_spec_dir", "cdi_hook") and text.lower() in _OPTIONAL_TEXT_NONE:
        return None
    return value


def _describe(exc: msgspec.ValidationError, values: Mapping[str, Any]) -> str:
    message = str(exc)
    match = re.search(r" - at `\$\.(\w+)(.*)`$", message)
    if match is None:
        # A check of __post_init__: its message already names the flag.
        return message
    name = match.group(1)
    detail = message[: match.start()]
    return f"Failed to load flag '{name}' with value {values.get(name)!r}: {detail}"


def _decode_document(path: str, data: bytes) -> Any:
    lowered = path.lower()
    is_json = lowered.endswith(".json") or (
        not lowered.endswith(".toml") and data.lstrip()[:1] in (b"{", b"[")
    )
    try:
        if is_json:
            return json.loads(data)
        return tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "JSON" if is_json else "TOML"
        raise FlagsError(f"Flags file {path!r} is not valid {kind}: {exc}") from None
