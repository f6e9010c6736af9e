"""ImageManifest: the docker v1 image config reader."""

from __future__ import annotations

import json

import pytest

from actors.manifest import ImageManifest, ManifestError


def test_reads_env_and_labels_from_a_docker_v1_config():
    config = {
        "architecture": "amd64",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "A=b=c"],
            "Labels": {"com.nvidia.volumes.needed": "nvidia_driver", "maintainer": "x"},
            "Cmd": ["/bin/sh"],
        },
        "rootfs": {"type": "layers", "diff_ids": []},
    }
    manifest = ImageManifest.from_docker(json.dumps(config).encode())
    assert manifest == ImageManifest(
        env=["PATH=/usr/local/sbin:/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "A=b=c"],
        labels={"com.nvidia.volumes.needed": "nvidia_driver", "maintainer": "x"})
    assert manifest.environment()["A"] == "b=c"
    assert ImageManifest.from_docker(json.dumps(config)) == manifest  # str works too


@pytest.mark.parametrize("document", [
    b"{}", b'{"config": null}', b'{"config": {}}', b'{"config": {"Env": null, "Labels": null}}',
])
def test_missing_or_null_parts_mean_empty(document):
    assert ImageManifest.from_docker(document) == ImageManifest()


def test_defaults_are_not_shared():
    a, b = ImageManifest(), ImageManifest()
    a.env.append("X=1")
    assert b.env == []


@pytest.mark.parametrize("document, message", [
    (b"{not json", r"^Failed to parse docker image manifest as JSON: "),
    (b"", r"^Failed to parse docker image manifest as JSON: "),
    (b'{"config": {"Env": "PATH=/bin"}}', r"^Invalid docker image manifest: Expected `array \| null`, got `str` - at `\$\.config\.Env`$"),
    (b'{"config": {"Env": [1]}}', r"at `\$\.config\.Env\[0\]`"),
    (b'{"config": {"Labels": {"a": 1}}}', r"Expected `str`, got `int` - at `\$\.config\.Labels\[\.\.\.\]`"),
    (b'{"config": []}', r"Expected `object \| null`, got `array` - at `\$\.config`"),
    (b"[]", r"Expected `object`, got `array`"),
])
def test_bad_documents_give_a_clear_error(document, message):
    with pytest.raises(ManifestError, match=message):
        ImageManifest.from_docker(document)


def test_environment_splits_at_the_first_equals_and_later_entries_win():
    manifest = ImageManifest(env=["A=1", "NOEQUALS", "B=", "A=2"])
    assert manifest.environment() == {"A": "2", "B": ""}
