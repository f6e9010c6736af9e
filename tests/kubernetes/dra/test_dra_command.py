"""``gpu-isolator dra-plugin``'s options: bad ones exit 2 with one line; other commands load no gRPC or client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from isolators.cli import main

from tests.support.services import ROOT

DGX8 = Path(__file__).resolve().parents[2] / "inventory" / "data" / "dgx8-nvlink.toml"


@pytest.mark.parametrize("args, error", [
    ([], "gpu-isolator dra-plugin: error: no node name: pass --node_name=NAME or set NODE_NAME"),
    (["--node_name=n", "--driver_name=GPU_Driver"], "--driver_name: Invalid driver name 'GPU_Driver': expected a DNS"
                                                    " subdomain of at most 63 characters"),
    (["--node_name=Node_1"], "--node_name: Invalid node name 'Node_1': expected a DNS subdomain of at most 253"
                              " characters"),
    (["--node_name=" + "n" * 254], "--node_name: Invalid node name"),
    (["--node_name=n", "--credential=/x"], "--credential needs --listen HOST:PORT"),
    (["--node_name=n", "--api_timeout=0"], "--api_timeout must be > 0, got 0.0"),
    (["--node_name=n", "--sharing=time-slicing"], "gpu-isolator dra-plugin: error: --sharing takes none or mps, got"
                                                  " 'time-slicing'"),
])
def test_bad_options_exit_2_naming_them(args: list[str], error: str, capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["dra-plugin", *args]) == 2
    assert error in capsys.readouterr().err


def test_a_malformed_kubeconfig_exits_2_with_the_reason_and_serves_nothing(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("clusters: [\n")
    registry = tmp_path / "registry"
    done = subprocess.run([sys.executable, "-m", "isolators", "dra-plugin", "--node_name=n",
                           f"--kubeconfig={kubeconfig}", f"--host_file={DGX8}", f"--plugins_registry_dir={registry}",
                           f"--plugins_dir={tmp_path}/plugins", f"--work_dir={tmp_path}/work"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"gpu-isolator: error: Cannot use the kubeconfig '{kubeconfig}': not a valid kubeconfig (ParserError:")
    assert done.stdout == "" and not registry.exists()


def test_other_commands_load_neither_grpc_nor_the_kubernetes_client() -> None:
    code = ("import sys; from isolators.cli import _parser; _parser();"
            " print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'lightkube', 'httpx2', 'google')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_a_malformed_checkpoint_with_the_api_server_down_stops_the_start_naming_both_and_stays(tmp_path: Path) -> None:
    """SPEC R-SH-3: an unreadable checkpoint is rebuilt from the ResourceClaims (tests/upgrades); with no API
    server to rebuild from, the file stays where it is (a missing one would read as "nothing prepared")."""
    from tests.support.kube_api import FakeApiServer

    checkpoint = tmp_path / "work" / "dra" / "gpu.isolator.dev" / "prepared-claims.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text('{"version": 1, "claims": [{"ref": 3}]}')
    api = FakeApiServer().start()
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    api.close()  # down
    done = subprocess.run([sys.executable, "-m", "isolators", "dra-plugin", "--node_name=n",
                           f"--kubeconfig={kubeconfig}", f"--host_file={DGX8}", "--api_timeout=2",
                           f"--plugins_registry_dir={tmp_path}/registry", f"--plugins_dir={tmp_path}/plugins",
                           f"--work_dir={tmp_path}/work", f"--volume_dir={tmp_path}/volume",
                           f"--cdi_spec_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert (f"gpu-isolator: error: The prepared-claims checkpoint {checkpoint}: it does not hold what format version 1"
            " holds (Expected `object`, got `int`") in done.stderr
    assert ("its claims cannot be rebuilt from the API server (cannot list the ResourceClaims: the API server"
            f" ({api.address}) could not be reached: ConnectError") in done.stderr
    assert "3 tries): the file is left in place and the next start tries again" in done.stderr
    assert checkpoint.read_text() == '{"version": 1, "claims": [{"ref": 3}]}'
    assert [p.name for p in checkpoint.parent.iterdir()] == ["prepared-claims.json"]
    assert not (tmp_path / "registry").exists()  # nothing served


def test_the_pinned_options_are_there_with_their_documented_defaults(capsys: pytest.CaptureFixture) -> None:
    assert main(["dra-plugin", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--driver_name NAME", "--plugins_registry_dir DIR", "--plugins_dir DIR", "--node_name NAME",
                   "--kubeconfig FILE", "--listen HOST:PORT", "--credential FILE", "--flags FILE"):
        assert option in text, option
    for default in ("default gpu.isolator.dev", "default /var/lib/kubelet/plugins_registry",
                    "default /var/lib/kubelet/plugins)", "default $NODE_NAME", "in-cluster"):
        assert default in text, default


def test_a_checkpointed_claim_on_a_device_gone_stays_prepared_until_unprepared(tmp_path: Path) -> None:
    from tests.support.dra_kubelet import DraPluginCommand, FakeDraKubelet
    from tests.support.kube_api import FakeApiServer
    from tests.support.kubelet import plugin_directory

    uid = "0c9e4b7a-8d21-4f55-b7a3-2b1d6c0e9f10"
    ids = [f"gpu.isolator.dev/claim={uid}-gpu-9"]
    checkpoint = tmp_path / "work" / "dra" / "gpu.isolator.dev" / "prepared-claims.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text(json.dumps({"version": 1, "claims": [{"ref": {"namespace": "ns", "name": "old", "uid": uid},
                                      "devices": [{"request": "r", "pool": "n", "device": "gpu-9",
                                                   "cdi_device_ids": ids}]}]}))
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / f"gpu.isolator.dev-claim_{uid}.json").write_text("{}")  # its spec, from before
    api = FakeApiServer().start()
    with plugin_directory() as sockets:
        plugin = DraPluginCommand([
            "--node_name=n", f"--kubeconfig={api.kubeconfig(tmp_path / 'kubeconfig')}", f"--host_file={DGX8}",
            f"--plugins_registry_dir={sockets}/registry", f"--plugins_dir={sockets}/plugins",
            f"--work_dir={tmp_path}/work", f"--volume_dir={tmp_path}/volume", f"--cdi_spec_dir={cdi}"], tmp_path)
        kubelet = FakeDraKubelet(sockets / "registry")
        try:
            plugin.start()
            assert (f"Prepared claim ns/old (uid {uid}) holds gpu-9, which this node no longer publishes: its spec is"
                    " left as it is until the kubelet unprepares it") in plugin.log()
            kubelet.register()
            answer = kubelet.prepare([("ns", "old", uid)])[uid]
            assert [d["cdi_device_ids"] for d in answer["devices"]] == [ids]
            assert os.listdir(cdi) == [f"gpu.isolator.dev-claim_{uid}.json"]
            assert kubelet.unprepare([("ns", "old", uid)]) == {uid: {}}
            assert os.listdir(cdi) == []
        finally:
            kubelet.close()
            plugin.close()
            api.close()


def test_a_node_with_a_253_character_name_gets_its_slice_under_a_valid_name(tmp_path: Path) -> None:
    """R-DR-5: ``<node>-<driver>`` would be 270 characters, which the API server refuses (422); the driver
    publishes under a shortened name that is still a DNS subdomain and names the node."""
    from isolators.kubernetes.dra import slice_name
    from tests.support.dra_kubelet import DraPluginCommand
    from tests.support.kube_api import FakeApiServer
    from tests.support.kubelet import plugin_directory

    node = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    assert len(node) == 253
    api = FakeApiServer().start()
    with plugin_directory() as sockets:
        plugin = DraPluginCommand([
            f"--node_name={node}", f"--kubeconfig={api.kubeconfig(tmp_path / 'kubeconfig')}", f"--host_file={DGX8}",
            f"--plugins_registry_dir={sockets}/registry", f"--plugins_dir={sockets}/plugins",
            f"--work_dir={tmp_path}/work", f"--volume_dir={tmp_path}/volume", f"--cdi_spec_dir={tmp_path}"], tmp_path)
        try:
            plugin.start()
            [published] = api.wait_for(lambda api: api.slices(node), "the node's slice", timeout=15)
        finally:
            plugin.close()
            api.close()
    name = published["metadata"]["name"]
    assert name == slice_name(node, "gpu.isolator.dev") and len(name) == 253
    assert name.startswith(node[:200]) and published["spec"]["pool"]["name"] == node
    assert len(published["spec"]["devices"]) == 8
    assert "422 Invalid" not in api.transcript()
