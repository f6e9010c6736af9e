"""``gpu-isolator status``: the service's state as a table.

Rules:
- ``fetch_state(agent)`` GETs ``/gpu-isolator/state`` from the service at
  ``agent`` (blocking, bounded by ``timeout``) and decodes it to a
  ``ServiceState``; a service that cannot be reached or answers something
  else is one ``Failure`` saying so.
- ``render_state(state)`` is the table: one row per container (GPUs, user,
  process, state, age, command), then the free and unhealthy GPUs and the
  waiting line.
"""

from __future__ import annotations

import http.client
import shlex
import time

import msgspec

from runtime import Failure

from ._messages import ServiceState

__all__ = ["fetch_state", "render_state"]


def fetch_state(host: str, port: int, timeout: float = 10.0) -> ServiceState:
    where = f"{host}:{port}"
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/gpu-isolator/state")
        response = connection.getresponse()
        body = response.read()
    except OSError as error:
        raise Failure(f"cannot reach the gpu-isolator service at {where}: {error.strerror or error}"
                      " (is 'gpu-isolator serve' running there?)") from None
    except http.client.HTTPException as error:
        raise Failure(f"the service at {where} did not answer in HTTP: {error!r}") from None
    finally:
        connection.close()
    if response.status != 200:
        text = body.decode("utf-8", "replace").strip().splitlines()
        raise Failure(f"the service at {where} answered {response.status}: {text[0] if text else response.reason}"
                      " (is it a gpu-isolator service?)")
    try:
        return msgspec.json.decode(body, type=ServiceState)
    except msgspec.DecodeError as error:
        raise Failure(f"the service at {where} answered an unreadable state: {error}") from None


def _minors(minors: list[int]) -> str:
    return ",".join(str(m) for m in minors) or "-"


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
    lines = [f"{state.address}: {state.backend}, {len(state.total)} GPU(s): {len(state.free)} free,"
             f" {len(state.unhealthy)} unhealthy, {len(state.containers)} container(s),"
             f" {len(state.waiting)} waiting"]
    rows = [["CONTAINER", "GPUS", "USER", "PID", "STATE", "AGE", "COMMAND"]]
    for name, view in sorted(state.containers.items()):
        rows.append([name, _minors(view.gpus), view.user or "-", str(view.pid or "-"), view.state,
                     _age(view.since, now), shlex.join(view.command) if view.command else "-"])
    lines += _table(rows) if len(rows) > 1 else ["(no containers)"]
    lines.append(f"free GPUs:      {_minors(state.free)}")
    lines.append(f"unhealthy GPUs: {unhealthy or '-'}")
    if state.waiting:
        lines.append("waiting (first come, first served):")
        rows = [["  CONTAINER", "GPUS", "USER", "AGE", "COMMAND"]]
        for view in state.waiting:
            rows.append([f"  {view.container_id}", str(view.gpus), view.user or "-", _age(view.since, now),
                         shlex.join(view.command) if view.command else "-"])
        lines += _table(rows)
    return "\n".join(lines)
