"""``gpu-isolator status``: the service's state as a table.

Rules:
- ``fetch_state(socket)`` asks the service on its unix socket for the
  state (blocking, bounded by ``timeout``) and decodes it to a
  ``ServiceState``: the caller's own containers and waiting requests,
  other users' as counts per user (root sees everything; SPEC R-SC-5). A
  service that cannot be reached or answers something else is one
  ``Failure`` saying so.
- ``render_state(state)`` is the table: one row per container (GPUs, user,
  process, state, age, command; a MIG device by NVIDIA's name
  ``<GPU index>:<MIG index>``), then what other users hold, the free and
  unhealthy GPUs, on a MIG node its MIG devices (name, profile, identity,
  holder or free, health) and how to ask for them, or the GPUs in MIG
  mode handed out whole, and the waiting line.
"""

from __future__ import annotations

import shlex
import time

import msgspec

from runtime import Failure

from ._client import LostService, Refused, SocketClient
from ._messages import ServiceState

__all__ = ["fetch_state", "render_state"]


def fetch_state(socket_path: str, timeout: float = 10.0) -> ServiceState:
    try:
        with SocketClient.connect(socket_path, timeout) as client:
            frame = client.ask("state", {}, timeout=timeout)
    except (LostService, Refused) as error:
        raise Failure(str(error)) from None
    except TimeoutError:
        raise Failure(f"the gpu-isolator service at {socket_path} did not answer within {timeout:g} s") from None
    if frame.verb != "state":
        raise Failure(f"the service at {socket_path} answered {frame.verb!r} to 'state' (is it a gpu-isolator"
                      " service?)")
    try:
        return msgspec.convert(frame.body, type=ServiceState)
    except msgspec.ValidationError as error:
        raise Failure(f"the service at {socket_path} answered an unreadable state: {error}") from None


def _minors(minors: list[int]) -> str:
    return ",".join(str(m) for m in minors) or "-"


def _wanted(gpus: int, mig: dict[str, int]) -> str:
    parts = [str(gpus)] if gpus or not mig else []
    return ",".join(parts + [f"{profile}:{count}" for profile, count in sorted(mig.items())])


_ASK = {"mixed": "exec --mig PROFILE[:N]", "single": "each is one of 'gpus': exec --gpus N"}


def _age(since: float | None, now: float) -> str:
    if not since:
        return "-"
    seconds = max(0, int(now - since))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip() for row in rows]


def render_state(state: ServiceState, now: float | None = None) -> str:
    now = time.time() if now is None else now
    unhealthy = ", ".join(f"{minor} ({reason})" for minor, reason in sorted(state.unhealthy.items(),
                                                                             key=lambda item: int(item[0])))
    migs = state.mig_devices
    named = {mig.device: mig.name for mig in migs}
    mig_counts = (f", {len(migs)} MIG device(s): {sum(m.container is None and m.user is None and m.unhealthy is None for m in migs)}"
                  f" free, {sum(m.unhealthy is not None for m in migs)} unhealthy") if migs else ""
    lines = [f"{state.socket or state.address}: {state.backend}, {len(state.total)} GPU(s): {len(state.free)} free,"
             f" {len(state.unhealthy)} unhealthy{mig_counts}, {len(state.containers)} container(s),"
             f" {len(state.waiting)} waiting"]
    rows = [["CONTAINER", "GPUS", "USER", "PID", "STATE", "AGE", "COMMAND"]]
    for name, view in sorted(state.containers.items()):
        gpus = ",".join([str(m) for m in view.gpus] + [named.get(d, d) for d in view.mig_devices]) or "-"
        rows.append([name, gpus, view.user or "-", str(view.pid or "-"), view.state,
                     _age(view.since, now), shlex.join(view.command) if view.command else "-"])
    lines += _table(rows) if len(rows) > 1 else ["(no containers)"]
    if state.others:
        lines.append("other users:    " + ", ".join(
            f"{user} {share.gpus} GPU(s)" + (f" {share.mig_devices} MIG device(s)" if share.mig_devices else "")
            + (f", {share.waiting} waiting" if share.waiting else "") for user, share in sorted(state.others.items())))
    lines.append(f"free GPUs:      {_minors(state.free)}")
    lines.append(f"unhealthy GPUs: {unhealthy or '-'}")
    if state.mig_mode:
        lines.append(f"MIG mode:       GPU(s) {_minors(state.mig_mode)} handed out whole (--nvidia_mig_strategy="
                     f"{state.mig_strategy}: no MIG device is handed out)")
    if migs:
        lines.append(f"MIG devices (--nvidia_mig_strategy={state.mig_strategy}:"
                     f" {_ASK.get(state.mig_strategy, 'not handed out')}):")
        rows = [["  MIG", "PROFILE", "DEVICE", "STATE"]]
        for mig in migs:
            held = [mig.container] if mig.container else [f"held by {mig.user}"] if mig.user else []
            health = [f"unhealthy ({mig.unhealthy})"] if mig.unhealthy is not None else []
            rows.append([f"  {mig.name}", mig.profile, mig.device, ", ".join(held + health) or "free"])
        lines += _table(rows)
    if state.waiting:
        lines.append("waiting (first come, first served):")
        rows = [["  CONTAINER", "GPUS", "USER", "AGE", "COMMAND"]]
        for view in state.waiting:
            rows.append([f"  {view.container_id}", _wanted(view.gpus, view.mig), view.user or "-",
                         _age(view.since, now), shlex.join(view.command) if view.command else "-"])
        lines += _table(rows)
    return "\n".join(lines)
