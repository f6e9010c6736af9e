"""R-VO-2 should_inject and R-VO-3 env, as pure functions of the manifest."""

from __future__ import annotations

import pytest

from actors.manifest import ImageManifest
from actors.volume import CONTAINER_PATH, should_inject, volume_env

LABEL = "com.nvidia.volumes.needed"
LD_ADDED = "/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"


@pytest.mark.parametrize("env, labels, expected", [
    ([], {}, False),
    ([], {LABEL: "nvidia_driver"}, True),
    ([], {LABEL: ""}, True),                                  # the label's existence counts
    ([], {"other": "x"}, False),
    (["NVIDIA_VISIBLE_DEVICES=all"], {}, True),
    (["NVIDIA_VISIBLE_DEVICES=0,1"], {}, True),
    (["NVIDIA_VISIBLE_DEVICES=none"], {}, True),              # "none": volume but no GPUs
    (["NVIDIA_VISIBLE_DEVICES="], {LABEL: "x"}, False),       # the variable wins over the label
    (["NVIDIA_VISIBLE_DEVICES=void"], {LABEL: "x"}, False),
    (["NVIDIA_VISIBLE_DEVICES=all"], {LABEL: "x"}, True),
    (["NVIDIA_VISIBLE_DEVICES"], {}, False),                  # no '=': not a setting
    (["NVIDIA_VISIBLE_DEVICES"], {LABEL: "x"}, True),
    (["NVIDIA_VISIBLE_DEVICESX=all"], {}, False),
    (["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=all"], {}, True),  # later wins
])
def test_should_inject(env, labels, expected):
    assert should_inject(ImageManifest(env=env, labels=labels)) is expected


def test_env_without_image_paths():
    assert volume_env(ImageManifest()) == {
        "PATH": "/usr/local/nvidia/bin",
        "LD_LIBRARY_PATH": LD_ADDED,
    }


def test_env_appends_to_the_image_paths_and_leaves_other_variables_out():
    manifest = ImageManifest(env=[
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/bin",
        "LD_LIBRARY_PATH=/opt/lib",
        "CUDA_VERSION=12.4",
    ])
    assert volume_env(manifest) == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/bin:/usr/local/nvidia/bin",
        "LD_LIBRARY_PATH": "/opt/lib:" + LD_ADDED,
    }


def test_env_repeats_nothing_already_present():
    manifest = ImageManifest(env=[
        "PATH=/usr/local/nvidia/bin:/usr/bin",
        "LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/opt/lib:/usr/local/cuda/compat",
    ])
    assert volume_env(manifest) == {
        "PATH": "/usr/local/nvidia/bin:/usr/bin",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/opt/lib:/usr/local/cuda/compat:/usr/local/nvidia/lib",
    }
    # Applying it again to its own result changes nothing.
    again = ImageManifest(env=[f"{k}={v}" for k, v in volume_env(manifest).items()])
    assert volume_env(again) == volume_env(manifest)


def test_env_drops_empty_items_and_uses_the_last_setting():
    manifest = ImageManifest(env=["PATH=/old", "PATH=/bin::/usr/bin:", "LD_LIBRARY_PATH="])
    assert volume_env(manifest) == {
        "PATH": "/bin:/usr/bin:/usr/local/nvidia/bin",
        "LD_LIBRARY_PATH": LD_ADDED,
    }


def test_container_path():
    assert CONTAINER_PATH == "/usr/local/nvidia"
