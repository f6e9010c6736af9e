"""Where the MPS control daemons live in the kernel's cgroups: out of the front door's own (R-MP-1).

Rules:
- A front door in a pod is stopped by killing its container's cgroup (runc
  on cgroup v2: ``cgroup.kill``; on v1 every process it finds there) and
  then its pod's (the kubelet kills what is left in the pod's cgroup of
  every hierarchy it knows). A daemon born there dies with it, and with it
  the server every running client of the unit talks to: a rolling update
  of the plugin would cut the GPU from under every pod sharing it. So a
  daemon is started in a cgroup of its own choosing, ``<mount>/<name>`` in
  every cgroup hierarchy mounted (``cgroup`` and ``cgroup2`` lines of
  ``/proc/self/mountinfo``), before it runs: its servers are born there too.
  The front door that comes back takes it over (``_daemon.running_pid``).
- ``validate_mps_cgroup(name)``: a relative path of plain components (no ``..``,
  no ``.``, no empty component, no control character), else ``MpsError``
  naming it; ``NO_CGROUP`` (``none``) keeps the daemons in the front door's
  cgroups (they die with its container).
- ``procs_files(name)`` makes ``<mount>/<name>`` in each hierarchy (each
  level a v1 ``cpuset`` hierarchy makes gets its parent's ``cpuset.cpus``
  and ``cpuset.mems``: an empty cpuset takes no process) and returns each
  one's ``cgroup.procs``, which the daemon's launcher writes itself into
  (``_daemon.start``). One it cannot make is ``MpsError`` naming the path,
  the reason and the way out. Only root moves processes between cgroups;
  the caller does not call it otherwise. Blocking: run it in an Executor.
- In a pod this needs what the chart gives a sharing front door: a
  privileged container (no cgroup namespace of its own under the CRI
  runtimes), ``hostPID`` (a pod's own PID namespace takes every process
  in it down with its first) and the host's ``/sys/fs/cgroup``.
"""

from __future__ import annotations

import errno
import os

from ._errors import MpsError

__all__ = ["DEFAULT_MPS_CGROUP", "NO_CGROUP", "validate_mps_cgroup", "procs_files", "cgroup_mounts"]

DEFAULT_MPS_CGROUP = "gpu-isolator-mps"
"""The chart's choice: ``<mount>/gpu-isolator-mps`` in every hierarchy."""
NO_CGROUP = "none"
_CPUSET_FILES = ("cpuset.cpus", "cpuset.mems")


def validate_mps_cgroup(name: str) -> str:
    """``name`` if it is a relative cgroup path of plain components (see module rules)."""
    bad = None
    if not isinstance(name, str) or not name.strip():
        bad = "it must not be empty"
    elif name.startswith("/"):
        bad = "it must be a relative path (under each hierarchy's root)"
    elif any(ord(c) < 32 for c in name):
        bad = "control characters are not allowed"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        bad = "every component must be a plain name (no '..', '.' or empty component)"
    if bad is not None:
        raise MpsError(f"invalid MPS daemons' cgroup {name!r}: {bad}; give a name such as {DEFAULT_MPS_CGROUP!r}"
                       f" or {NO_CGROUP!r}")
    return name


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """Every cgroup hierarchy mounted whole here, as ``(mount point, fstype)``, in mount order."""
    mounts: list[tuple[str, str]] = []
    seen: set[str] = set()
    with open(mountinfo) as handle:
        for line in handle:
            fields = line.split()
            try:
                fstype = fields[fields.index("-") + 1]
            except (ValueError, IndexError):
                continue
            root, point = fields[3], fields[4].replace("\\040", " ")
            if fstype in ("cgroup", "cgroup2") and root == "/" and point not in seen:
                seen.add(point)
                mounts.append((point, fstype))
    return mounts


def _make(mount: str, name: str, cpuset: bool) -> str:
    """``<mount>/<name>``, each level made under the mount (never the mount itself); the directory."""
    if not os.path.isdir(mount):
        raise FileNotFoundError(errno.ENOENT, "the hierarchy's mount point is not a directory", mount)
    directory = mount
    for part in name.split("/"):
        parent, directory = directory, os.path.join(directory, part)
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue
        if cpuset:
            for file in _CPUSET_FILES:
                with open(os.path.join(parent, file)) as source:
                    value = source.read().strip()
                with open(os.path.join(directory, file), "w") as target:
                    target.write(value)
    return directory


def procs_files(name: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Make ``<mount>/<name>`` in every hierarchy; each one's ``cgroup.procs`` (see module rules)."""
    validate_mps_cgroup(name)
    try:
        mounts = cgroup_mounts(mountinfo)
    except OSError as exc:
        raise MpsError(f"cannot read {mountinfo} to find the cgroup hierarchies for the MPS daemons:"
                       f" {exc.strerror or exc}") from None
    if not mounts:
        raise MpsError(f"no cgroup hierarchy is mounted here (none in {mountinfo}) to keep the MPS daemons in"
                       f" {name!r}; mount the host's /sys/fs/cgroup, or keep them in the front door's cgroup with"
                       f" --mps_cgroup={NO_CGROUP}")
    files = []
    for mount, fstype in mounts:
        directory = os.path.join(mount, name)
        cpuset = fstype == "cgroup" and os.path.exists(os.path.join(mount, "cpuset.cpus"))
        try:
            _make(mount, name, cpuset)
        except OSError as exc:
            raise MpsError(
                f"cannot make the MPS daemons' cgroup {directory}: {exc.strerror or exc}; run the front door as"
                f" root with the host's cgroups (in a pod: privileged, hostPID and the host's /sys/fs/cgroup),"
                f" or keep the daemons in its own cgroup with --mps_cgroup={NO_CGROUP} (they then stop with it)"
            ) from None
        files.append(os.path.join(directory, "cgroup.procs"))
    return files
