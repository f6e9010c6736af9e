"""The Mesos data types the isolator speaks, as msgspec Structs.

Rules:
- Field names are snake_case; every type decodes from JSON/YAML/TOML data
  with ``msgspec.convert`` (``Resources`` fields also take the text form
  ``"cpus:1;gpus:2"`` through ``decode_hook``).
- ``ContainerID`` is an identity (frozen, hashable). It validates on
  construction and on decode (R-TY-1): non-empty, at most 242 characters, not
  ``.``/``..``, no ``/``, ``\\``, ``.``, space or control character; a parent
  obeys the same. Since an id becomes a directory name, it must also be
  valid Unicode of at most 255 bytes in UTF-8. ``str(id)`` joins the chain with ``.`` (parent first), which
  cannot collide because ``.`` is refused inside a value.
- ``parent`` must be a ``ContainerID`` (or None): a bare string is refused,
  it would escape the validation above.
- ``ContainerID.path()`` is the relative path used for cgroups and runtime
  directories (``parent/child`` for nested ids); it validates the whole chain
  again first (``check_container_id``), so an id changed after construction
  (``msgspec.structs.force_setattr``) never becomes a path. The isolator calls
  ``check_container_id`` at every entry point.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import msgspec

from actors.manifest import ImageManifest
from actors.resources import Resources

from ._errors import InvalidContainerID

MAX_CONTAINER_ID_LENGTH = 242
MAX_NAME_BYTES = 255
_FORBIDDEN = re.compile(r"[/\\. \x00-\x1f\x7f]")
"""Characters never allowed in a container id value."""

# mount(2) flags used in launch infos.
MS_RDONLY = 1
MS_BIND = 4096
MS_REC = 16384


def validate_container_id_value(value: Any) -> str:
    """Return ``value`` if it is a valid container id, else raise InvalidContainerID."""
    if type(value) is str and _PLAIN_ID.fullmatch(value):  # the common case, in one match
        return value
    problem = _id_problem(value)
    if problem is not None:
        shown, why = problem
        raise InvalidContainerID(f"Invalid container id {shown}: {why}")
    return value


def _id_problem(value: Any) -> tuple[str, str] | None:
    """What is wrong with ``value`` as a container id: how it is shown and why
    (None when nothing is)."""
    if not isinstance(value, str):
        return repr(value), "expected a string"
    if not value:
        return "''", "it must not be empty"
    if len(value) > MAX_CONTAINER_ID_LENGTH:
        return (f"{value[:32]!r}...", f"it is {len(value)} characters long, the limit is {MAX_CONTAINER_ID_LENGTH}")
    if value in (".", ".."):
        return repr(value), "'.' and '..' are not allowed"
    bad = _FORBIDDEN.search(value)
    if bad is not None:
        return (repr(value), f"it contains {bad.group()!r}; '/', '\\\\', '.', spaces and control characters are"
                " not allowed")
    if not value.isascii():  # it becomes a directory name: at most 255 bytes of UTF-8
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            return repr(value), "it is not valid Unicode text"
        if size > MAX_NAME_BYTES:
            return (f"{value[:32]!r}...", f"it is {size} bytes long in UTF-8, a directory name holds at most"
                    f" {MAX_NAME_BYTES}")
    return None


_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]{1,%d}" % MAX_CONTAINER_ID_LENGTH)
"""Values every check of ``validate_container_id_value`` accepts: the common
case, recognised in one match (every isolator entry point checks its id)."""


def check_container_id(container_id: Any) -> "ContainerID":
    """Return ``container_id`` if it and every parent are valid ids, else raise
    InvalidContainerID (re-checks ids that may have been changed after
    construction; run it before building any path from an id)."""
    if (type(container_id) is ContainerID and container_id.parent is None
            and type(container_id.value) is str and _PLAIN_ID.fullmatch(container_id.value)):
        return container_id
    cid = container_id
    if not isinstance(cid, ContainerID):
        raise InvalidContainerID(f"Invalid container id {cid!r}: expected a ContainerID")
    while cid is not None:
        if not isinstance(cid, ContainerID):
            raise InvalidContainerID(f"Invalid container id {cid!r}: expected a ContainerID")
        validate_container_id_value(cid.value)
        cid = cid.parent
    return container_id


class ContainerID(msgspec.Struct, frozen=True, order=True):
    """A container's id; nested containers name their ``parent``."""

    value: str
    parent: "ContainerID | None" = None

    def __post_init__(self) -> None:
        validate_container_id_value(self.value)
        if self.parent is not None and not isinstance(self.parent, ContainerID):
            raise InvalidContainerID(
                f"Invalid parent {self.parent!r} of container id {self.value!r}: expected a ContainerID"
            )

    def has_parent(self) -> bool:
        return self.parent is not None

    def root(self) -> "ContainerID":
        """The top-level ancestor (self when not nested)."""
        cid = self
        while cid.parent is not None:
            cid = cid.parent
        return cid

    def path(self, separator: str = "/") -> str:
        """Relative path of this id (``parent/child`` when nested), validated;
        ``separator`` goes between the ids (``/containers/`` in Mesos' runtime layout)."""
        check_container_id(self)
        if self.parent is None:
            return self.value
        parts = []
        cid: ContainerID | None = self
        while cid is not None:
            parts.append(cid.value)
            cid = cid.parent
        return separator.join(reversed(parts))

    def __str__(self) -> str:
        if self.parent is None:
            return self.value
        return f"{self.parent}.{self.value}"

    @classmethod
    def parse(cls, text: str) -> "ContainerID":
        """Parse ``parent.child`` (the ``str`` form) back into an id; an error
        names the text as given (``'../x'``), and the part that is wrong."""
        if not isinstance(text, str) or not text:
            raise InvalidContainerID(f"Invalid container id {text!r}: it must not be empty")
        parts = text.split(".")
        for index, part in enumerate(parts, 1):
            problem = _id_problem(part)
            if problem is None:
                continue
            shown, why = problem
            if len(parts) == 1:
                raise InvalidContainerID(f"Invalid container id {shown}: {why}")
            raise InvalidContainerID(
                f"Invalid container id {text!r}: '.' separates the ids of a nested container (parent.child),"
                f" and part {index} of {len(parts)} ({shown}) is not an id: {why}"
            )
        cid: ContainerID | None = None
        for part in parts:
            cid = cls(part, cid)
        return cid  # type: ignore[return-value]


class ContainerClass(str, enum.Enum):
    DEFAULT = "DEFAULT"
    DEBUG = "DEBUG"


class ContainerConfig(msgspec.Struct, kw_only=True):
    """What the containerizer tells an isolator about a container to prepare."""

    resources: Resources = Resources()
    rootfs: str | None = None
    docker_manifest: ImageManifest | None = None
    container_class: ContainerClass = ContainerClass.DEFAULT
    has_task_info: bool = False
    user: str | None = None


class ContainerMountInfo(msgspec.Struct, frozen=True):
    """A mount the launcher performs: ``source`` onto ``target`` with mount(2) ``flags``."""

    source: str
    target: str
    flags: int = 0

    def flag_names(self) -> list[str]:
        names = []
        for bit, name in ((MS_RDONLY, "MS_RDONLY"), (MS_BIND, "MS_BIND"), (MS_REC, "MS_REC")):
            if self.flags & bit:
                names.append(name)
        return names


class ContainerDevice(msgspec.Struct, frozen=True, kw_only=True):
    """A device node a container is granted: ``path`` in the container,
    ``host_path`` the node on the host (under ``Flags.dev_dir``)."""

    path: str
    host_path: str
    major: int
    minor: int
    type: str = "c"
    permissions: str = "rwm"
    """The cgroup access granted (Mesos grants GPUs ``rwm``)."""
    file_mode: int = 0o666
    """The node's mode in the container (Mesos copies nodes as 0666)."""


class ContainerBindMount(msgspec.Struct, frozen=True, kw_only=True):
    """A recursive bind mount an engine adds, by container path (the driver volume)."""

    host_path: str
    container_path: str
    read_only: bool = True

    def oci_options(self) -> list[str]:
        """The OCI mount options: Mesos' MS_BIND|MS_REC (+ MS_RDONLY)."""
        return ["rbind", "ro"] if self.read_only else ["rbind"]


class ContainerGrant(msgspec.Struct, frozen=True, kw_only=True):
    """What a container is granted, in the terms container engines use: the
    device nodes (its GPUs, then the control devices), the driver volume's
    mount when injected, the environment (``NVIDIA_VISIBLE_DEVICES``) and
    the volume's PATH/LD_LIBRARY_PATH when injected (``loader_environment``).
    The CDI spec and ``ContainerLaunchInfo.to_oci()`` are two renderings of
    it: ``to_oci()`` sets the loader environment (Mesos' way, R-VO-3), a CDI
    spec never does -- it updates the container's loader cache instead
    (R-DR-2, ``isolators.cdi.DriverInjection``)."""

    devices: tuple[ContainerDevice, ...] = ()
    mounts: tuple[ContainerBindMount, ...] = ()
    environment: dict[str, str] = {}
    loader_environment: dict[str, str] = {}
    """The volume's PATH and LD_LIBRARY_PATH (R-VO-3); empty without the volume."""


class ContainerLaunchInfo(msgspec.Struct, kw_only=True):
    """What the isolator asks the launcher to do (mounts, environment), and
    the grant for container engines (``grant``, ``cdi_devices``, ``to_oci()``)."""

    mounts: list[ContainerMountInfo] = []
    environment: dict[str, str] | None = None
    task_environment: dict[str, str] | None = None
    grant: ContainerGrant | None = None
    """The container's grant as engines take it (None: nothing granted)."""
    cdi_devices: list[str] = []
    """Fully-qualified CDI device names (``vendor/class=name``) to hand the
    engine (``podman run --device NAME``); empty unless ``Flags.cdi_spec_dir``."""

    def to_oci(self) -> dict[str, Any]:
        """The grant as an OCI runtime-spec fragment that merges into
        ``config.json``: ``process.env`` (``KEY=VALUE``; the environment, the
        task environment and the grant's, later ones winning), ``mounts``
        (bind mounts by container path), ``linux.devices`` (each granted
        node with type, major, minor and mode) and ``linux.resources.devices``
        (one exact allow entry per node, never a wildcard). Merge it with
        ``isolators.cdi.merge_oci``."""
        env: dict[str, str] = {}
        env.update(self.environment or {})
        env.update(self.task_environment or {})
        grant = self.grant or ContainerGrant()
        env.update(grant.environment)
        env.update(grant.loader_environment)
        return {
            "process": {"env": [f"{key}={value}" for key, value in env.items()]},
            "mounts": [
                {"destination": m.container_path, "type": "bind", "source": m.host_path,
                 "options": m.oci_options()}
                for m in grant.mounts
            ],
            "linux": {
                "devices": [
                    {"path": d.path, "type": d.type, "major": d.major, "minor": d.minor,
                     "fileMode": d.file_mode, "uid": 0, "gid": 0}
                    for d in grant.devices
                ],
                "resources": {"devices": [
                    {"allow": True, "type": d.type, "major": d.major, "minor": d.minor, "access": d.permissions}
                    for d in grant.devices
                ]},
            },
        }


class ContainerState(msgspec.Struct):
    """A container the agent knew about before a restart."""

    container_id: ContainerID
    pid: int = 0
    directory: str = ""


class GpuStatistics(msgspec.Struct, kw_only=True):
    """NVML's view of one GPU held by a container (None where NVML has no answer).
    For a MIG device: ``minor`` is its parent's, ``uuid`` its ``MIG-…`` UUID, and
    ``mig_profile``, ``gpu_instance_id``, ``compute_instance_id`` say which one."""

    minor: int
    uuid: str | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_gpu_percent: int | None = None
    utilization_memory_percent: int | None = None
    power_milliwatts: int | None = None
    temperature_celsius: int | None = None
    mig_profile: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class ResourceStatistics(msgspec.Struct, kw_only=True):
    """Usage of a container; Mesos' fields this isolator fills, plus per-GPU stats."""

    timestamp: float = 0.0
    gpus_allocated: int = 0
    gpus: list[GpuStatistics] = []


class ContainerLimitation(msgspec.Struct, kw_only=True):
    """A reason the container must be stopped (e.g. its GPU became unhealthy)."""

    resources: Resources = Resources()
    message: str = ""
    reason: str = "REASON_GPU_UNHEALTHY"


class Repair(msgspec.Struct, frozen=True):
    """One drift repair done by ``reconcile`` -- or one that could not be done:
    ``failed`` is then True and ``reason`` says why (the GPUs the container
    may reach are held back until it is repaired or cleaned up)."""

    container_id: str
    description: str
    failed: bool = False
    reason: str | None = None


def decode_hook(type_: type, obj: Any) -> Any:
    """msgspec ``dec_hook``: ``Resources`` from text, ``ContainerID`` from ``a.b``."""
    if type_ is Resources:
        return Resources.coerce(obj)
    if type_ is ContainerID and isinstance(obj, str):
        return ContainerID.parse(obj)
    raise NotImplementedError(f"Objects of type {type_} are not supported")
