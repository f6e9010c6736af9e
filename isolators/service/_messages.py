"""The service's messages and its state document (msgspec Structs).

Rules:
- Users send requests on the unix socket as frames (``_frames``:
  ``{"verb": NAME, "body": {...}}``) and get the answers on the same
  connection; an agent holding the bearer credential may send
  ``prepare`` (without a command), ``update``, ``usage`` and ``cleanup``
  as libprocess messages to ``gpu-isolator@HOST:PORT`` and gets them to
  its PID (SPEC R-SC-6). Every request carries ``request``, a string
  chosen by the sender, echoed by each reply, so a sender can match
  answers to questions. Nothing in a request says who sends it.
- Answers: ``queued`` (a ``prepare`` with ``wait`` that must wait its
  turn; ``prepared`` follows later), ``prepared``, ``updated``,
  ``statistics``, ``cleaned_up``, ``state``; for exec, ``started`` and
  ``exited`` (from the command's supervisor, on the same connection). A
  reply whose ``error`` is set is a refusal with one line of text (Mesos'
  wording where Mesos has one); the other fields are then empty.
  ``error`` (``Refusal``) answers a frame the service cannot take, and the
  connection closes.
- ``prepare`` with a ``command`` asks for an exec container: the service
  starts the command itself in it, as the caller, with ``env`` and ``cwd``
  (and the stdin, stdout and stderr passed with the frame); the client
  forwards ``signal``s and gets ``exited``. The container is released
  once no process is left in it.
- Units: ``gpus`` counts what the node hands out as ``gpus`` (whole GPUs;
  under ``--nvidia_mig_strategy=single`` its MIG devices); ``mig`` asks
  for MIG devices by profile (``{"1g.18gb": 2}``), offered under
  ``--nvidia_mig_strategy=mixed`` only (``_demand``). A granted MIG device
  is named by its identity (``195:0/gi3/ci0``) and, as NVIDIA names it,
  ``<GPU index>:<MIG index>``; its UUID (``MIG-...``) goes into the
  visible-devices variables.
- The state a caller reads is its own (SPEC R-SC-5): its containers and
  waiting requests whole, other users' only as counts per user
  (``others``); root and agents read everything.
- Unknown fields are ignored (newer clients); a body that does not decode
  to its Struct is refused, never guessed at.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .._types import ResourceStatistics

__all__ = [
    "SERVICE_ID", "Prepare", "Update", "Usage", "Cleanup", "StateRequest", "Signal",
    "GrantedGpu", "Queued", "Prepared", "Started", "Exited", "Updated", "Statistics", "CleanedUp", "Refusal",
    "ContainerView", "WaitingView", "MigDeviceView", "UserShare", "ServiceState", "visible_devices_env",
]

SERVICE_ID = "gpu-isolator"
"""The service's process id: it is ``gpu-isolator@HOST:PORT``."""

_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Pid = Annotated[int, msgspec.Meta(ge=1, le=(1 << 22))]


# -- requests ------------------------------------------------------------------
class Prepare(msgspec.Struct, kw_only=True):
    """A new top-level container holding ``gpus`` GPUs and ``mig`` MIG devices."""

    request: str
    container_id: str
    gpus: _Count = 0
    mig: dict[str, _Count] = {}
    """MIG devices by profile (``{"1g.18gb": 2}``; ``--nvidia_mig_strategy=mixed``)."""
    wait: bool = False
    """Queue until enough GPUs are free (first come, first served) instead of failing."""
    command: list[str] | None = None
    """The command the service starts in it, as the caller (an exec container; see the module rules)."""
    env: dict[str, str] | None = None
    """The command's environment (the client's); the visible-devices variables are set over it."""
    cwd: str | None = None
    """The directory the command starts in (the client's, an absolute path), entered as the caller."""


class Update(msgspec.Struct, kw_only=True):
    request: str
    container_id: str
    gpus: _Count
    mig: dict[str, _Count] = {}
    """MIG devices by profile it is to hold (none: it holds none)."""


class Usage(msgspec.Struct, kw_only=True):
    request: str
    container_id: str


class Cleanup(msgspec.Struct, kw_only=True):
    """Clean a container up (an exec container: once it is empty), or cancel a waiting prepare."""

    request: str
    container_id: str


class StateRequest(msgspec.Struct, kw_only=True):
    """The state as the caller may read it (``status``)."""

    request: str = ""


class Signal(msgspec.Struct, kw_only=True):
    """To the command's supervisor: send signal ``signo`` to the command (``group``: its process group)."""

    signo: Annotated[int, msgspec.Meta(ge=1, le=64)]
    group: bool = False


# -- replies -------------------------------------------------------------------
class GrantedGpu(msgspec.Struct, kw_only=True):
    """A granted GPU or MIG device (then ``minor`` and ``index`` are its parent GPU's)."""

    minor: int
    uuid: str | None = None
    index: int | None = None
    mig_device: str | None = None
    """A MIG device's identity, ``195:0/gi3/ci0``."""
    mig_index: int | None = None
    """A MIG device's index on its GPU (NVIDIA's name for it: ``<index>:<mig_index>``)."""
    profile: str | None = None
    mig_mode: bool = False
    """A whole GPU in MIG mode (``--nvidia_mig_strategy=none``): CUDA runs on it only through MIG devices."""


class Queued(msgspec.Struct, kw_only=True):
    request: str
    container_id: str
    position: int
    """1 = next in line."""
    gpus: int
    free: int
    mig: dict[str, int] = {}
    """The MIG devices asked for, by profile."""
    mig_free: dict[str, int] = {}
    """How many of each of those profiles are free."""


def visible_devices_env(uuids: list[str]) -> dict[str, str]:
    """``NVIDIA_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` for these GPUs
    (no GPU: ``none`` and empty, so CUDA sees none)."""
    joined = ",".join(uuids)
    return {"NVIDIA_VISIBLE_DEVICES": joined or "none", "CUDA_VISIBLE_DEVICES": joined}


class Prepared(msgspec.Struct, kw_only=True):
    request: str
    container_id: str
    error: str | None = None
    gpus: list[GrantedGpu] = []
    env: dict[str, str] = {}
    """``NVIDIA_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES``: the GPUs' UUIDs."""


class Started(msgspec.Struct, kw_only=True):
    """The command runs (from its supervisor)."""

    container_id: str
    pid: int
    cgroup: str
    """The cgroup's directory (v1: in the devices hierarchy; v2: the unified one)."""


class Exited(msgspec.Struct, kw_only=True):
    """The command ended, or never started (``error``; from its supervisor)."""

    container_id: str
    status: int
    """Its exit status as a shell reports it (128 + N for signal N); 125/126/127 when it did not start."""
    signal: int | None = None
    error: str | None = None
    left: int = 0
    """Processes it left in the container (the GPUs go when they exit)."""
    withdrawn: bool = False
    """Signal ``signal`` came before the command started: the request was withdrawn, nothing ran."""


class Refusal(msgspec.Struct, kw_only=True):
    """A frame the service does not take; the connection then closes."""

    error: str


class Updated(msgspec.Struct, kw_only=True):
    request: str
    container_id: str
    error: str | None = None
    gpus: list[GrantedGpu] = []


class Statistics(msgspec.Struct, kw_only=True):
    request: str
    container_id: str
    error: str | None = None
    statistics: ResourceStatistics | None = None


class CleanedUp(msgspec.Struct, kw_only=True):
    request: str
    container_id: str
    error: str | None = None
    released: bool = True
    """False: processes are still inside; the GPUs go when the last one exits."""
    processes: int = 0


# -- GET /gpu-isolator/state ---------------------------------------------------------
class ContainerView(msgspec.Struct, kw_only=True):
    gpus: list[int]
    """Whole GPUs, by minor."""
    uuids: list[str | None] = []
    """The whole GPUs' UUIDs."""
    mig_devices: list[str] = []
    """MIG devices, by identity (``195:0/gi3/ci0``); details in ``ServiceState.mig_devices``."""
    mig_uuids: list[str | None] = []
    command: list[str] | None = None
    user: str | None = None
    uid: int | None = None
    client: str | None = None
    pid: int | None = None
    since: float | None = None
    state: str = "running"
    """``prepared`` (no process yet), ``running``, ``releasing`` (its GPUs go
    when its last process exits), ``recovered`` (found at start, no record)."""


class WaitingView(msgspec.Struct, kw_only=True):
    container_id: str
    gpus: int
    mig: dict[str, int] = {}
    command: list[str] | None = None
    user: str | None = None
    uid: int | None = None
    client: str | None = None
    since: float | None = None


class UserShare(msgspec.Struct, kw_only=True):
    """What another user holds and waits for, as counts (all a user may read of it)."""

    gpus: int = 0
    """Whole GPUs held."""
    mig_devices: int = 0
    waiting: int = 0
    """Requests waiting in line."""


class MigDeviceView(msgspec.Struct, kw_only=True):
    """A MIG device the service hands out."""

    device: str
    """Its identity, ``195:0/gi3/ci0``."""
    name: str
    """NVIDIA's name, ``<GPU index>:<MIG index>`` (as ``nvidia-smi -L`` and CDI write it)."""
    gpu: int
    """The parent GPU's minor."""
    profile: str
    uuid: str | None = None
    resource: str = ""
    """What it counts under: ``mig-<profile>`` (mixed) or ``gpus`` (single)."""
    container: str | None = None
    """The container holding it (hidden from other users)."""
    user: str | None = None
    """Who holds it."""
    unhealthy: str | None = None
    """Why it is withheld, when it is."""


class ServiceState(msgspec.Struct, kw_only=True):
    containers: dict[str, ContainerView]
    free: list[int]
    """Free whole GPUs, by minor."""
    unhealthy: dict[str, str]
    waiting: list[WaitingView] = []
    total: list[int] = []
    """Every whole GPU handed out, by minor."""
    backend: str = ""
    address: str = ""
    mig_strategy: str = "none"
    mig_devices: list[MigDeviceView] = []
    """Every MIG device handed out (``single`` and ``mixed``), in order."""
    mig_mode: list[int] = []
    """Whole GPUs in MIG mode (minors): handed out whole under ``none``."""
    others: dict[str, UserShare] = {}
    """Other users' share, by user name: what a user who is not root reads instead of their containers."""
    socket: str = ""
    """The unix socket users reach the service through."""
