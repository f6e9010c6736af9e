"""Pods' containers as the kernel and the runtime record them: cgroups under kubepods, and the OCI config's identity.

Rules (R-PR-1, R-PR-3):
- ``parse_container_cgroup(path)`` reads one cgroup path (relative to the
  kubepods root) as ``(pod uid, container id)`` for both cgroup drivers:
  systemd's ``kubepods[-<qos>]-pod<uid with _>.slice/<runtime>-<id>.scope``
  (runtime ``cri-containerd``, ``crio`` or ``docker``; under
  ``kubepods-<qos>.slice`` or directly under the root for guaranteed pods)
  and cgroupfs' ``[<qos>/]pod<uid>/[<runtime>-]<id>``. A pod uid is a UUID
  (36 characters, lower-case hex and dashes), a container id 64 lower-case
  hex digits; anything else is not a container (None): no path is built
  from a name before it was read this way. CRI-O's ``crio-conmon-<id>``
  scopes are not containers.
- ``scan_kubepods(hierarchy, roots)`` lists the containers under each root
  that exists (relative to the hierarchy's mount), walking at most three
  levels (qos, pod, container); a directory that vanishes while it walks
  is skipped.
- ``read_identity(config_path)`` is the Kubernetes identity in a
  container's OCI config (``annotations``): containerd's
  ``io.kubernetes.cri.sandbox-namespace`` / ``-name`` / ``-uid`` and
  ``io.kubernetes.cri.container-name``, or CRI-O's
  ``io.kubernetes.pod.namespace`` / ``.name`` / ``.uid`` and
  ``io.kubernetes.container.name``; None for a missing or unreadable file,
  or a sandbox (pause) container. ``DEFAULT_CONFIG_TEMPLATES`` are where
  containerd (CRI and docker's moby namespace) and CRI-O keep it, ``{id}``
  the container id, and where the distributions that move containerd's
  state keep it (R-PR-6): k3s and RKE2 (``/run/k3s/containerd``: k3s'
  ``applyContainerdStateAndAddress``, which RKE2 runs too) and MicroK8s
  (``--state ${SNAP_COMMON}/run/containerd``, SNAP_COMMON
  ``/var/snap/microk8s/common``: its ``default-args/containerd``); each
  containerd keeps a task's bundle at
  ``<state>/io.containerd.runtime.v2.task/<namespace>/<id>``.
- ``first_process(cgroup_dir)`` is a pid in the cgroup (None: empty or gone);
  ``gpu_nodes_in(root_dev)`` the character nodes named ``nvidia<digits>``
  and ``nvidia-caps/*`` in a container's ``/dev`` (``/proc/<pid>/root/dev``)
  by ``(major, minor)`` -> container path.
"""

from __future__ import annotations

import os
import re
import stat

import msgspec

__all__ = [
    "ContainerCgroup", "PodIdentity", "DEFAULT_CONFIG_TEMPLATES", "DEFAULT_KUBEPODS_ROOTS",
    "parse_container_cgroup", "scan_kubepods", "read_identity", "first_process", "gpu_nodes_in",
]

DEFAULT_KUBEPODS_ROOTS = ("kubepods.slice", "kubepods")
"""The systemd driver's root, then cgroupfs' (R-PR-1: both tried when --kubepods_root is unset)."""

DEFAULT_CONFIG_TEMPLATES = (
    "/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "/run/containerd/io.containerd.runtime.v2.task/moby/{id}/config.json",
    "/run/containers/storage/overlay-containers/{id}/userdata/config.json",
    "/run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "/var/snap/microk8s/common/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
)

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID_UNDERSCORED = r"[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}"
_ID = r"[0-9a-f]{64}"
_RUNTIMES = r"(?:cri-containerd|crio|docker)"
_SYSTEMD = re.compile(
    rf"(?:kubepods-(?:besteffort|burstable)\.slice/)?kubepods(?:-(?:besteffort|burstable))?-pod({_UUID_UNDERSCORED})"
    rf"\.slice/{_RUNTIMES}-({_ID})\.scope")
_CGROUPFS = re.compile(rf"(?:(?:besteffort|burstable)/)?pod({_UUID})/(?:{_RUNTIMES}-)?({_ID})")

_MAX_CONFIG_BYTES = 4 << 20


class ContainerCgroup(msgspec.Struct, frozen=True, kw_only=True):
    """One container's cgroup in one hierarchy."""

    hierarchy: str
    """The hierarchy's mount (``/sys/fs/cgroup/devices`` on v1, the cgroup2 mount on v2)."""
    version: int
    path: str
    """Relative to the mount: ``<root>/<the parsed path>``."""
    pod_uid: str
    container_id: str

    @property
    def directory(self) -> str:
        return os.path.join(self.hierarchy, self.path)


class PodIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Who a container is, in the kubelet's words."""

    namespace: str
    pod: str
    pod_uid: str
    container: str


def parse_container_cgroup(path: str) -> tuple[str, str] | None:
    """``(pod uid, container id)`` of a container cgroup path (see module rules)."""
    match = _SYSTEMD.fullmatch(path)
    if match:
        return match.group(1).replace("_", "-"), match.group(2)
    match = _CGROUPFS.fullmatch(path)
    if match:
        return match.group(1), match.group(2)
    return None


def _subdirs(directory: str) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def scan_kubepods(hierarchy: str, version: int, roots: tuple[str, ...]) -> list[ContainerCgroup]:
    """The containers under each kubepods root of ``hierarchy`` (see module rules)."""
    found = []
    for root in roots:
        base = os.path.join(hierarchy, root)
        stack = [("", 0)]
        while stack:
            relative, depth = stack.pop()
            for name in _subdirs(os.path.join(base, relative)):
                path = f"{relative}/{name}" if relative else name
                parsed = parse_container_cgroup(path)
                if parsed is not None:
                    found.append(ContainerCgroup(hierarchy=hierarchy, version=version, path=f"{root}/{path}",
                                                 pod_uid=parsed[0], container_id=parsed[1]))
                elif depth < 2:
                    stack.append((path, depth + 1))
    return sorted(found, key=lambda cgroup: cgroup.path)


def read_identity(config_path: str) -> PodIdentity | None:
    """The Kubernetes identity in an OCI config's annotations (see module rules)."""
    try:
        with open(config_path, "rb") as handle:
            data = handle.read(_MAX_CONFIG_BYTES)
        annotations = msgspec.json.decode(data).get("annotations") or {}
    except (OSError, msgspec.DecodeError, AttributeError):
        return None
    if not isinstance(annotations, dict):
        return None

    def first(*keys: str) -> str:
        for key in keys:
            value = annotations.get(key)
            if isinstance(value, str) and value:
                return value
        return ""

    if first("io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType") == "sandbox":
        return None
    identity = PodIdentity(
        namespace=first("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
        pod=first("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
        pod_uid=first("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"),
        container=first("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
    )
    if not (identity.namespace and identity.pod and identity.container):
        return None
    return identity


def first_process(cgroup_dir: str) -> int | None:
    """A pid in the cgroup, None when it has none or is gone."""
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "rb") as handle:
            for line in handle:
                if line.strip():
                    return int(line)
    except (OSError, ValueError):
        return None
    return None


def gpu_nodes_in(root_dev: str) -> dict[tuple[int, int], str]:
    """The GPU and capability nodes in a container's /dev (see module rules)."""
    nodes: dict[tuple[int, int], str] = {}
    candidates = [name for name in _names(root_dev) if re.fullmatch(r"nvidia\d+", name)]
    candidates += [f"nvidia-caps/{name}" for name in _names(os.path.join(root_dev, "nvidia-caps"))]
    for name in candidates:
        try:
            info = os.lstat(os.path.join(root_dev, name))
        except OSError:
            continue
        if stat.S_ISCHR(info.st_mode):
            nodes[(os.major(info.st_rdev), os.minor(info.st_rdev))] = f"/dev/{name}"
    return nodes


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []
