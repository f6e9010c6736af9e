"""The generated modules of every kubelet API the Kubernetes front doors speak (SPEC sections 18, 20, 21):
current (one regeneration command), and the kubelet's wire names and field numbers."""

from __future__ import annotations

import pytest

from isolators.kubernetes._api import (DRA_VERSIONS, HEALTH_VERSIONS, dra_v1, dra_v1beta1, health, health_v1alpha1,
                                       pb, pods_pb, pods_rpc, registration)
from isolators.kubernetes._proto.generate import GENERATED, SOURCE_ROOT, generate


def test_regenerating_the_modules_changes_nothing(tmp_path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the modules")
    written = generate(tmp_path)
    assert len(written) == 21  # seven .proto files, three modules each
    for name, path in zip(GENERATED, written):
        assert path.read_bytes() == (SOURCE_ROOT / name).read_bytes(), (
            f"{name} is stale: run 'python -m isolators.kubernetes._proto.generate' and commit it")


def test_the_services_and_fields_are_the_kubelets() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert [m.full_name for m in services["Registration"].methods] == ["v1beta1.Registration.Register"]
    plugin = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
              for m in services["DevicePlugin"].methods}
    assert plugin == {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }
    numbers = {name: {f.name: f.number for f in message.fields}
               for name, message in pb.DESCRIPTOR.message_types_by_name.items()}
    assert numbers["RegisterRequest"] == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert numbers["Device"] == {"ID": 1, "health": 2, "topology": 3}
    assert numbers["ContainerPreferredAllocationRequest"] == {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert numbers["ContainerAllocateResponse"] == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4,
                                                    "cdi_devices": 5}
    assert numbers["DeviceSpec"] == {"container_path": 1, "host_path": 2, "permissions": 3}
    assert numbers["DevicePluginOptions"] == {"pre_start_required": 1, "get_preferred_allocation_available": 2}


def test_the_pod_resources_api_is_the_kubelets() -> None:
    assert pods_pb.DESCRIPTOR.package == "v1"
    lister = pods_pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in lister.methods} == {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse"),
        "GetAllocatableResources": ("AllocatableResourcesRequest", "AllocatableResourcesResponse"),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse"),
    }
    numbers = {name: {f.name: f.number for f in message.fields}
               for name, message in pods_pb.DESCRIPTOR.message_types_by_name.items()}
    assert numbers["ListPodResourcesResponse"] == {"pod_resources": 1}
    assert numbers["PodResources"] == {"name": 1, "namespace": 2, "containers": 3}
    assert numbers["ContainerResources"] == {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4,
                                             "dynamic_resources": 5}
    assert numbers["ContainerDevices"] == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert numbers["DynamicResource"] == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}
    assert "'/v1.PodResourcesLister/List'" in open(pods_rpc.__file__).read()  # the wire name the stub dials


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
