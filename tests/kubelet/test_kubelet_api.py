"""The generated deviceplugin v1beta1 and podresources v1 modules (SPEC sections 18, 20): current, and the
kubelet's wire names."""

from __future__ import annotations

import pytest

from isolators.kubelet._api import pb, pods_pb, pods_rpc
from isolators.kubelet._proto.generate import GENERATED, SOURCE_ROOT, generate


def test_regenerating_the_modules_changes_nothing(tmp_path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the modules")
    written = generate(tmp_path)
    for name, path in zip(GENERATED, written):
        assert path.read_bytes() == (SOURCE_ROOT / name).read_bytes(), (
            f"{name} is stale: run 'python -m isolators.kubelet._proto.generate' and commit it")


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
