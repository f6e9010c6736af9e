"""The deviceplugin v1beta1 and podresources v1 messages and stubs: the generated modules, re-exported.

Rules:
- ``pb`` (messages) and ``rpc`` (stubs, servicers, ``add_*_to_server``) are
  the modules ``grpcio-tools`` generated from ``_proto/deviceplugin.proto``;
  ``pods_pb`` and ``pods_rpc`` the same of ``_proto/podresources.proto``
  (committed; ``_proto/generate.py`` makes them again, and a test checks
  that doing so changes nothing). Nothing else imports them directly.
- Importing this loads gRPC and protobuf; the names and constants of the
  API are in ``_names``, which loads neither.
"""

from __future__ import annotations

from ._proto import deviceplugin_pb2 as pb
from ._proto import deviceplugin_pb2_grpc as rpc
from ._proto import podresources_pb2 as pods_pb
from ._proto import podresources_pb2_grpc as pods_rpc

__all__ = ["pb", "rpc", "pods_pb", "pods_rpc"]
