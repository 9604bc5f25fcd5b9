"""The FileDescriptorSet the data plane's gRPC front answers server reflection from
(dataplane/src/front/grpc/descriptors.binpb), made from the descriptors the installed packages were
generated with, so no protoc is needed:

- Triton's `model_config.proto` and `grpc_service.proto`, as tritonclient ships them (the protocol
  the gRPC front speaks and forwards);
- grpc.health.v1's `health.proto` (grpcio-health-checking);
- `grpc.reflection.v1alpha`'s `reflection.proto` (grpcio-reflection), and `grpc.reflection.v1`'s,
  which is the same messages and service under the v1 package (grpcio-reflection ships v1alpha
  only): made from it by renaming the package and the types it refers to.

Run it again after tritonclient (or grpc.health.v1) changes, from the repository's root:

    .venv/bin/python -m sidecar.devtools.grpc_descriptors dataplane/src/front/grpc/descriptors.binpb

tests/test_grpc.py fails while the vendored file differs from what this makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

VENDORED = Path(__file__).resolve().parents[2] / "dataplane" / "src" / "front" / "grpc" / "descriptors.binpb"


def _reflection_v1(v1alpha: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file under the v1 names (same tags and types)."""
    v1 = descriptor_pb2.FileDescriptorProto()
    v1.CopyFrom(v1alpha)
    v1.name = "grpc/reflection/v1/reflection.proto"
    v1.package = "grpc.reflection.v1"
    v1.ClearField("options")  # v1alpha's are deprecated=true and its language packages
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in v1.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message or enum field (proto2: set only there)
                field.type_name = field.type_name.replace(old, new)
    for service in v1.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return v1


def descriptor_set() -> bytes:
    """The set's bytes: each file after the files it imports."""
    files = [descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
             for module in (model_config_pb2, service_pb2, health_pb2, reflection_pb2)]
    files.append(_reflection_v1(files[-1]))
    return descriptor_pb2.FileDescriptorSet(file=files).SerializeToString(deterministic=True)


def main(argv: list[str]) -> int:
    target = Path(argv[1]) if len(argv) > 1 else VENDORED
    target.write_bytes(descriptor_set())
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
