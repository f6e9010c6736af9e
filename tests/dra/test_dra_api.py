"""The generated DRA modules (SPEC section 21): current, and the kubelet's wire names and field numbers."""

from __future__ import annotations

import pytest

from isolators.dra._api import DRA_VERSIONS, HEALTH_VERSIONS, dra_v1, dra_v1beta1, health, health_v1alpha1, registration
from isolators.dra._proto.generate import GENERATED, SOURCE_ROOT, generate


def test_regenerating_the_modules_changes_nothing(tmp_path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the modules")
    written = generate(tmp_path)
    assert len(written) == 15
    for name, path in zip(GENERATED, written):
        assert path.read_bytes() == (SOURCE_ROOT / name).read_bytes(), (
            f"{name} is stale: run 'python -m isolators.dra._proto.generate' and commit it")


def fields(module, message: str) -> dict[str, int]:
    return {f.name: f.number for f in module.DESCRIPTOR.message_types_by_name[message].fields}


def test_plugin_registration_is_the_kubelets_plugin_watcher_api() -> None:
    assert registration.DESCRIPTOR.package == "pluginregistration"
    methods = registration.DESCRIPTOR.services_by_name["Registration"].methods
    assert [m.full_name for m in methods] == ["pluginregistration.Registration.GetInfo",
                                              "pluginregistration.Registration.NotifyRegistrationStatus"]
    assert fields(registration, "PluginInfo") == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert fields(registration, "RegistrationStatus") == {"plugin_registered": 1, "error": 2}


@pytest.mark.parametrize("module, package", [(dra_v1, "k8s.io.kubelet.pkg.apis.dra.v1"),
                                             (dra_v1beta1, "k8s.io.kubelet.pkg.apis.dra.v1beta1")])
def test_both_dra_packages_carry_the_kubelets_names(module, package: str) -> None:
    assert module.DESCRIPTOR.package == package
    methods = {m.full_name: (m.input_type.name, m.output_type.name)
               for m in module.DESCRIPTOR.services_by_name["DRAPlugin"].methods}
    assert methods == {
        f"{package}.DRAPlugin.NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        f"{package}.DRAPlugin.NodeUnprepareResources": ("NodeUnprepareResourcesRequest",
                                                        "NodeUnprepareResourcesResponse"),
    }
    assert fields(module, "Claim") == {"namespace": 1, "uid": 2, "name": 3}
    assert fields(module, "NodePrepareResourceResponse") == {"devices": 1, "error": 2}
    assert fields(module, "NodeUnprepareResourceResponse") == {"error": 1}
    device = {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
    if module is dra_v1:
        device["share_id"] = 5  # v1 only
    assert fields(module, "Device") == device


@pytest.mark.parametrize("module, package", [(health, "v1"), (health_v1alpha1, "v1alpha1")])
def test_health_is_dra_resource_health_streaming_the_whole_list(module, package: str) -> None:
    assert module.DESCRIPTOR.package == package
    [method] = module.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods
    assert (method.full_name, method.server_streaming) == (f"{package}.DRAResourceHealth.NodeWatchResources", True)
    assert fields(module, "DeviceHealth") == {"device": 1, "health": 2, "last_updated_time": 3,
                                              "health_check_timeout_seconds": 4, "message": 5}
    assert fields(module, "DeviceIdentifier") == {"pool_name": 1, "device_name": 2}
    assert dict(module.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    assert sorted(DRA_VERSIONS) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert sorted(HEALTH_VERSIONS) == ["v1", "v1alpha1"]
