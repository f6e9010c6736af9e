"""The device plugin's manifests under ``deploy/kubelet-plugin`` (SPEC 23, R-PR-9): valid against Kubernetes'
own schemas (``kubernetes-validate``, offline, strict: the docs tests' ``check_yaml``, which also parses its
``gpu-isolator`` command) and lightkube's typed models, and what pod repair needs:
the command's own options, host PID, a privileged container, and every path the plugin and its repair read or
write mounted from the host (the device plugin and CDI directories, /dev, the PodResources socket, the cgroup
hierarchies, each runtime state directory it reads records in by default, systemd's run directory and the system
bus)."""

from __future__ import annotations

import os
from pathlib import Path

from actors.ledger import DEFAULT_NODE_LEDGER
from isolators.cli import _parser
from isolators.kubernetes.pod_repair import DEFAULT_CONFIG_TEMPLATES, DEFAULT_POD_RESOURCES_SOCKET

from tests.support.docs import check_yaml
from tests.support.manifests import load_manifests

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubelet-plugin"


def test_every_manifest_validates_against_kubernetes_schemas_and_loads_into_typed_models() -> None:
    manifests = sorted(DEPLOY.glob("*.yaml"))
    assert [path.name for path in manifests] == ["daemonset.yaml"]
    check_yaml((DEPLOY / "daemonset.yaml").read_text(), "deploy/kubelet-plugin/daemonset.yaml", None)
    assert [type(o).__name__ for o in load_manifests(DEPLOY / "daemonset.yaml")] == ["DaemonSet"]


def test_the_daemonset_runs_the_plugin_with_pod_repairs_privileges_and_mounts() -> None:
    [daemonset] = load_manifests(DEPLOY / "daemonset.yaml")
    pod = daemonset.spec.template.spec
    [container] = pod.containers
    script, _, *command = container.args  # sh -c SCRIPT $0 OPTIONS...: the chart's options, one an argument
    assert 'exec gpu-isolator kubelet-plugin "$@"' in script
    args, extra = _parser().parse_known_args(["kubelet-plugin", *command])
    assert args.command == "kubelet-plugin" and args.repair_pods == "true"
    options = dict(option.lstrip("-").split("=", 1) for option in extra)
    assert "node_ledger" not in options
    assert pod.hostPID is True and container.securityContext.privileged is True
    mounted = {mount.mountPath: mount for mount in container.volumeMounts}
    volumes = {volume.name: volume for volume in pod.volumes}

    def host_path_of(path: str) -> str:
        """The host path mounted where the container sees ``path`` (the longest mount above it)."""
        above = [where for where in mounted if path == where or path.startswith(where.rstrip("/") + "/")]
        assert above, f"{path} is not mounted in the plugin's container"
        where = max(above, key=len)
        volume = volumes[mounted[where].name]
        assert volume.hostPath is not None, f"{path} is mounted from {volume.name}, not the host"
        return volume.hostPath.path + path[len(where):]

    needed = [args.device_plugin_dir, options["cdi_spec_dir"], options["dev_dir"],
              os.path.dirname(options["volume_dir"]), os.path.dirname(DEFAULT_POD_RESOURCES_SOCKET),
              options["cdi_hook"],  # the specs' hook: installed by the pod where the host's runtime runs it
              DEFAULT_NODE_LEDGER,  # shared with every front door of the node, found with no flag (R-NL-1)
              "/sys/fs/cgroup", "/run/systemd", "/run/dbus/system_bus_socket",
              *(template.split("{id}", 1)[0].rstrip("/") for template in DEFAULT_CONFIG_TEMPLATES)]
    for path in needed:
        assert host_path_of(path) == path  # the host's own path, where the plugin looks for it
    assert f'HOOK_FILE)\')" {options["cdi_hook"]} &&' in script
    for path in ("/sys/fs/cgroup", options["dev_dir"], args.device_plugin_dir):
        assert not mounted[path].readOnly, f"pod repair writes {path}"
    for template in DEFAULT_CONFIG_TEMPLATES:  # the runtimes' records: read only
        where = max((w for w in mounted if template.startswith(w.rstrip("/") + "/")), key=len)
        assert mounted[where].readOnly, where
