#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf modules of unicron/proto/ from coordinator.proto.
# Run after editing the .proto and commit the results; the pins of grpcio-tools/protobuf in
# requirements.txt decide the generated code's runtime requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m grpc_tools.protoc -I unicron/proto \
  --python_out=unicron/proto --pyi_out=unicron/proto --grpc_python_out=unicron/proto \
  unicron/proto/coordinator.proto
# protoc writes a top-level import ("import coordinator_pb2"); make it package-relative.
sed -i 's/^import coordinator_pb2 as coordinator__pb2$/from unicron.proto import coordinator_pb2 as coordinator__pb2/' \
  unicron/proto/coordinator_pb2_grpc.py
grep -q '^from unicron.proto import coordinator_pb2 as coordinator__pb2$' unicron/proto/coordinator_pb2_grpc.py \
  || { echo "gen_proto: could not fix the import in coordinator_pb2_grpc.py; protoc's output changed" >&2; exit 1; }
echo "gen_proto: regenerated unicron/proto/coordinator_pb2{,_grpc}.py and coordinator_pb2.pyi" >&2
