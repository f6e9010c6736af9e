"""The Helm chart ``deploy/helm/gpu-isolator`` (SPEC R-SH-2), rendered by the real ``helm``: ``helm lint --strict``
passes; the defaults and every example of ``deploy/helm/examples`` render objects valid against Kubernetes' own
schemas (``kubernetes-validate``, strict, with each pod's ``gpu-isolator`` command parsed by the CLI's parser: the
docs tests' ``check_kubernetes``); the ServiceMonitor, a CRD those schemas lack, is checked field by field and
against the Service and pods it must find; deploy/'s static manifests are what the chart renders for the matching
example (one source of truth); the values reach the command as the options it has; bad values are refused naming
the value; the DaemonSets roll one node at a time, give a front door time for its clean SIGTERM stop (SPEC section 24:
within 10 s) and keep their selectors across values and chart versions (a selector is immutable)."""

from __future__ import annotations

import argparse
import base64
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.ledger import DEFAULT_NODE_LEDGER
from isolators.cli import _parser
from isolators.service import service_flags

from tests.support.docs import REPO, check_kubernetes
from tests.support.helm import (CHART, EXAMPLES, HELM, HELM_LABELS, MISSING_HELM, HelmError, Rendered, render,
                                static_manifests, strip_helm_labels)

needs_helm = pytest.mark.skipif(HELM is None, reason=MISSING_HELM)

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
STOP_BOUND_S = 10  # SPEC section 24: a front door exits within 10 s of SIGTERM
WORKLOADS = {"deploy/dra/two-gpus-one-island.yaml", "deploy/dra/gpu-share.yaml"}
"""deploy/'s manifests that are not the chart's: a user's workload (a claim template and a pod), shown as an example."""


def objects(documents: list[Rendered], kind: str | None = None) -> list[dict[str, Any]]:
    return [d.object for d in documents if kind is None or d.object["kind"] == kind]


def daemonset(documents: list[Rendered], component: str) -> dict[str, Any]:
    [found] = [o for o in objects(documents, "DaemonSet") if o["metadata"]["name"] == f"gpu-isolator-{component}"]
    return found


def command_of(daemon_set: dict[str, Any]) -> tuple[str, argparse.Namespace, list[str]]:
    """The container's script, its parsed command and the options the parser left to the isolator's flags."""
    [container] = daemon_set["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    script, _, *options = container["args"]
    command = re.search(r'exec gpu-isolator (\S+) "\$@"$', script.strip())
    assert command, script
    args, extra = _parser().parse_known_args([command.group(1), *options])
    return script, args, extra



def test_the_charts_version_and_app_version_are_the_packages() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert chart["apiVersion"] == "v2"
    assert (chart["version"], chart["appVersion"]) == (version, version)


@needs_helm
@pytest.mark.parametrize("values", [None, *(p.name for p in EXAMPLE_FILES)])
def test_helm_lint_strict_passes(values: str | None) -> None:
    command = [HELM, "lint", "--strict", str(CHART), *(["-f", str(EXAMPLES / values)] if values else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


SERVICE_MONITOR_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "metadata": {"name", "namespace", "labels", "annotations"},
    "spec": {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"},
    "endpoint": {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                 "relabelings", "metricRelabelings", "bearerTokenSecret", "authorization", "tlsConfig"},
}
"""The fields of monitoring.coreos.com/v1 ServiceMonitor (Prometheus Operator's CRD) this check knows."""


def check_service_monitor(monitor: dict[str, Any], documents: list[Rendered]) -> None:
    """A ServiceMonitor is a CRD Kubernetes' schemas lack: its fields are checked here by name and type, and what
    it selects is followed to the end: a headless Service of its namespace, whose named port is a container port of
    the pods the Service selects."""
    where = f"ServiceMonitor {monitor['metadata'].get('name')}"
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1", where
    assert set(monitor) <= SERVICE_MONITOR_FIELDS[""], where
    assert set(monitor["metadata"]) <= SERVICE_MONITOR_FIELDS["metadata"], where
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_FIELDS["spec"] and spec["endpoints"], where
    assert set(spec["selector"]) == {"matchLabels"} and all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    assert spec["namespaceSelector"] == {"matchNames": [monitor["metadata"]["namespace"]]}, where
    services = [s for s in objects(documents, "Service")
                if s["metadata"]["namespace"] == monitor["metadata"]["namespace"]
                and spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert len(services) == 1, f"{where} selects {len(services)} Services"
    [service] = services
    assert service["spec"]["clusterIP"] == "None"  # every pod is a target, not one behind a virtual IP
    pods = [d["spec"]["template"] for d in objects(documents, "DaemonSet")
            if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(pods) == 1, f"Service {service['metadata']['name']} selects the pods of {len(pods)} DaemonSets"
    [container] = pods[0]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_FIELDS["endpoint"], endpoint
        assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", endpoint.get("interval", "30s")), endpoint
        [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port["port"] == container_ports[port["targetPort"]]
        assert endpoint.get("path", "/metrics") == "/metrics"
        listen = [o for o in container["args"] if o.startswith("--listen=")]
        assert listen == [f"--listen=0.0.0.0:{port['port']}"]


VALUE_SETS = {
    "defaults": ((), ()),
    **{f"examples/{path.name}": ((path,), ()) for path in EXAMPLE_FILES},
    "everything": ((EXAMPLES / "migration.yaml",),
                   ("metrics.serviceMonitor.enabled=true", "dra.migStrategy=mixed", "dra.deviceClasses.mig=true",
                    "devicePlugin.migStrategy=mixed", "imagePullSecrets[0].name=registry",
                    "resources.limits.memory=512Mi", "podAnnotations.team=gpus")),
}


@needs_helm
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_what_the_chart_renders_is_valid_kubernetes(name: str) -> None:
    files, sets = VALUE_SETS[name]
    documents = render(*files, set_values=sets)
    assert documents
    for document in documents:
        if document.object["kind"] == "ServiceMonitor":
            check_service_monitor(document.object, documents)
        else:
            check_kubernetes(document.object, f"{name}: {document.template}")


EXAMPLE_KINDS = {
    "device-plugin.yaml": {"Secret", "DaemonSet kubelet-plugin"},
    "mig-mixed.yaml": {"Secret", "DaemonSet kubelet-plugin"},
    "time-slicing.yaml": {"Secret", "DaemonSet kubelet-plugin"},
    "dra.yaml": {"Secret", "DaemonSet dra-plugin", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                 "DeviceClass gpu.isolator.dev", "DeviceClass nvidia-gpu.gpu.isolator.dev",
                 "DeviceClass share.gpu.isolator.dev",
                 "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"},
}
EXAMPLE_KINDS["migration.yaml"] = (EXAMPLE_KINDS["dra.yaml"] - {"DeviceClass share.gpu.isolator.dev"}) | {
    "DaemonSet kubelet-plugin"}


@needs_helm
@pytest.mark.parametrize("example", [p.name for p in EXAMPLE_FILES])
def test_each_example_runs_the_front_doors_it_is_about(example: str) -> None:
    documents = render(EXAMPLES / example)
    kinds = set()
    for o in objects(documents):
        name = o["metadata"]["name"]
        kinds.add({"DaemonSet": f"DaemonSet {name.removeprefix('gpu-isolator-')}",
                   "DeviceClass": f"DeviceClass {name}"}.get(o["kind"], o["kind"]))
    assert kinds == EXAMPLE_KINDS[example]
    for o in objects(documents, "DaemonSet"):
        _, args, extra = command_of(o)
        flags = service_flags(None, extra)
        if example == "time-slicing.yaml":
            assert args.time_slicing_replicas == 4
        if example == "mig-mixed.yaml":
            assert flags.nvidia_mig_strategy == "mixed"
        assert flags.node_ledger is None  # the default, found with no flag by every front door (R-NL-1)


@needs_helm
def test_deploys_static_manifests_are_what_the_chart_renders_for_their_example() -> None:
    """One source of truth: each file is the chart's output, helm's own labels aside (``python -m
    tests.support.helm`` writes them)."""
    made = static_manifests()
    shipped = {p.relative_to(REPO).as_posix() for p in (REPO / "deploy").rglob("*.yaml")
               if "helm" not in p.relative_to(REPO / "deploy").parts}
    assert {p.relative_to(REPO).as_posix() for p in made} == shipped - WORKLOADS
    for path, text in made.items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is not what the chart renders: run python -m" \
                                         " tests.support.helm"
    # The same, object by object: the file's objects are helm's, less exactly helm's labels.
    for folder, example in (("kubelet-plugin", "device-plugin.yaml"), ("dra", "dra.yaml")):
        documents = render(EXAMPLES / example)
        for path in sorted((REPO / "deploy" / folder).glob("*.yaml")):
            if path.relative_to(REPO).as_posix() in WORKLOADS:
                continue
            rendered = [d.object for d in documents if d.template == f"templates/{folder}/{path.name}"]
            assert [o for o in yaml.safe_load_all(path.read_text()) if o] == [strip_helm_labels(o) for o in rendered]
            for o in rendered:
                assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
                assert set(o["metadata"]["labels"]) - set(strip_helm_labels(o)["metadata"]["labels"]) == set(HELM_LABELS)
        # What the example renders that deploy/ does not ship: the credential's Secret alone (random, made at
        # install; the static DaemonSets' comment says how to create it).
        left = [o for d, o in zip(documents, objects(documents))
                if not d.template.startswith(f"templates/{folder}/")]
        assert [(o["kind"], o["metadata"]["name"]) for o in left] == [("Secret", "gpu-isolator-credential")]


@needs_helm
def test_the_credential_is_made_once_or_taken_from_an_existing_secret() -> None:
    [secret] = objects(render(), "Secret")
    assert len(base64.b64decode(secret["data"]["credential"])) == 64
    plugin = daemonset(render(), "kubelet-plugin")
    [volume] = [v for v in plugin["spec"]["template"]["spec"]["volumes"] if v["name"] == "credential"]
    assert volume["secret"] == {"secretName": secret["metadata"]["name"], "defaultMode": 0o600}
    [mount] = [m for m in plugin["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
               if m["name"] == "credential"]
    assert mount["subPath"] == "credential"  # a regular file, as --credential requires (a secret's entries are links)
    _, args, _ = command_of(plugin)
    assert args.credential == mount["mountPath"]
    existing = render(set_values=("credential.create=false", "credential.secretName=mine"))
    assert objects(existing, "Secret") == []
    assert {"secretName": "mine", "defaultMode": 0o600} in [
        v.get("secret") for v in daemonset(existing, "kubelet-plugin")["spec"]["template"]["spec"]["volumes"]]
    bare = render(set_values=("metrics.enabled=false", "credential.enabled=false"))
    _, args, _ = command_of(daemonset(bare, "kubelet-plugin"))
    assert (args.listen, args.credential) == (None, None) and objects(bare, "Secret") == []


@needs_helm
def test_the_values_reach_the_device_plugin_as_its_own_options() -> None:
    documents = render(set_values=(
        "devicePlugin.timeSlicingReplicas=3", "devicePlugin.migStrategy=single", "devicePlugin.podRepair.enabled=false",
        "devicePlugin.podRepair.interval=7", "devicePlugin.extraArgs[0]=--pass_device_specs",
        "devicePlugin.extraArgs[1]=--kubepods_root=kubepods", "nodeLedger.hostPath=/var/run/node-ledger",
        "metrics.port=9500", "image.repository=registry.example/gpu-isolator", "image.tag=test",
        "hostDriver.libraryDir=/usr/lib64"))
    plugin = daemonset(documents, "kubelet-plugin")
    pod = plugin["spec"]["template"]["spec"]
    script, args, extra = command_of(plugin)
    flags = service_flags(None, extra)
    assert (args.time_slicing_replicas, args.repair_pods, args.repair_interval) == (3, "false", 7.0)
    assert args.pass_device_specs and args.kubepods_root == "kubepods" and args.listen == "0.0.0.0:9500"
    assert (flags.nvidia_mig_strategy, flags.node_ledger) == ("single", "/var/run/node-ledger")
    assert pod["containers"][0]["image"] == "registry.example/gpu-isolator:test"
    assert pod["containers"][0]["ports"] == [{"name": "metrics", "containerPort": 9500}]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/var/run/node-ledger"]]["hostPath"]["path"] == "/var/run/node-ledger"  # the same path
    assert volumes[mounts["/host/driver"]]["hostPath"]["path"] == "/usr/lib64"
    # Pod repair off: no host PID, none of its mounts; the PodResources socket stays (the pass returns GPUs).
    assert "hostPID" not in pod
    assert not {"/sys/fs/cgroup", "/run/systemd", "/run/dbus", "/run/containerd"} & set(mounts)
    assert "/var/lib/kubelet/pod-resources" in mounts
    check_kubernetes(plugin, "values set")
    # Defaults: pod repair on, with its host PID and mounts; no --node_ledger (the default path, R-NL-1).
    default = daemonset(render(), "kubelet-plugin")
    _, args, extra = command_of(default)
    assert args.repair_pods == "true" and default["spec"]["template"]["spec"]["hostPID"] is True
    assert service_flags(None, extra).node_ledger is None
    assert {"/sys/fs/cgroup", "/run/systemd", "/run/dbus", DEFAULT_NODE_LEDGER} <= {
        m["mountPath"] for m in default["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert default["spec"]["template"]["spec"]["automountServiceAccountToken"] is False  # it asks no API server


@needs_helm
def test_the_values_reach_the_dra_driver_and_its_objects() -> None:
    documents = render(EXAMPLES / "dra.yaml", set_values=(
        "dra.driverName=gpus.example.com", "dra.migStrategy=mixed", "dra.deviceClasses.mig=true",
        "dra.extraArgs[0]=--api_timeout=20", "serviceAccount.name=driver", "metrics.draPort=9600"))
    driver = daemonset(documents, "dra-plugin")
    _, args, extra = command_of(driver)
    assert (args.driver_name, args.api_timeout, args.listen) == ("gpus.example.com", 20.0, "0.0.0.0:9600")
    assert service_flags(None, extra).nvidia_mig_strategy == "mixed"
    assert driver["spec"]["template"]["spec"]["serviceAccountName"] == "driver"
    classes = {o["metadata"]["name"]: o["spec"] for o in objects(documents, "DeviceClass")}
    assert set(classes) == {"gpus.example.com", "mig.gpus.example.com", "nvidia-gpu.gpus.example.com",
                            "share.gpus.example.com"}
    assert classes["share.gpus.example.com"]["selectors"][0]["cel"]["expression"] == (
        'device.driver == "gpus.example.com" && "compute" in device.capacity["gpus.example.com"]')
    for name, kind in (("gpus.example.com", "gpu"), ("mig.gpus.example.com", "mig")):
        expression = classes[name]["selectors"][0]["cel"]["expression"]
        assert 'device.driver == "gpus.example.com"' in expression and f'.type == "{kind}"' in expression
    assert classes["nvidia-gpu.gpus.example.com"]["extendedResourceName"] == "nvidia.com/gpu"
    [account] = objects(documents, "ServiceAccount")
    [binding] = objects(documents, "ClusterRoleBinding")
    [policy] = objects(documents, "ValidatingAdmissionPolicy")
    assert account["metadata"]["name"] == binding["subjects"][0]["name"] == "driver"
    assert policy["spec"]["matchConditions"][0]["expression"] == \
        'request.userInfo.username == "system:serviceaccount:kube-system:driver"'
    off = render(EXAMPLES / "dra.yaml", set_values=("dra.admissionPolicy.enabled=false",
                                                   "dra.deviceClasses.extendedResource=false",
                                                   "dra.deviceClasses.share=false"))
    assert objects(off, "ValidatingAdmissionPolicy") == []
    assert [o["metadata"]["name"] for o in objects(off, "DeviceClass")] == ["gpu.isolator.dev"]


@needs_helm
def test_mps_sharing_values_reach_both_front_doors() -> None:
    """SPEC R-MP-4, R-MP-5: devicePlugin.mpsReplicas is --mps_replicas, dra.sharing is --sharing; their
    defaults pass neither, and the schema refuses what the commands would."""
    documents = render(EXAMPLES / "migration.yaml", set_values=("devicePlugin.mpsReplicas=3", "dra.sharing=mps",
                                                                "dra.mpsReplicas=4"))
    _, plugin_args, _ = command_of(daemonset(documents, "kubelet-plugin"))
    _, driver_args, _ = command_of(daemonset(documents, "dra-plugin"))
    assert (plugin_args.mps_replicas, driver_args.sharing, driver_args.mps_replicas) == (3, "mps", 4)
    with pytest.raises(HelmError, match="dra.mpsReplicas needs dra.sharing mps"):
        render(EXAMPLES / "migration.yaml", set_values=("dra.mpsReplicas=2",))
    # The daemons outlive the plugins' containers (R-MP-1): started in the host's cgroup gpu-isolator-mps,
    # so both pods run with hostPID and the host's /sys/fs/cgroup.
    assert plugin_args.mps_cgroup == driver_args.mps_cgroup == "gpu-isolator-mps"
    assert plugin_args.mps_control is None and driver_args.mps_control is None
    for component in ("kubelet-plugin", "dra-plugin"):
        pod = daemonset(documents, component)["spec"]["template"]["spec"]
        assert pod["hostPID"] is True
        assert {"name": "cgroup", "hostPath": {"path": "/sys/fs/cgroup"}} in pod["volumes"]
        assert {"name": "cgroup", "mountPath": "/sys/fs/cgroup"} in pod["containers"][0]["volumeMounts"]
    own = render(EXAMPLES / "migration.yaml", set_values=(
        "devicePlugin.mpsReplicas=2", "devicePlugin.podRepair.enabled=false", "dra.sharing=mps", "mps.cgroup=none",
        "mps.control=/opt/mps/nvidia-cuda-mps-control"))
    for component in ("kubelet-plugin", "dra-plugin"):
        _, args, _ = command_of(daemonset(own, component))
        assert (args.mps_cgroup, args.mps_control) == ("none", "/opt/mps/nvidia-cuda-mps-control")
        pod = daemonset(own, component)["spec"]["template"]["spec"]
        assert "hostPID" not in pod and "cgroup" not in {v["name"] for v in pod["volumes"]}
    plain = render(EXAMPLES / "migration.yaml")
    assert (command_of(daemonset(plain, "kubelet-plugin"))[1].mps_replicas,
            command_of(daemonset(plain, "dra-plugin"))[1].sharing) == (1, "none")
    assert "hostPID" not in daemonset(plain, "dra-plugin")["spec"]["template"]["spec"]
    for bad in ("devicePlugin.mpsReplicas=0", "dra.sharing=time-slicing", "dra.mpsReplicas=0", "mps.cgroup=../escape",
                "mps.control=relative/nvidia-cuda-mps-control"):
        with pytest.raises(HelmError, match="/".join(bad.split("=")[0].split("."))):
            render(EXAMPLES / "migration.yaml", set_values=(bad,))


@needs_helm
def test_the_device_plugin_keeps_off_nodes_labeled_off_within_the_values_affinity() -> None:
    off = {"key": "gpu.isolator.dev/device-plugin", "operator": "NotIn", "values": ["off"]}
    [term] = daemonset(render(), "kubelet-plugin")["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == {"matchExpressions": [off]}
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    documents = render(set_values=(
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=In",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values[0]=a",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1].matchFields[0].key=metadata.name",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1].matchFields[0].operator=In",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[1].matchFields[0].values[0]=n1",
        "dra.enabled=true"))
    terms = daemonset(documents, "kubelet-plugin")["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Terms are ORed: each keeps its own conditions and gains the label's.
    assert terms == [{"matchExpressions": [zone, off]},
                     {"matchExpressions": [off], "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
    driver_terms = daemonset(documents, "dra-plugin")["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert off not in driver_terms[0]["matchExpressions"]  # the DRA driver is what such a node moved to
    assert "affinity" not in daemonset(render(set_values=("devicePlugin.offLabel=",)), "kubelet-plugin")["spec"][
        "template"]["spec"]


@needs_helm
def test_the_daemonsets_roll_one_node_at_a_time_and_wait_for_a_clean_stop() -> None:
    for o in objects(render(EXAMPLES / "migration.yaml"), "DaemonSet"):
        assert o["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
        pod = o["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > STOP_BOUND_S
        assert pod["priorityClassName"] == "system-node-critical"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        script, _, _ = command_of(o)
        assert re.search(r'exec gpu-isolator \S+ "\$@"$', script.strip())  # SIGTERM reaches the front door itself


@needs_helm
def test_upgrades_keep_every_daemonsets_selector(tmp_path: Path) -> None:
    """A DaemonSet's selector is immutable: it is the same at any values and in the next chart version, and holds
    no version."""
    def selectors(documents: list[Rendered]) -> dict[str, Any]:
        return {o["metadata"]["name"]: o["spec"]["selector"] for o in objects(documents, "DaemonSet")}

    before = selectors(render(EXAMPLES / "migration.yaml"))
    other_values = selectors(render(EXAMPLES / "migration.yaml", set_values=(
        "image.tag=0.2.0", "devicePlugin.migStrategy=mixed", "devicePlugin.podRepair.enabled=false",
        "metrics.enabled=false", "credential.enabled=false", "nodeLedger.hostPath=/var/run/ledger",
        "updateStrategy.rollingUpdate.maxUnavailable=10%", "podAnnotations.a=b")))
    next_chart = tmp_path / "gpu-isolator"
    shutil.copytree(CHART, next_chart)
    chart_yaml = next_chart / "Chart.yaml"
    chart_yaml.write_text(re.sub(r'(?m)^(version: |appVersion: ")0\.1\.0', r"\g<1>9.9.9", chart_yaml.read_text()))
    assert yaml.safe_load(chart_yaml.read_text())["version"] == "9.9.9"
    upgraded_documents = render(EXAMPLES / "migration.yaml", chart=next_chart)
    assert daemonset(upgraded_documents, "dra-plugin")["spec"]["template"]["metadata"]["labels"][
        "app.kubernetes.io/version"] == "9.9.9"  # the pods' labels follow the version; the selector does not
    assert before == other_values == selectors(upgraded_documents)
    assert set(before) == {"gpu-isolator-kubelet-plugin", "gpu-isolator-dra-plugin"}
    assert before["gpu-isolator-kubelet-plugin"] == {"matchLabels": {"app": "gpu-isolator-kubelet-plugin"}}
    assert "0.1.0" not in str(before)


@needs_helm
@pytest.mark.parametrize("values, refusal", [
    (("devicePlugin.resourceName=amd.com/gpu",), "at '/devicePlugin/resourceName': value must be 'nvidia.com/gpu'"),
    (("updateStrategy.rollingUpdate.maxSurge=1",), "at '/updateStrategy/rollingUpdate/maxSurge'"),
    (("devicePlugin.extraArgs[0]=pass_device_specs",), "at '/devicePlugin/extraArgs/0'"),
    (("devicePlugin.timeSlicingReplicas=0",), "at '/devicePlugin/timeSlicingReplicas'"),
    (("terminationGracePeriodSeconds=5",), "at '/terminationGracePeriodSeconds'"),
    (("dra.driverName=Bad_Name",), "at '/dra/driverName'"),
    (("nodeLedger.hostPath=ledger",), "at '/nodeLedger/hostPath'"),
    (("devicePlugn.enabled=true",), "additional properties 'devicePlugn' not allowed"),
    (("metrics.enabled=false",), "credential.enabled needs metrics.enabled"),
    (("dra.enabled=true", "dra.deviceClasses.mig=true"), "dra.deviceClasses.mig needs dra.migStrategy single or mixed"),
])
def test_bad_values_are_refused_naming_the_value(values: tuple[str, ...], refusal: str) -> None:
    with pytest.raises(HelmError) as error:
        render(set_values=values)
    assert refusal in str(error.value)


@needs_helm
def test_the_dra_driver_is_refused_on_a_cluster_without_resource_k8s_io_v1() -> None:
    with pytest.raises(HelmError, match=r"dra.enabled needs Kubernetes >= 1.34 \(resource.k8s.io/v1\); this cluster"
                                        r" is v1.33.0: use the device plugin"):
        render(EXAMPLES / "dra.yaml", kube_version="1.33.0")
    assert objects(render(EXAMPLES / "device-plugin.yaml", kube_version="1.33.0"), "DaemonSet")
