"""The isolator as a service (SPEC section 16): ``serve``, ``exec``, ``status``.

- ``_service``: ``GpuIsolatorService``, the network-reachable process in
  front of an isolator (messages, the waiting line, exec containers
  released once empty, ``GET /gpu-isolator/state``), recovering from its
  records (``_records``) and the kernel.
- ``_messages``: the wire Structs and the state document.
- ``_line``: the prepares not answered yet and the line they wait in.
- ``_demand``: what a request asks for (GPUs, MIG devices by profile);
  ``_units``: what the node hands out, counted and shown (MIG included).
- ``_host``: what the service asks the host (socket owners, processes,
  cgroup membership).
- ``_client``: ``ServiceClient``, a process that asks a service.
- ``_serve``: ``serve`` until SIGTERM/SIGINT; ``_exec`` and ``_launcher``:
  the exec client and its command, moved into the cgroup before it runs;
  ``_status``: the state as a table; ``_commands``: the CLI wiring.
Each module states its rules at the top. Names are imported when first used
(``exec`` and ``status`` need little of the agent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime._lazy import lazy_exports

_EXPORTS = {
    "._client": ("LostService", "ServiceClient"),
    "._exec": ("DEFAULT_AGENT", "exec_command"),
    "._launcher": ("PendingCommand", "SignalForwarder", "exit_code"),
    "._messages": ("SERVICE_ID", "CleanedUp", "Cleanup", "ContainerView", "GrantedGpu", "MigDeviceView", "Prepare",
                   "Prepared", "Queued", "ServiceState", "Start", "Started", "Statistics", "Update", "Updated", "Usage",
                   "WaitingView", "visible_devices_env"),
    "._records": ("ContainerRecord", "RecordsError", "RecordsFile", "records_file"),
    "._serve": ("serve", "service_flags"),
    "._service": ("GpuIsolatorService", "ServiceError"),
    "._status": ("fetch_state", "render_state"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._client import LostService, ServiceClient
    from ._exec import DEFAULT_AGENT, exec_command
    from ._launcher import PendingCommand, SignalForwarder, exit_code
    from ._messages import *  # noqa: F403 -- its __all__, the names _EXPORTS lists for it
    from ._records import ContainerRecord, RecordsError, RecordsFile, records_file
    from ._serve import serve, service_flags
    from ._service import GpuIsolatorService, ServiceError
    from ._status import fetch_state, render_state
