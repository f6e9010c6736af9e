"""The isolator as a service (SPEC sections 16 and 19): ``serve``, ``exec``, ``status``.

- ``_service``: ``GpuIsolatorService``, the process in front of an
  isolator: it answers the verbs, decides the owner check, and owns its
  parts -- ``_admission`` (prepares admitted in order, the waiting line,
  per-user limits, the grant), ``_exec_containers`` (commands handed to
  their supervisor, released once empty), ``_checkpoint`` (its records,
  ``_records``, written in order) and ``_confine`` (``--confine``);
  ``_recovery``: what it recovers at start from its records and the
  kernel; ``_state``: the state each caller may read.
- ``_front_door``: the unix socket users reach it through (who is asking
  comes from the kernel: ``_caller``), framed as ``_frames`` says;
  ``_caller``: who is asking and what they may touch, decided in one
  place; ``_trust``: the directories it trusts (StrictModes).
- ``_messages``: the request and answer Structs and the state document.
- ``_line``: the prepares not answered yet and the line they wait in.
- ``_demand``: what a request asks for (GPUs, MIG devices by profile);
  ``_units``: what the node hands out, counted and shown (MIG included).
- ``_launcher`` and ``_supervisor``: the command started by the service,
  as the caller, inside its cgroup; ``_host``: what the kernel says of a
  cgroup's processes.
- ``_client``: ``SocketClient``, one connection to the service;
  ``_exec``: the exec client; ``_status``: the state as a table;
  ``_serve``: ``serve`` until SIGTERM/SIGINT; ``_commands``: the CLI wiring.
Each module states its rules at the top. Names are imported when first used
(``exec`` and ``status`` need little of the agent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import lazy_exports

_EXPORTS = {
    "._admission": ("UserLimits",),
    "._caller": ("Caller", "ServiceError", "authorize"),
    "._client": ("DEFAULT_SOCKET", "LostService", "Refused", "SocketClient", "socket_path"),
    "._commands": ("add_commands",),
    "._exec": ("exec_command",),
    "._launcher": ("SignalForwarder", "exit_code"),
    "._messages": ("SERVICE_ID", "CleanedUp", "Cleanup", "ContainerView", "Exited", "GrantedGpu", "MigDeviceView",
                   "Prepare", "Prepared", "Queued", "Refusal", "ServiceState", "Signal", "Started", "StateRequest",
                   "Statistics", "Update", "Updated", "Usage", "UserShare", "WaitingView", "visible_devices_env"),
    "._records": ("ContainerRecord", "RecordsError", "RecordsFile", "records_file"),
    "._serve": ("ServeOptions", "serve", "service_flags"),
    "._service": ("GpuIsolatorService",),
    "._status": ("fetch_state", "render_state"),
    "._trust": ("UntrustedPath", "check_trusted_dir"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._admission import UserLimits
    from ._caller import Caller, ServiceError, authorize
    from ._client import DEFAULT_SOCKET, LostService, Refused, SocketClient, socket_path
    from ._commands import add_commands
    from ._exec import exec_command
    from ._launcher import SignalForwarder, exit_code
    from ._messages import *  # noqa: F403 -- its __all__, the names _EXPORTS lists for it
    from ._records import ContainerRecord, RecordsError, RecordsFile, records_file
    from ._serve import ServeOptions, serve, service_flags
    from ._service import GpuIsolatorService
    from ._status import fetch_state, render_state
    from ._trust import UntrustedPath, check_trusted_dir
