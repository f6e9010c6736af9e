"""The CDI spec's rules (R-CD-2): names, kinds, paths, permissions, versions,
and the documents the engines read (JSON, YAML).

A spec the engines refuse is a bug of ours, so every rule the reference
parser (tags.cncf.io/container-device-interface) enforces is checked here,
with the message that names the offending value.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import yaml

from isolators import ContainerID
from isolators.cdi import CONTAINER_KIND, CdiContainerEdits, CdiDevice, CdiDeviceNode, CdiHook, CdiMount
from isolators.cdi import CdiSpec, CdiSpecError, container_device_name, container_qualified_name
from isolators.cdi import container_spec_file_name, decode_spec, encode_spec, required_version
from isolators.cdi import validate_device_name, validate_kind, validate_spec

NODE = CdiDeviceNode(path="/dev/nvidia0", type="c", major=195, minor=0, permissions="rwm")


def spec(*, version: str = "0.3.0", kind: str = "vendor.com/gpu", name: str = "gpu0",
         edits: CdiContainerEdits | None = None, shared: CdiContainerEdits | None = None,
         devices: list[CdiDevice] | None = None) -> CdiSpec:
    if devices is None:
        devices = [CdiDevice(name=name, container_edits=edits or CdiContainerEdits(device_nodes=[NODE]))]
    return CdiSpec(cdi_version=version, kind=kind, devices=devices, container_edits=shared)


# -- kinds ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nvidia.com/gpu", "gpu-isolator/container", "a.b-c.d/x_y-Z9", "vendor.com/G"])
def test_valid_kinds(kind: str) -> None:
    assert validate_kind(kind) == tuple(kind.split("/"))


@pytest.mark.parametrize("kind, needle", [
    ("nvidia.com", "expected 'vendor/class'"),
    ("vendor.com/gpu/x", "expected 'vendor/class'"),
    ("/gpu", "must be a DNS subdomain"),
    ("Vendor.com/gpu", "must be a DNS subdomain"),
    ("ven_dor.com/gpu", "must be a DNS subdomain"),
    ("1vendor.com/gpu", "starting with a letter"),
    ("vendor-.com/gpu", "must be a DNS subdomain"),
    ("vendor..com/gpu", "must be a DNS subdomain"),
    ("vendor.com/", "the class ''"),
    ("vendor.com/9gpu", "must start with a letter"),
    ("vendor.com/gpu-", "end with a letter or digit"),
    ("vendor.com/g pu", "hold only letters"),
    ("vendor.com/gpu.x", "needs CDI 0.6.0"),
    ("vendor.com/" + "g" * 64, "at most 63 characters"),
])
def test_invalid_kinds_are_refused_with_the_reason(kind: str, needle: str) -> None:
    with pytest.raises(CdiSpecError, match="Invalid CDI kind") as caught:
        validate_kind(kind)
    assert needle in str(caught.value)
    assert repr(kind) in str(caught.value)


# -- device names -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["0", "all", "GPU-d9a1c0de-0000-4b6e-9c1a-5e1f0a000000", "a", "a.b:c_d-e", "Z9"])
def test_valid_device_names(name: str) -> None:
    assert validate_device_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a-", "_a", "a_", ".a", "a/b", "a b", "a=b", "é", "a@b", ":a"])
def test_invalid_device_names(name: str) -> None:
    with pytest.raises(CdiSpecError, match=f"Invalid CDI device name {name!r}"):
        validate_device_name(name)


def test_container_names_are_the_id_when_valid_else_a_hash_that_cannot_collide() -> None:
    assert container_device_name(ContainerID("c1")) == "c1"
    assert container_device_name(ContainerID("4b1c7f2a-90de")) == "4b1c7f2a-90de"
    # nested containers share their top-level container's device
    assert container_device_name(ContainerID("child", ContainerID("c1"))) == "c1"
    for odd in ("-leading", "_x", "x_", "a@b", "a+b", "naïve", "x" * 181, "a:"):
        name = container_device_name(ContainerID(odd))
        assert name.startswith("id.") and len(name) == 35, (odd, name)
        validate_device_name(name)
        assert name == container_device_name(ContainerID(odd))  # stable
    # a '.' is never in an id, so a plain id never looks like a hashed one
    with pytest.raises(ValueError):
        ContainerID("id.0123")
    assert container_device_name(ContainerID("x" * 180)) == "x" * 180
    assert len({container_device_name(ContainerID(v)) for v in ("a@b", "a@c", "b@a")}) == 3


def test_file_and_qualified_names() -> None:
    assert container_spec_file_name(ContainerID("c1")) == "gpu-isolator-container_c1.json"
    assert container_qualified_name(ContainerID("c1")) == f"{CONTAINER_KIND}=c1"
    longest = container_spec_file_name(ContainerID("x" * 242))
    assert len(longest) < 80
    assert len(container_spec_file_name(ContainerID("x" * 180)).encode()) + 30 < 255  # with its temporary


def test_a_forged_id_never_becomes_a_name() -> None:
    forged = ContainerID("ok")
    msgspec.structs.force_setattr(forged, "value", "../../etc")
    with pytest.raises(ValueError, match="Invalid container id"):
        container_spec_file_name(forged)
    with pytest.raises(ValueError, match="expected a ContainerID"):
        container_device_name("c1")  # type: ignore[arg-type]


# -- versions -------------------------------------------------------------------------------

def test_lowest_version_the_fields_need() -> None:
    assert required_version(spec()) == "0.3.0"
    mount = CdiMount(host_path="/v", container_path="/usr/local/nvidia", options=["rbind", "ro"])
    assert required_version(spec(edits=CdiContainerEdits(mounts=[mount]))) == "0.3.0"
    typed = CdiMount(host_path="/v", container_path="/v", type="bind")
    assert required_version(spec(edits=CdiContainerEdits(mounts=[typed]))) == "0.4.0"
    hosted = msgspec.structs.replace(NODE, host_path="/tmp/dev/nvidia0")
    assert required_version(spec(edits=CdiContainerEdits(device_nodes=[hosted]))) == "0.5.0"
    assert required_version(spec(shared=CdiContainerEdits(device_nodes=[hosted]))) == "0.5.0"
    assert required_version(spec(name="0")) == "0.5.0"
    assert required_version(spec(name="all")) == "0.3.0"


def test_a_declared_version_must_be_known_and_high_enough() -> None:
    validate_spec(spec(version="0.5.0"))
    with pytest.raises(CdiSpecError, match="cdiVersion 0.3.0 is below 0.5.0, which its fields need"):
        validate_spec(spec(name="0"))
    for version in ("0.6.0", "0.2.0", "1.0", "v0.5.0"):
        with pytest.raises(CdiSpecError, match=f"cdiVersion '{version}'; this writes 0.3.0, 0.4.0, 0.5.0"):
            validate_spec(spec(version=version))


# -- devices, edits, paths, permissions -------------------------------------------------------------

def test_spec_structure_rules() -> None:
    with pytest.raises(CdiSpecError, match="it has no devices"):
        validate_spec(spec(devices=[]))
    with pytest.raises(CdiSpecError, match="device 'gpu0' appears twice"):
        validate_spec(spec(devices=[CdiDevice(name="gpu0", container_edits=CdiContainerEdits(env=["A=1"]))] * 2))
    with pytest.raises(CdiSpecError, match="device 'gpu0' has no edits"):
        validate_spec(spec(edits=CdiContainerEdits()))
    with pytest.raises(CdiSpecError, match="Invalid CDI device name 'bad name'"):
        validate_spec(spec(name="bad name"))


@pytest.mark.parametrize("node, needle", [
    (CdiDeviceNode(path="dev/nvidia0"), "device node path 'dev/nvidia0' must be an absolute path"),
    (CdiDeviceNode(path="/dev/../etc/x"), "must not contain NUL or '..' components"),
    (CdiDeviceNode(path="/dev/nv\x00"), "must not contain NUL"),
    (CdiDeviceNode(path="/dev/nvidia0", host_path="nvidia0"), "hostPath of device node '/dev/nvidia0'"),
    (CdiDeviceNode(path="/dev/nvidia0", type="x"), "has type 'x'; expected one of c, b, u, p"),
    (CdiDeviceNode(path="/dev/nvidia0", type="c", major=-1, minor=0), "negative major -1"),
    (CdiDeviceNode(path="/dev/nvidia0", type="c", major=195, minor=-1), "negative minor -1"),
    (CdiDeviceNode(path="/dev/nvidia0", permissions="rwx"), "permissions 'rwx'"),
    (CdiDeviceNode(path="/dev/nvidia0", permissions="rr"), "permissions 'rr'"),
    (CdiDeviceNode(path="/dev/nvidia0", permissions=""), "permissions ''"),
    (CdiDeviceNode(path="/dev/nvidia0", file_mode=0o10000), "fileMode 4096"),
])
def test_device_node_rules(node: CdiDeviceNode, needle: str) -> None:
    with pytest.raises(CdiSpecError) as caught:
        validate_spec(spec(version="0.5.0", edits=CdiContainerEdits(device_nodes=[node])))
    assert needle in str(caught.value)


def test_permissions_that_are_fine() -> None:
    for permissions in ("r", "rw", "rwm", "mwr", "m"):
        node = CdiDeviceNode(path="/dev/nvidia0", permissions=permissions)
        validate_spec(spec(edits=CdiContainerEdits(device_nodes=[node])))


@pytest.mark.parametrize("edits, needle", [
    (CdiContainerEdits(env=["NOVALUE"]), "env entry 'NOVALUE' must be 'KEY=VALUE'"),
    (CdiContainerEdits(env=["=x"]), "env entry '=x'"),
    (CdiContainerEdits(device_nodes=[NODE, NODE]), "lists device node '/dev/nvidia0' twice"),
    (CdiContainerEdits(mounts=[CdiMount(host_path="v", container_path="/v")]), "mount hostPath 'v'"),
    (CdiContainerEdits(mounts=[CdiMount(host_path="/v", container_path="v")]), "mount containerPath 'v'"),
    (CdiContainerEdits(mounts=[CdiMount(host_path="/v", container_path="/v", options=[""])]), "has option ''"),
    (CdiContainerEdits(hooks=[CdiHook(hook_name="prestop", path="/bin/x")]), "hook name 'prestop'"),
    (CdiContainerEdits(hooks=[CdiHook(hook_name="prestart", path="x")]), "prestart hook path 'x'"),
    (CdiContainerEdits(hooks=[CdiHook(hook_name="poststop", path="/x", timeout=0)]), "timeout 0"),
    (CdiContainerEdits(hooks=[CdiHook(hook_name="poststop", path="/x", env=["X"])]), "poststop hook env entry"),
])
def test_edit_rules(edits: CdiContainerEdits, needle: str) -> None:
    with pytest.raises(CdiSpecError) as caught:
        validate_spec(spec(edits=edits))
    assert needle in str(caught.value)
    with pytest.raises(CdiSpecError) as shared:  # the same rules for the shared edits
        validate_spec(spec(shared=edits))
    assert needle in str(shared.value)


# -- documents ---------------------------------------------------------------------------------

def full_spec() -> CdiSpec:
    hosted = msgspec.structs.replace(NODE, host_path="/tmp/dev/nvidia0", file_mode=0o666)
    return spec(version="0.5.0", name="0", edits=CdiContainerEdits(
        env=["NVIDIA_VISIBLE_DEVICES=GPU-1"], device_nodes=[hosted],
        mounts=[CdiMount(host_path="/v", container_path="/usr/local/nvidia", options=["rbind", "ro"])],
        hooks=[CdiHook(hook_name="createContainer", path="/bin/true", args=["true"], timeout=5)]))


def test_json_document_uses_the_spec_names_and_only_what_is_set() -> None:
    document = json.loads(encode_spec(full_spec(), "json"))
    assert document == {
        "cdiVersion": "0.5.0", "kind": "vendor.com/gpu",
        "devices": [{"name": "0", "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=GPU-1"],
            "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/tmp/dev/nvidia0", "type": "c", "major": 195,
                             "minor": 0, "fileMode": 438, "permissions": "rwm"}],
            "mounts": [{"hostPath": "/v", "containerPath": "/usr/local/nvidia", "options": ["rbind", "ro"]}],
            "hooks": [{"hookName": "createContainer", "path": "/bin/true", "args": ["true"], "timeout": 5}],
        }}],
    }


def test_yaml_and_json_carry_the_same_document_and_round_trip() -> None:
    original = full_spec()
    as_json, as_yaml = encode_spec(original, "json"), encode_spec(original, "yaml")
    assert yaml.safe_load(as_yaml) == json.loads(as_json)
    assert decode_spec(as_json, "json") == original
    assert decode_spec(as_yaml, "yaml") == original
    assert as_json.endswith(b"\n")


def test_an_invalid_spec_is_never_encoded() -> None:
    with pytest.raises(CdiSpecError, match="has no edits"):
        encode_spec(spec(edits=CdiContainerEdits()))


@pytest.mark.parametrize("data, needle", [
    (b"{", "is not a valid JSON CDI document"),
    (b'{"cdiVersion": "0.5.0", "kind": "a.com/b", "devices": [], "annotations": {"x": "y"}}', "annotations"),
    (b'{"cdiVersion": "0.3.0", "kind": "a.com/b", "devices": []}', "it has no devices"),
])
def test_decoding_refuses_with_the_source_named(data: bytes, needle: str) -> None:
    with pytest.raises(CdiSpecError) as caught:
        decode_spec(data, "json", "'/x/y.json'")
    assert "'/x/y.json'" in str(caught.value) and needle in str(caught.value)
