"""The kubelet's gRPC APIs: the generated modules, re-exported.

Rules:
- ``pb`` (messages) and ``rpc`` (stubs, servicers, ``add_*_to_server``) are
  the modules ``grpcio-tools`` generated from ``_proto/deviceplugin.proto``
  (deviceplugin v1beta1); ``pods_pb`` / ``pods_rpc`` those of
  ``podresources.proto`` (PodResources v1); ``registration`` /
  ``registration_rpc`` pluginregistration v1; ``dra_v1`` / ``dra_v1beta1``
  (``k8s.io.kubelet.pkg.apis.dra.v1`` / ``.v1beta1``), ``health``
  (``v1.DRAResourceHealth``) and ``health_v1alpha1`` (what kubelets
  1.34-1.36 ask), each with its ``*_rpc`` stubs module. All committed;
  ``python -m isolators.kubernetes._proto.generate`` makes them again, and
  a test checks that doing so changes nothing. Nothing else imports them
  directly.
- ``DRA_VERSIONS`` maps each supported version name the kubelet is told
  (``v1.DRAPlugin``, ``v1beta1.DRAPlugin``) to its (messages, stubs) pair;
  ``HEALTH_VERSIONS`` each health package (``v1``, ``v1alpha1``) alike.
- Importing this loads gRPC and protobuf; the front doors' ``_names``
  modules, which the CLI reads while parsing, load neither.
"""

from __future__ import annotations

from typing import Any

from ._proto import deviceplugin_pb2 as pb
from ._proto import deviceplugin_pb2_grpc as rpc
from ._proto import dra_health_v1_pb2 as health
from ._proto import dra_health_v1_pb2_grpc as health_rpc
from ._proto import dra_health_v1alpha1_pb2 as health_v1alpha1
from ._proto import dra_health_v1alpha1_pb2_grpc as health_v1alpha1_rpc
from ._proto import dra_v1_pb2 as dra_v1
from ._proto import dra_v1_pb2_grpc as dra_v1_rpc
from ._proto import dra_v1beta1_pb2 as dra_v1beta1
from ._proto import dra_v1beta1_pb2_grpc as dra_v1beta1_rpc
from ._proto import pluginregistration_pb2 as registration
from ._proto import pluginregistration_pb2_grpc as registration_rpc
from ._proto import podresources_pb2 as pods_pb
from ._proto import podresources_pb2_grpc as pods_rpc

__all__ = ["pb", "rpc", "pods_pb", "pods_rpc", "registration", "registration_rpc", "dra_v1", "dra_v1_rpc",
           "dra_v1beta1", "dra_v1beta1_rpc", "health", "health_rpc", "health_v1alpha1", "health_v1alpha1_rpc",
           "DRA_VERSIONS", "HEALTH_VERSIONS"]

DRA_VERSIONS: dict[str, tuple[Any, Any]] = {
    "v1.DRAPlugin": (dra_v1, dra_v1_rpc),
    "v1beta1.DRAPlugin": (dra_v1beta1, dra_v1beta1_rpc),
}

HEALTH_VERSIONS: dict[str, tuple[Any, Any]] = {
    "v1": (health, health_rpc),
    "v1alpha1": (health_v1alpha1, health_v1alpha1_rpc),
}
