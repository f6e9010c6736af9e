"""What the service asks the kernel about its containers' processes (blocking).

Rules:
- ``cgroup_pids(dirs)``: the processes in each cgroup (``cgroup.procs``;
  none when it is gone). One call per poll, for every cgroup polled.
- ``cgroup_of(pid, controller)``: a process's cgroup on the hierarchy with
  ``controller`` (``devices`` on v1, ``""`` for the unified hierarchy), as
  ``/proc/<pid>/cgroup`` says; None when it has no such line (or is gone).
- Nothing here trusts what a client says: the service never moves a
  client's process (the command's supervisor joins the cgroup itself).
- All of these block: the service runs each through its executor, one job
  per request or poll.
"""

from __future__ import annotations

import os

__all__ = ["cgroup_of", "cgroup_pids"]


def cgroup_of(pid: int, controller: str, proc: str = "/proc") -> str | None:
    """The cgroup path of ``pid`` on the hierarchy with ``controller``
    (``""``: the unified hierarchy), None when it has no such line."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup")) as lines:
            for line in lines:
                number, controllers, path = line.rstrip("\n").split(":", 2)
                if controller == "" and number == "0" and controllers == "":
                    return path
                if controller and controller in controllers.split(","):
                    return path
    except OSError:
        return None
    return None


def cgroup_pids(cgroup_dirs: list[str]) -> list[list[int]]:
    """The processes in each cgroup ([] when it is gone)."""
    found = []
    for directory in cgroup_dirs:
        try:
            with open(os.path.join(directory, "cgroup.procs")) as procs:
                found.append([int(line) for line in procs if line.strip()])
        except (OSError, ValueError):
            found.append([])
    return found
