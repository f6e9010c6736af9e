"""The manifests under ``deploy/dra`` load into lightkube's typed models and
agree with the driver: RBAC covers what it asks of the API server, the
DaemonSet's options are the command's and its host paths are mounted, the
DeviceClass and the claim template select and match attributes it publishes."""

from __future__ import annotations

from pathlib import Path

import pytest

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
        "daemonset.yaml": ["apps_v1.DaemonSet"],
        "deviceclass.yaml": ["resource_v1.DeviceClass"],
        "rbac.yaml": ["core_v1.ServiceAccount", "rbac_authorization_v1.ClusterRole",
                      "rbac_authorization_v1.ClusterRoleBinding"],
        "two-gpus-one-island.yaml": ["resource_v1.ResourceClaimTemplate", "core_v1.Pod"],
    }


def test_rbac_grants_what_the_driver_asks_of_the_api_server() -> None:
    account, role, binding = load("rbac.yaml")
    verbs = {resource: set(rule.verbs) for rule in role.rules for resource in rule.resources
             if rule.apiGroups == ["resource.k8s.io"]}
    assert verbs["resourceslices"] >= {"list", "create", "update", "delete"}  # SlicePublisher's requests
    assert verbs["resourceclaims"] == {"get"}  # DraPluginProcess reads claims, nothing more
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
    assert pod.serviceAccountName == "gpu-isolator-dra-plugin"


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
