"""Real container engines for tests: podman and runc on a busybox rootfs.

Rules:
- ``engine_skip_reason("podman", "runc")`` says why an engine test cannot
  run here (not root, a tool missing, no static busybox, no cgroup
  hierarchy); tests skip with it. CI installs ``podman runc
  busybox-static`` from Debian's packages.
- ``build_rootfs(dir)`` is a tiny root filesystem: the static busybox and
  the applets the probe uses. ``add_ldconfig(dir)`` copies the host's
  ``ldconfig`` into it at ``/sbin/ldconfig`` (busybox has none), so
  ``ldconfig -p`` in a container lists its loader cache;
  ``ldconfig_skip_reason()`` says why it cannot (no static ldconfig). ``make_device_nodes(dir, nodes)`` mknods
  character devices (mode 0666) for the engines to grant.
- ``PodmanEngine`` keeps everything it makes under its own directory:
  image storage (vfs unless asked: ``storage_driver="overlay"``), run root
  and temp dir, a ``containers.conf`` of its own (``CONTAINERS_CONF``),
  and cgroups under a uniquely named parent
  (``--cgroup-parent``) that ``close()`` removes. Each podman command runs
  in a private mount namespace where ``/run`` and ``/dev/shm`` are fresh
  tmpfs, ``/run/cdi`` (= ``/var/run/cdi``) is the test's CDI directory, a
  host ``/etc/cdi`` is hidden behind an empty tmpfs, and ``/var/lib`` is an
  overlay whose writes land in the engine's directory: nothing of the host
  is read as a spec and nothing is left in ``/etc/cdi``, ``/var/run/cdi``,
  ``/var/lib/containers`` or ``/dev/shm``. Containers run with
  ``--rm --runtime runc --network none --cgroup-manager cgroupfs`` and the
  rlimits these VMs allow (SPEC R-CD-5: crun refuses the hybrid cgroup
  layout; rlimits cannot be raised). ``build(context, tag, build_args)``
  is ``podman build --layers=false --network none`` with the same runtime,
  rlimits and cgroup parent (its ``RUN`` steps are containers; one layer
  per stage); ``inspect_image(ref)`` its ``podman image inspect``;
  ``popen(args)`` a podman command that keeps running (a container in
  the foreground), in the same namespace and storage. A refused CDI spec
  shows in podman's output only as "unresolvable CDI devices": a failed
  run is retried once with ``--log-level=debug`` so the error names the
  reason.
- ``RuncEngine`` runs a bundle made from ``runc spec`` merged with an OCI
  fragment (``merge_oci``), with its state and cgroups (``cgroupsPath``
  under a uniquely named parent) its own; ``close()`` removes them.
  ``start(rootfs, fragment, command, cgroup=, name=, annotations=)`` runs
  one detached (``runc run -d``) in ``<parent>/<cgroup>`` (a path below the
  parent; the bundle stays at ``<directory>/bundles/<name>``, where its
  ``config.json`` is a runtime's record) and answers a ``RuncContainer``:
  ``exec(args)`` (``runc exec``: inside its namespaces and cgroups),
  ``pid``, ``stop()`` (killed and deleted; ``close()`` stops what is left).
- ``cdi_fragment(spec_file, names)`` resolves CDI device names in a spec
  file as a CDI-enabled runtime does (the device's and the spec's
  ``containerEdits`` device nodes) into an OCI fragment for ``merge_oci``:
  ``linux.devices`` and their ``linux.resources.devices`` allow rules.
- ``PROBE`` is a shell script run in the container: for each path given it
  opens the node read-only and reports ``OK`` or the errno name (ENXIO:
  the cgroup allows it and there is no driver; EPERM: the cgroup denies
  it; ENOENT: absent), then the ``/dev/nvidia*`` nodes with their numbers
  and modes, the mounts whose target names ``nvidia``, then the
  environment. ``parse_probe`` reads that output.
- Every engine call is bounded (``timeout``): a hang fails the test.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import tarfile
import uuid
from typing import Iterable, Mapping, Sequence

import msgspec

from isolators.cdi import merge_oci

__all__ = [
    "ENGINE_TIMEOUT", "PROBE", "ProbeReport", "PodmanEngine", "RuncEngine", "build_rootfs",
    "busybox_path", "engine_skip_reason", "make_device_nodes", "add_ldconfig", "ldconfig_skip_reason",
    "parse_probe", "remove_cgroup_trees", "RuncContainer", "cdi_fragment",
]

ENGINE_TIMEOUT = 90.0
"""Seconds one engine command may take before the test fails."""

_APPLETS = ("sh", "ls", "cat", "env", "stat", "echo", "true", "sed")
_ERRNO_TEXT = {
    "No such device or address": "ENXIO",
    "No such device": "ENODEV",  # a driver serves the major but not that minor (a GPU host)
    "Operation not permitted": "EPERM",
    "No such file or directory": "ENOENT",
    "no such file": "ENOENT",  # busybox's own wording for a missing file
    "Permission denied": "EACCES",
    "Read-only file system": "EROFS",
}

PROBE = r"""
for p in "$@"; do
  if out=$( (exec 3<"$p") 2>&1 ); then echo "open $p OK"; else echo "open $p ${out##*: }"; fi
done
for n in /dev/nvidia*; do
  [ -e "$n" ] && stat -c "node %n %F %t %T %a" "$n"
done
sed -n 's/^[^ ]* \([^ ]*nvidia[^ ]*\) [^ ]* \([^ ]*\) .*/mount \1 \2/p' /proc/self/mounts
echo "env-begin"
env
"""


class ProbeReport(msgspec.Struct, kw_only=True):
    """What ``PROBE`` saw inside a container."""

    opens: dict[str, str]
    """Path -> ``OK`` or an errno name (ENXIO, EPERM, ENOENT, ...)."""
    nodes: dict[str, tuple[str, int, int, int]]
    """``/dev/nvidia*`` path -> (file type, major, minor, mode)."""
    env: dict[str, str]
    mounts: dict[str, list[str]] = {}
    """Mount target containing ``nvidia`` -> its mount options."""


def parse_probe(output: str) -> ProbeReport:
    """Read ``PROBE``'s output (raises ValueError if it did not finish)."""
    opens: dict[str, str] = {}
    nodes: dict[str, tuple[str, int, int, int]] = {}
    env: dict[str, str] = {}
    mounts: dict[str, list[str]] = {}
    lines = output.splitlines()
    if "env-begin" not in lines:
        raise ValueError(f"the probe did not run to its end; it printed:\n{output}")
    marker = lines.index("env-begin")
    for line in lines[:marker]:
        if line.startswith("open "):
            _, path, result = line.split(" ", 2)
            opens[path] = _ERRNO_TEXT.get(result.strip(), result.strip())
        elif line.startswith("node "):
            words = line.split()
            kind = "c" if "character" in line else ("b" if "block" in line else "other")
            nodes[words[1]] = (kind, int(words[-3], 16), int(words[-2], 16), int(words[-1], 8))
        elif line.startswith("mount "):
            _, target, options = line.split(" ", 2)
            mounts[target] = options.split(",")
    for line in lines[marker + 1:]:
        name, sep, value = line.partition("=")
        if sep:
            env[name] = value
    return ProbeReport(opens=opens, nodes=nodes, env=env, mounts=mounts)


# -- skip reasons and the rootfs ------------------------------------------------------


def _is_static_elf(path: str) -> bool:
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as handle:
            return not any(segment["p_type"] == "PT_INTERP" for segment in ELFFile(handle).iter_segments())
    except Exception:
        return False


def busybox_path() -> str | None:
    """A statically linked busybox (Debian's busybox-static), or None."""
    for candidate in (shutil.which("busybox"), "/bin/busybox", "/usr/bin/busybox"):
        if candidate and os.path.isfile(candidate) and _is_static_elf(candidate):
            return candidate
    return None


def _cgroup_mounts() -> list[str]:
    mounts = []
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                fields = line.split()
                fstype = fields[fields.index("-") + 1]
                if fstype in ("cgroup", "cgroup2"):
                    mounts.append(fields[4])
    except OSError:
        pass
    return mounts


def engine_skip_reason(*engines: str) -> str | None:
    """Why tests using these engines (``podman``, ``runc``) cannot run here, or None."""
    if os.geteuid() != 0:
        return "container engine tests need root (podman and runc as root, mknod'd device nodes)"
    for engine in engines:
        if shutil.which(engine) is None:
            return f"{engine} is not installed (CI installs it: apt-get install -y podman runc busybox-static)"
    if "podman" in engines and shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed; podman runs in a private mount namespace"
    if busybox_path() is None:
        return "no statically linked busybox (apt-get install -y busybox-static)"
    if not os.path.isdir("/sys/fs/cgroup/devices") and not _cgroup_mounts():
        return "no cgroup hierarchy mounted"
    return None


def build_rootfs(directory: str) -> str:
    """A busybox root filesystem in ``directory`` (created); returns it."""
    busybox = busybox_path()
    if busybox is None:
        raise RuntimeError("no statically linked busybox to build a rootfs from")
    for sub in ("bin", "dev", "proc", "sys", "tmp", "etc", "usr/local"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    target = os.path.join(directory, "bin", "busybox")
    shutil.copy2(busybox, target)
    os.chmod(target, 0o755)
    for applet in _APPLETS:
        link = os.path.join(directory, "bin", applet)
        if not os.path.lexists(link):
            os.symlink("busybox", link)
    with open(os.path.join(directory, "bin", "probe"), "w") as handle:
        handle.write(PROBE)
    for name, text in (("passwd", "root:x:0:0:root:/:/bin/sh\n"), ("group", "root:x:0:\n")):
        with open(os.path.join(directory, "etc", name), "w") as handle:
            handle.write(text)
    return directory


HOST_LDCONFIG = "/sbin/ldconfig"


def ldconfig_skip_reason() -> str | None:
    """Why the host's ldconfig cannot run in a busybox rootfs, or None (Debian's is static-pie)."""
    if not os.path.isfile(HOST_LDCONFIG):
        return f"no {HOST_LDCONFIG} on this host"
    if not _is_static_elf(HOST_LDCONFIG):
        return f"{HOST_LDCONFIG} is dynamically linked: it cannot run in a busybox rootfs"
    return None


def add_ldconfig(directory: str) -> str:
    """The host's (static) ldconfig at ``<directory>/sbin/ldconfig``; returns ``directory``."""
    os.makedirs(os.path.join(directory, "sbin"), exist_ok=True)
    shutil.copy2(HOST_LDCONFIG, os.path.join(directory, "sbin", "ldconfig"))
    return directory


def make_device_nodes(directory: str, nodes: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """mknod each ``name -> (major, minor)`` as a character device (mode 0666); name -> path."""
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for name, (major, minor) in nodes.items():
        path = os.path.join(directory, name)
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(path, 0o666)
        paths[name] = path
    return paths


# -- cgroups the engines make -----------------------------------------------------------


def _kill_members(directory: str) -> None:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as handle:
            pids = [int(line) for line in handle if line.strip()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def remove_cgroup_trees(name: str) -> None:
    """Remove ``<hierarchy>/<name>`` and everything below it in every cgroup
    hierarchy (killing what is left inside: only the tests' containers)."""
    from isolators.simulated_node import remove_cgroup_tree

    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"refusing to remove cgroup tree {name!r}")
    for mount in _cgroup_mounts():
        remove_cgroup_tree(os.path.join(mount, name), evict=_kill_members, busy_timeout=5.0)


def _run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=dict(env) if env is not None else None)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, 9)
        except ProcessLookupError:
            pass
        out, err = process.communicate()
        raise AssertionError(f"{shlex.join(argv)} did not finish in {timeout} s\nstdout: {out}\nstderr: {err}")
    return subprocess.CompletedProcess(list(argv), process.returncode, out, err)


# -- podman ---------------------------------------------------------------------------

_NAMESPACE_SCRIPT = r"""
set -e
cdi=$1; upper=$2; work=$3; shift 3
mount -t tmpfs -o mode=0755 gpu-isolator-test-run /run
mkdir /run/cdi
mount --bind "$cdi" /run/cdi
mount -t tmpfs -o mode=1777 gpu-isolator-test-shm /dev/shm
if [ -d /etc/cdi ]; then mount -t tmpfs -o mode=0755,ro gpu-isolator-test-etc-cdi /etc/cdi; fi
mount -t overlay gpu-isolator-test-varlib -o "lowerdir=/var/lib,upperdir=$upper,workdir=$work" /var/lib
exec "$@"
"""

_CONTAINERS_CONF = """\
[containers]
netns = "none"
[engine]
cgroup_manager = "cgroupfs"
events_logger = "none"
runtime = "runc"
"""


class PodmanEngine:
    """podman with storage, configuration, CDI directory and cgroups of its own (see rules)."""

    def __init__(self, directory: str, cdi_dir: str, storage_driver: str = "vfs") -> None:
        self.directory = directory
        self.cdi_dir = cdi_dir
        self.storage_driver = storage_driver
        self.cgroup_parent = f"gpu-isolator-test-{uuid.uuid4().hex[:12]}"
        for sub in ("storage", "run", "tmp", "varlib-upper", "varlib-work"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)
        os.makedirs(cdi_dir, exist_ok=True)
        self.conf = os.path.join(directory, "containers.conf")
        with open(self.conf, "w") as handle:
            handle.write(_CONTAINERS_CONF)
        self.lines: list[str] = []
        """Every podman command line run, in order (for reports; global options left out)."""
        self.image: str | None = None
        """The last image ``import_rootfs`` made."""

    def _global(self, debug: bool = False) -> list[str]:
        options = [
            "podman", "--root", os.path.join(self.directory, "storage"),
            "--runroot", os.path.join(self.directory, "run"), "--tmpdir", os.path.join(self.directory, "tmp"),
            "--storage-driver", self.storage_driver, "--cgroup-manager", "cgroupfs", "--events-backend", "none",
        ]
        return options + (["--log-level=debug"] if debug else [])

    def _argv(self, args: Sequence[str], debug: bool = False, cdi_dir: str | None = None) -> list[str]:
        """``podman ARGS`` in this engine's namespace, storage and configuration (recorded in ``lines``)."""
        self.lines.append(shlex.join(["podman", *args]))
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _NAMESPACE_SCRIPT, "sh",
                cdi_dir or self.cdi_dir, os.path.join(self.directory, "varlib-upper"),
                os.path.join(self.directory, "varlib-work"), *self._global(debug), *args]

    def _call(self, args: Sequence[str], timeout: float, debug: bool = False,
              cdi_dir: str | None = None) -> subprocess.CompletedProcess:
        return _run(self._argv(args, debug, cdi_dir), timeout, dict(os.environ, CONTAINERS_CONF=self.conf))

    def import_rootfs(self, rootfs: str, reference: str, timeout: float = ENGINE_TIMEOUT, *,
                      default: bool = True) -> str:
        """``podman import`` a tar of ``rootfs`` as a local image; returns ``reference`` (``self.image``
        from now on unless ``default`` is false)."""
        tar = os.path.join(self.directory, "rootfs.tar")
        with tarfile.open(tar, "w") as archive:
            archive.add(rootfs, arcname=".")
        try:
            self.import_tar(tar, reference, timeout)
        finally:
            os.unlink(tar)
        if default:
            self.image = reference
        return reference

    def import_tar(self, tar: str, reference: str, timeout: float = ENGINE_TIMEOUT) -> str:
        """``podman import`` a root filesystem's tarball as the local image ``reference``."""
        result = self._call(["import", tar, reference], timeout)
        if result.returncode != 0:
            raise AssertionError(f"podman import failed ({result.returncode}): {result.stderr.strip()}")
        return reference

    def run_args(self, image: str, command: Sequence[str], *, devices: Iterable[str] = (),
                 volumes: Iterable[str] = (), name: str | None = None,
                 env: Mapping[str, str] | None = None, entrypoint: str | None = None,
                 options: Sequence[str] = ()) -> list[str]:
        """The ``podman run`` arguments (after the global options) for one container (``options``: more of
        ``podman run``'s own, e.g. ``--privileged``)."""
        args = ["run", "--rm", "--name", name or f"gpu-isolator-test-{uuid.uuid4().hex[:12]}",
                "--runtime", "runc", "--network", "none", "--cgroup-parent", "/" + self.cgroup_parent,
                "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        if entrypoint is not None:
            args += ["--entrypoint", entrypoint]
        for device in devices:
            args += ["--device", device]
        for volume in volumes:
            args += ["-v", volume]
        for key, value in (env or {}).items():
            args += ["--env", f"{key}={value}"]
        return args + list(options) + [image, *command]

    def run(self, image: str, command: Sequence[str], *, devices: Iterable[str] = (),
            volumes: Iterable[str] = (), cdi_dir: str | None = None, env: Mapping[str, str] | None = None,
            entrypoint: str | None = None, timeout: float = ENGINE_TIMEOUT) -> subprocess.CompletedProcess:
        """Run a container to completion, with ``cdi_dir`` (default: the
        engine's) as ``/var/run/cdi`` and ``env`` set by ``--env`` (as a user
        starts it); a failure is retried with debug logs to say why."""
        devices, volumes = list(devices), list(volumes)
        args = self.run_args(image, command, devices=devices, volumes=volumes, env=env, entrypoint=entrypoint)
        result = self._call(args, timeout, cdi_dir=cdi_dir)
        if result.returncode != 0:
            debug = self._call(self.run_args(image, command, devices=devices, volumes=volumes, env=env,
                                             entrypoint=entrypoint), timeout, True, cdi_dir=cdi_dir)
            reasons = [line for line in debug.stderr.splitlines() if "CDI" in line or "cdi" in line]
            result.stderr += "\n--- with --log-level=debug, CDI lines:\n" + "\n".join(reasons[-20:])
        return result

    def build(self, context: str, tag: str, build_args: Mapping[str, str] | None = None,
              timeout: float = ENGINE_TIMEOUT) -> subprocess.CompletedProcess:
        """``podman build`` of ``context`` (its ``Containerfile``) as ``tag``, with no network, the
        rlimits and the cgroup parent of this engine's containers (its ``RUN`` steps are containers)."""
        args = ["build", "--layers=false", "--network", "none", "--runtime", "runc",
                "--cgroup-parent", "/" + self.cgroup_parent,
                "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--tag", tag]
        for key, value in (build_args or {}).items():
            args += ["--build-arg", f"{key}={value}"]
        return self._call([*args, context], timeout)

    def inspect_image(self, reference: str, timeout: float = ENGINE_TIMEOUT) -> dict:
        """``podman image inspect`` of one image (its config, labels, size)."""
        result = self._call(["image", "inspect", reference], timeout)
        if result.returncode != 0:
            raise AssertionError(f"podman image inspect {reference} failed: {result.stderr.strip()}")
        [image] = msgspec.json.decode(result.stdout)
        return image

    def popen(self, args: Sequence[str], **options: object) -> subprocess.Popen:
        """One podman command (``run_args`` for a container) as a process that keeps running, in this
        engine's namespace, storage and configuration; the caller waits for it (bounded) and ends it."""
        return subprocess.Popen(self._argv(args), env=dict(os.environ, CONTAINERS_CONF=self.conf),
                                **options)  # type: ignore[call-overload]

    def close(self, timeout: float = ENGINE_TIMEOUT) -> None:
        """Remove every container and image this engine made, its storage and cgroups."""
        try:
            self._call(["rm", "--all", "--force"], timeout)
            self._call(["rmi", "--all", "--force"], timeout)
        finally:
            remove_cgroup_trees(self.cgroup_parent)
            shutil.rmtree(self.directory, ignore_errors=True)


# -- runc -----------------------------------------------------------------------------


class RuncEngine:
    """runc with state and cgroups of its own; bundles from ``runc spec`` + a fragment."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.state = os.path.join(directory, "state")
        os.makedirs(self.state, exist_ok=True)
        self.cgroup_parent = f"gpu-isolator-test-{uuid.uuid4().hex[:12]}"
        self.containers: list[RuncContainer] = []
        self.configs: list[dict] = []
        """Every merged config.json run, in order (for reports)."""

    def _bundle(self, bundle: str, rootfs: str, fragment: dict, command: Sequence[str], cgroup: str,
                annotations: Mapping[str, str], binds: Mapping[str, str] | None, timeout: float) -> dict:
        """Make ``bundle``: ``runc spec``'s config with the rootfs, command, cgroup, binds and fragment."""
        os.makedirs(bundle)
        made = _run(["runc", "spec", "--bundle", bundle], timeout)
        if made.returncode != 0:
            raise AssertionError(f"runc spec failed: {made.stderr.strip()}")
        config_path = os.path.join(bundle, "config.json")
        with open(config_path, "rb") as handle:
            config = msgspec.json.decode(handle.read())
        config["root"] = {"path": os.path.abspath(rootfs), "readonly": True}
        config["process"]["terminal"] = False
        config["process"]["args"] = list(command)
        if annotations:
            config["annotations"] = dict(annotations)
        config.setdefault("linux", {})["cgroupsPath"] = f"/{self.cgroup_parent}/{cgroup}"
        for destination, source in (binds or {}).items():
            config["mounts"].append({"destination": destination, "type": "bind", "source": source,
                                     "options": ["rbind", "ro"]})
        config = merge_oci(config, fragment)
        with open(config_path, "wb") as handle:
            handle.write(msgspec.json.encode(config))
        return config

    def run(self, rootfs: str, fragment: dict, command: Sequence[str], *,
            binds: Mapping[str, str] | None = None, timeout: float = ENGINE_TIMEOUT) -> subprocess.CompletedProcess:
        """Run ``command`` in a bundle of ``rootfs`` with ``fragment`` merged into
        the ``runc spec`` config; ``binds``: container path -> host dir, read-only."""
        name = f"gpu-isolator-test-{uuid.uuid4().hex[:12]}"
        bundle = os.path.join(self.directory, name)
        self.configs.append(self._bundle(bundle, rootfs, fragment, command, name, {}, binds, timeout))
        try:
            return _run(["runc", "--root", self.state, "run", "--bundle", bundle, name], timeout)
        finally:
            _run(["runc", "--root", self.state, "delete", "--force", name], timeout)
            shutil.rmtree(bundle, ignore_errors=True)

    def start(self, rootfs: str, fragment: dict, command: Sequence[str], *, cgroup: str, name: str,
              annotations: Mapping[str, str] | None = None, binds: Mapping[str, str] | None = None,
              timeout: float = ENGINE_TIMEOUT) -> "RuncContainer":
        """Run ``command`` detached in ``<parent>/<cgroup>`` (see module rules)."""
        bundle = os.path.join(self.directory, "bundles", name)
        self._bundle(bundle, rootfs, fragment, command, cgroup.strip("/"), annotations or {}, binds, timeout)
        container = RuncContainer(self, name, bundle)
        self.containers.append(container)
        # runc -d hands its stdio to the container: files, not pipes a reader would wait on for ever.
        log_path = os.path.join(bundle, "runc.log")
        with open(log_path, "wb") as log:
            try:
                code = subprocess.run(["runc", "--root", self.state, "run", "-d", "--bundle", bundle, name],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                raise AssertionError(f"runc run -d {name} did not finish in {timeout} s") from None
        if code != 0:
            with open(log_path) as log:
                raise AssertionError(f"runc run -d {name} failed ({code}): {log.read().strip()}")
        return container

    def close(self) -> None:
        for container in self.containers:
            container.stop()
        remove_cgroup_trees(self.cgroup_parent)
        shutil.rmtree(self.directory, ignore_errors=True)


class RuncContainer:
    """A detached runc container (see module rules)."""

    def __init__(self, engine: RuncEngine, name: str, bundle: str) -> None:
        self.engine = engine
        self.name = name
        self.bundle = bundle
        self.stopped = False

    @property
    def pid(self) -> int:
        state = _run(["runc", "--root", self.engine.state, "state", self.name], ENGINE_TIMEOUT)
        if state.returncode != 0:
            raise AssertionError(f"runc state {self.name} failed: {state.stderr.strip()}")
        return int(msgspec.json.decode(state.stdout)["pid"])

    def exec(self, args: Sequence[str], timeout: float = ENGINE_TIMEOUT) -> subprocess.CompletedProcess:
        return _run(["runc", "--root", self.engine.state, "exec", self.name, *args], timeout)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            _run(["runc", "--root", self.engine.state, "delete", "--force", self.name], ENGINE_TIMEOUT)


def cdi_fragment(spec_file: str, names: Iterable[str]) -> dict:
    """The OCI fragment of CDI device ``names`` in ``spec_file`` (see module rules)."""
    with open(spec_file, "rb") as handle:
        spec = msgspec.json.decode(handle.read())
    by_name = {f"{spec['kind']}={device['name']}": device for device in spec["devices"]}
    edits = [by_name[name]["containerEdits"] for name in names]
    if edits:
        edits.append(spec.get("containerEdits") or {})
    nodes = {node["path"]: node for edit in edits for node in edit.get("deviceNodes", [])}
    devices, allowed = [], []
    for node in nodes.values():
        info = os.stat(node.get("hostPath", node["path"]))
        major, minor = node.get("major", os.major(info.st_rdev)), node.get("minor", os.minor(info.st_rdev))
        kind = node.get("type", "c")
        devices.append({"path": node["path"], "type": kind, "major": major, "minor": minor,
                        "fileMode": node.get("fileMode", 0o666), "uid": 0, "gid": 0})
        allowed.append({"allow": True, "type": kind, "major": major, "minor": minor,
                        "access": node.get("permissions", "rwm")})
    return {"linux": {"devices": devices, "resources": {"devices": allowed}}} if devices else {}
