"""The parts of a container image's manifest that the GPU isolator reads.

Rules:
- An ``ImageManifest`` is the image's environment (``NAME=value`` strings, in
  image order) and its labels. Nothing else of the image matters here: the
  NVIDIA volume decides from them whether to inject itself (R-VO-2) and what
  PATH / LD_LIBRARY_PATH to give the container (R-VO-3).
- ``ImageManifest.from_docker(json_bytes)`` reads a docker v1 image config,
  ``{"config": {"Env": [...], "Labels": {...}}}``. ``config``, ``Env`` and
  ``Labels`` may be missing or ``null`` (an image without them); any other
  key is ignored. Malformed JSON or a wrong type raises ``ManifestError``
  naming where in the document the problem is.
- ``environment()`` splits the env list at the first ``=``; entries without
  one are ignored (as Mesos does); when a name repeats, the later entry wins
  (as docker does).
"""

from __future__ import annotations

import logging

import msgspec

__all__ = ["ImageManifest", "ManifestError"]

logger = logging.getLogger(__name__)


class ManifestError(ValueError):
    """An image manifest that cannot be read; the message says where."""


class _DockerConfig(msgspec.Struct):
    env: list[str] | None = msgspec.field(default=None, name="Env")
    labels: dict[str, str] | None = msgspec.field(default=None, name="Labels")


class _DockerImage(msgspec.Struct):
    config: _DockerConfig | None = None


_docker_decoder = msgspec.json.Decoder(_DockerImage)


class ImageManifest(msgspec.Struct):
    """An image's environment (``["NAME=value", ...]``) and labels."""

    env: list[str] = []
    labels: dict[str, str] = {}

    @classmethod
    def from_docker(cls, json_bytes: bytes | str) -> ImageManifest:
        """Read a docker v1 image config (``{"config": {"Env", "Labels"}}``).

        Raises ``ManifestError`` for malformed JSON or wrong types, with the
        JSON path of the offending value.
        """
        try:
            image = _docker_decoder.decode(json_bytes)
        except msgspec.ValidationError as exc:
            raise ManifestError(f"Invalid docker image manifest: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ManifestError(
                f"Failed to parse docker image manifest as JSON: {exc}") from None
        config = image.config or _DockerConfig()
        return cls(env=list(config.env or []), labels=dict(config.labels or {}))

    def environment(self) -> dict[str, str]:
        """The env list as a dict: split at the first ``=``, later entries win."""
        result: dict[str, str] = {}
        for entry in self.env:
            name, sep, value = entry.partition("=")
            if sep:
                result[name] = value
        return result
