"""The manifests under ``deploy/dra`` load into lightkube's typed models and
agree with the driver: RBAC covers what it asks of the API server, the
admission policy lets it write only its own node's slices (its CEL run on
the slices the driver writes), the DaemonSet's options are the command's
and its host paths are mounted, the DeviceClass and the claim template
select and match attributes it publishes. (tests/docs validates every
manifest under deploy/ against Kubernetes' schemas.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.ledger import DEFAULT_NODE_LEDGER
from isolators.cli import _parser
from isolators.kubernetes.dra import DEFAULT_DRIVER_NAME

from tests.support.dra_kubelet import catalog_of
from tests.support.manifests import load_manifests

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "dra"


def load(name: str) -> list:
    return load_manifests(DEPLOY / name)


def test_every_manifest_loads_into_typed_models() -> None:
    kinds = {name: [type(o).__module__.rsplit(".", 1)[-1] + "." + type(o).__name__ for o in load(name)]
             for name in sorted(p.name for p in DEPLOY.glob("*.yaml"))}
    assert kinds == {
        "admission-policy.yaml": ["admissionregistration_v1.ValidatingAdmissionPolicy",
                                  "admissionregistration_v1.ValidatingAdmissionPolicyBinding"],
        "daemonset.yaml": ["apps_v1.DaemonSet"],
        "deviceclass-share.yaml": ["resource_v1.DeviceClass"],
        "deviceclass-nvidia-gpu.yaml": ["resource_v1.DeviceClass"],
        "deviceclass.yaml": ["resource_v1.DeviceClass"],
        "gpu-share.yaml": ["resource_v1.ResourceClaimTemplate", "core_v1.Pod"],
        "rbac.yaml": ["core_v1.ServiceAccount", "rbac_authorization_v1.ClusterRole",
                      "rbac_authorization_v1.ClusterRoleBinding"],
        "two-gpus-one-island.yaml": ["resource_v1.ResourceClaimTemplate", "core_v1.Pod"],
    }


def test_rbac_grants_what_the_driver_asks_of_the_api_server() -> None:
    account, role, binding = load("rbac.yaml")
    verbs = {resource: set(rule.verbs) for rule in role.rules for resource in rule.resources
             if rule.apiGroups == ["resource.k8s.io"]}
    assert verbs["resourceslices"] >= {"list", "watch", "create", "update", "delete"}  # SlicePublisher's requests
    # DraPluginProcess reads claims, and lists them to rebuild an unreadable checkpoint (R-SH-3); nothing more
    assert verbs["resourceclaims"] == {"get", "list"}
    assert (binding.roleRef.name, binding.subjects[0].name) == (role.metadata.name, account.metadata.name)


def test_the_daemonset_runs_the_command_with_its_options_and_mounts_its_paths() -> None:
    [daemonset] = load("daemonset.yaml")
    pod = daemonset.spec.template.spec
    [container] = pod.containers
    script, _, *options = container.args
    assert 'exec gpu-isolator dra-plugin "$@"' in script
    args = _parser().parse_known_args(["dra-plugin", *options])[0]
    assert args.driver_name == DEFAULT_DRIVER_NAME
    assert [e.valueFrom.fieldRef.fieldPath for e in container.env if e.name == "NODE_NAME"] == ["spec.nodeName"]
    extra = dict(option.lstrip("-").split("=", 1) for option in options if option.split("=")[0].lstrip("-")
                 in ("cdi_spec_dir", "work_dir", "dev_dir"))
    mounted = {m.mountPath for m in container.volumeMounts}
    for path in (args.plugins_registry_dir, args.plugins_dir, *extra.values()):
        assert path in mounted, path
    # the node ledger: the host's, where every front door of the node finds it with no flag (SPEC R-NL-1)
    ledger = next(m for m in container.volumeMounts if m.mountPath == DEFAULT_NODE_LEDGER)
    assert next(v for v in pod.volumes if v.name == ledger.name).hostPath.path == DEFAULT_NODE_LEDGER
    assert not any(option.startswith("--node_ledger") for option in options)
    assert pod.serviceAccountName == "gpu-isolator-dra-plugin"
    hook = next(option.split("=", 1)[1] for option in options if option.startswith("--cdi_hook="))
    assert f'HOOK_FILE)\')" {hook} &&' in script  # the pod installs the hook file ...
    assert hook.rsplit("/", 1)[0] in mounted  # ... on a host path: the runtime runs it on the host


def test_the_claim_template_asks_two_gpus_on_one_nvlink_island_of_this_driver() -> None:
    [device_class] = load("deviceclass.yaml")
    template, pod = load("two-gpus-one-island.yaml")
    assert device_class.metadata.name == DEFAULT_DRIVER_NAME
    expression = device_class.spec.selectors[0].cel.expression
    assert f'device.driver == "{DEFAULT_DRIVER_NAME}"' in expression and '.type == "gpu"' in expression
    [request] = template.spec.spec.devices.requests
    assert (request.exactly.deviceClassName, request.exactly.count) == (DEFAULT_DRIVER_NAME, 2)
    [constraint] = template.spec.spec.devices.constraints
    assert constraint.matchAttribute == f"{DEFAULT_DRIVER_NAME}/nvlinkIsland"  # an attribute the slice carries
    assert pod.spec.resourceClaims[0].resourceClaimTemplateName == template.metadata.name
    assert pod.spec.containers[0].resources.claims[0].name == pod.spec.resourceClaims[0].name


def test_pods_asking_nvidia_com_gpu_are_served_whole_gpus_of_this_driver() -> None:
    """R-NL-6: the DeviceClass of the migration (KEP-5004's ``extendedResourceName``) selects what the
    driver's own class selects: whole GPUs of this driver."""
    [device_class] = load("deviceclass.yaml")
    [extended] = load("deviceclass-nvidia-gpu.yaml")
    assert extended.spec.extendedResourceName == "nvidia.com/gpu"
    assert extended.metadata.name != device_class.metadata.name
    assert extended.spec.selectors == device_class.spec.selectors


def _selects(expression: str, document: dict) -> list[str]:
    """The devices of a slice a DeviceClass's CEL selects, evaluated as the scheduler does (``device.driver``,
    attributes and capacity by domain; cel-python evaluates the CEL)."""
    import celpy

    environment = celpy.Environment()
    program = environment.program(environment.compile(expression))
    driver = document["spec"]["driver"]
    chosen = []
    for device in document["spec"]["devices"]:
        attributes = {name: next(iter(value.values())) for name, value in device.get("attributes", {}).items()}
        capacity = {name: entry["value"] for name, entry in device.get("capacity", {}).items()}
        activation = {"device": celpy.json_to_cel({"driver": driver, "attributes": {driver: attributes},
                                                   "capacity": {driver: capacity}})}
        if program.evaluate(activation):
            chosen.append(device["name"])
    return chosen


def test_the_share_class_selects_the_shares_a_sharing_driver_publishes_and_its_template_is_allocated() -> None:
    """SPEC R-MP-5: the DeviceClass for a share selects every device of a --sharing=mps slice and none of a
    slice without sharing; the claim template's capacity.requests is allocated by the scheduler's rules."""
    from isolators.kubernetes.dra import render_slice
    from tests.support.kube_api import FakeApiServer

    [share_class] = load("deviceclass-share.yaml")
    template, pod = load("gpu-share.yaml")
    expression = share_class.spec.selectors[0].cel.expression
    host = Path(__file__).resolve().parents[2] / "inventory" / "data" / "dgx8-nvlink.toml"
    shared = render_slice(catalog_of(host, "mps"), driver=DEFAULT_DRIVER_NAME, node="n1", generation=1,
                          unhealthy={}).to_dict()
    whole = render_slice(catalog_of(host), driver=DEFAULT_DRIVER_NAME, node="n1", generation=1, unhealthy={}).to_dict()
    assert _selects(expression, shared) == [f"gpu-{minor}" for minor in range(8)]
    assert _selects(expression, whole) == []
    [request] = template.spec.spec.devices.requests
    assert request.exactly.deviceClassName == share_class.metadata.name
    api = FakeApiServer()
    api.resource_slices["n1"] = shared
    claim = api.allocate("default", "inference-share", driver=DEFAULT_DRIVER_NAME, node="n1",
                         requests=request.exactly.capacity.requests, request=request.name)
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "10Gi", "compute": "30"}
    assert pod.spec.resourceClaims[0].resourceClaimTemplateName == template.metadata.name
    assert pod.spec.containers[0].resources.claims[0].name == pod.spec.resourceClaims[0].name


@pytest.mark.parametrize("attribute", ["nvlinkIsland", "type"])
def test_the_attributes_the_manifests_use_are_published(attribute: str) -> None:
    published = catalog_of(Path(__file__).resolve().parents[2] / "inventory" / "data" / "dgx8-nvlink.toml")
    assert all(attribute in device.attributes for device in published.devices)


def test_the_docs_show_every_manifest_as_it_is() -> None:
    """The DRA guide shows each manifest by including the file itself, so
    what a reader copies is what this test and the docs' schema check load."""
    import re

    guide = DEPLOY.parents[1] / "docs" / "guides" / "dra.md"
    included = set(re.findall(r"```\{literalinclude\} \.\./\.\./deploy/dra/(\S+)\n", guide.read_text()))
    assert included == {manifest.name for manifest in DEPLOY.glob("*.yaml")}


class AdmissionPolicy:
    """``deploy/dra/admission-policy.yaml`` evaluated as the API server does: its match conditions, then its
    variables in order, then its validations (cel-python evaluates the CEL)."""

    def __init__(self) -> None:
        import celpy
        import yaml

        self.celpy = celpy
        policy, self.binding = yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text())
        self.policy = policy
        spec = policy["spec"]
        environment = celpy.Environment()
        self.compiled = {expression: environment.program(environment.compile(expression)) for expression in
                         [c["expression"] for c in spec["matchConditions"]] + [v["expression"] for v in spec["variables"]]
                         + [v["expression"] for v in spec["validations"]]
                         + [v["messageExpression"] for v in spec["validations"] if "messageExpression" in v]}

    def _eval(self, expression: str, activation: dict) -> Any:
        value = self.compiled[expression].evaluate(activation)
        if isinstance(value, Exception):
            raise AssertionError(f"{expression!r} failed: {value}")
        return value

    def review(self, operation: str, user: str, node: str | None, new: dict | None, old: dict | None) -> str | None:
        """None when the policy does not apply or allows; else the denial's message."""
        spec = self.policy["spec"]
        rule = spec["matchConstraints"]["resourceRules"][0]
        assert operation in rule["operations"] and rule["resources"] == ["resourceslices"]
        extra = {"authentication.kubernetes.io/node-name": [node]} if node is not None else None
        info: dict = {"username": user, **({"extra": extra} if extra else {})}
        request = {"operation": operation, "userInfo": info}
        activation = {"request": self.celpy.json_to_cel(request), "object": self.celpy.json_to_cel(new),
                      "oldObject": self.celpy.json_to_cel(old)}
        if not all(self._eval(c["expression"], activation) for c in spec["matchConditions"]):
            return None
        variables: dict = {}
        for variable in spec["variables"]:
            activation["variables"] = self.celpy.json_to_cel(variables)
            variables[variable["name"]] = str(self._eval(variable["expression"], activation))
        activation["variables"] = self.celpy.json_to_cel(variables)
        for validation in spec["validations"]:
            if not self._eval(validation["expression"], activation):
                if "messageExpression" in validation:
                    return str(self._eval(validation["messageExpression"], activation))
                return " ".join(validation["message"].split())
        return None


def test_the_admission_policy_lets_the_driver_write_only_its_own_nodes_slices() -> None:
    """R-DR-4, on the slice the driver writes (``render_slice``: ``spec.nodeName`` the node)."""
    from isolators.kubernetes.dra import render_slice

    policy = AdmissionPolicy()
    account, _, _ = load("rbac.yaml")
    driver = f"system:serviceaccount:{account.metadata.namespace}:{account.metadata.name}"
    assert policy.binding["spec"] == {"policyName": policy.policy["metadata"]["name"], "validationActions": ["Deny"]}
    catalog = catalog_of(Path(__file__).resolve().parents[2] / "inventory" / "data" / "dgx8-nvlink.toml")

    def written(node: str) -> dict:
        return render_slice(catalog, driver=DEFAULT_DRIVER_NAME, node=node, generation=1, unhealthy={}).to_dict()

    own, other = written("node-a"), written("node-b")
    cluster_wide = {**own, "spec": {k: v for k, v in own["spec"].items() if k != "nodeName"} | {"allNodes": True}}
    denied = "gpu-isolator-dra-plugin on node node-a may write only that node's ResourceSlices, not"
    assert policy.review("CREATE", driver, "node-a", own, None) is None
    assert policy.review("UPDATE", driver, "node-a", own, own) is None
    assert policy.review("DELETE", driver, "node-a", None, own) is None  # a stale slice of its own node
    assert policy.review("CREATE", driver, "node-a", other, None) == f"{denied} one of node node-b"
    assert policy.review("UPDATE", driver, "node-a", other, other) == f"{denied} one of node node-b"
    assert policy.review("DELETE", driver, "node-a", None, other) == f"{denied} one of node node-b"
    assert policy.review("UPDATE", driver, "node-a", own, other) is not None  # moving another node's slice here
    assert policy.review("CREATE", driver, "node-a", cluster_wide, None) == f"{denied} a slice of no node"
    assert policy.review("CREATE", driver, None, own, None) == (
        "gpu-isolator-dra-plugin's token names no node: it must run in a pod on a node (projected service account"
        " tokens carry the node's name from Kubernetes 1.32 on)")
    assert policy.review("DELETE", "system:serviceaccount:kube-system:other", None, None, other) is None  # not ours


def test_every_write_rbac_grants_on_slices_is_one_the_policy_judges() -> None:
    _, role, _ = load("rbac.yaml")
    policy = AdmissionPolicy().policy
    verbs = {verb for rule in role.rules if "resourceslices" in rule.resources for verb in rule.verbs}
    writes = verbs - {"get", "list", "watch"}
    operation = {"create": "CREATE", "update": "UPDATE", "patch": "UPDATE", "delete": "DELETE",
                 "deletecollection": "DELETE"}
    judged = set(policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"])
    assert writes and {operation[verb] for verb in writes} <= judged
